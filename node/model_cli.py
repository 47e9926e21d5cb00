"""`swarmtrain-model`: take what a swarm trained out as a Hugging Face directory, and use it.

    export --checkpoint PATH --out DIR        a coordinator's data dir (its newest kept checkpoint,
                                              or every stage's of a pipeline, put together), its
                                              checkpoints/ or stage-checkpoints/, or one checkpoint
                                              directory -> a directory transformers loads
    sample (--model DIR | --checkpoint PATH)  print the prompt and the model's continuation
    eval (--model DIR | --checkpoint PATH)    validation loss on the windows replicas report theirs on

Which checkpoints PATH means and how they become one model is node/model_source.py; the
conversion node/models/export.py (node/models/stage_merge.py for a pipeline's stages); the
checkpoint format node/state/checkpoint_dir.py. Every mistake of the user's is one line on stderr
and exit 2. The cheap checks come before torch and transformers load (seconds), so a typo is
answered at once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory

from .cli import _Parser
from .model_source import Source, UsageError, assemble, find_source
from .runconfig import RunConfig

HF_PACKAGES = ("transformers", "tokenizers", "safetensors")


CHECKPOINT_HELP = ("a coordinator's data dir (its newest kept checkpoint; a pipeline's: every stage's newest, put together), "
                   "its checkpoints/ or stage-checkpoints/ dir, or one step-XXXXXXXX/ dir")


def _model_or_checkpoint(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="an exported directory")
    which.add_argument("--checkpoint", metavar="PATH", help=f"instead of --model: {CHECKPOINT_HELP}, exported on the fly")


def build_parser() -> argparse.ArgumentParser:
    run = RunConfig()
    p = _Parser(prog="swarmtrain-model", description="Export a swarm's checkpoint as a Hugging Face model directory; sample from it; evaluate it.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{export,sample,eval}", parser_class=_Parser)
    e = sub.add_parser("export", help="a checkpoint -> a Hugging Face directory (config, model.safetensors, tokenizer)")
    e.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    e.add_argument("--out", required=True, metavar="DIR", help="the directory to write (must not exist, or be empty)")
    s = sub.add_parser("sample", help="print a continuation of a prompt")
    _model_or_checkpoint(s)
    s.add_argument("--prompt", default="def ", help="the text to continue (default %(default)r)")
    s.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens (bytes) to add (default %(default)s)")
    s.add_argument("--temperature", type=float, default=0.8, metavar="T", help="softmax temperature; 0: always the most likely token (default %(default)s)")
    s.add_argument("--seed", type=int, default=0, help="seed of the sampling (default %(default)s)")
    v = sub.add_parser("eval", help="validation loss, comparable to the swarm's reported val loss")
    _model_or_checkpoint(v)
    v.add_argument("--data", metavar="PATH", help="text file or directory, as the nodes' --data (default: the built-in corpus)")
    v.add_argument("--batches", type=int, default=run.eval_batches, metavar="N", help="validation batches, as the run's eval_batches (default %(default)s)")
    v.add_argument("--batch-size", type=int, default=run.batch_size, metavar="B", help="windows per batch, as the run's batch_size (default %(default)s)")
    return p


# ---- cheap checks (no torch) ---------------------------------------------------------------------


def check_model_dir(path: str) -> None:
    """What load_hf checks first, before transformers loads (seconds)."""
    if not Path(path).is_dir():
        raise UsageError(f"--model {path}: no such directory")
    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"--model {path}: not a Hugging Face model directory (no config.json)")


def check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out}: exists and is not an empty directory (choose a new one)")


# ---- the commands ---------------------------------------------------------------------------------


def _hf():
    """node.models.export, or UsageError naming the packages it needs."""
    try:
        for name in HF_PACKAGES:
            __import__(name)
        from .models import export
    except ImportError as e:
        raise UsageError(f"swarmtrain-model needs {', '.join(HF_PACKAGES)} (installed with swarmtrain: pip install -c constraints.txt -e .): {e}") from None
    import transformers

    # its advice on loading and its progress bars would bury the one line that matters
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return export


def export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    from .experts_export import export_experts, holds_experts

    if holds_experts(Path(args.checkpoint)):  # an experts run's coordinator: its shards and dense parts together
        return export_experts(Path(args.checkpoint), out)
    source = find_source(Path(args.checkpoint))
    check_out_dir(out)
    model = assemble(_hf(), source)
    _write_atomically(out, model.write)
    print(f"exported {model.what} to {out}: {model.kind}")
    return 0


def _write_atomically(out: Path, write) -> None:
    """Let `write` fill a temp dir beside `out`, then rename it into place: an export that fails
    half-way leaves no half-written model directory behind."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write there: {e.strerror}") from None
    try:
        write(tmp)
        if out.exists():
            out.rmdir()  # empty: checked before
        os.rename(tmp, out)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write there: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sample(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be ≥ 0, got {args.max_new_tokens}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise UsageError(f"--temperature must be a finite number ≥ 0, got {args.temperature}")
    if not args.prompt:
        raise UsageError("--prompt is empty: the model needs at least one token to continue")
    which = _which_model(args)
    ex = _hf()
    with _opened(ex, which) as (model, tokenizer, _):
        ids = tokenizer(args.prompt).input_ids
        try:
            new = ex.continue_ids(model, ids, args.max_new_tokens, args.temperature, args.seed)
        except ex.ExportError as e:  # (a prompt its tokenizer makes no tokens of)
            raise UsageError(f"--prompt {args.prompt!r}: {e}") from None
    print(tokenizer.decode(ids + new))
    return 0


def evaluate(args: argparse.Namespace) -> int:
    if args.batches < 1 or args.batch_size < 1:
        raise UsageError(f"--batches and --batch-size must be ≥ 1, got {args.batches} and {args.batch_size}")
    if args.data is not None and not Path(args.data).exists():
        raise UsageError(f"--data {args.data}: no such file or directory")
    which = _which_model(args)
    ex = _hf()
    with _opened(ex, which) as (model, tokenizer, path):
        return _evaluate(ex, args, model, tokenizer, path)


def _evaluate(ex, args: argparse.Namespace, model, tokenizer, path: str) -> int:
    from .models.data import EVAL_SEED, DataError, evaluate, load_corpus

    probe = "def f(x):\n\treturn 'é€😀'\x00\xff"
    tokens = None  # bytes (the built-in GPT's), else the model's own tokenizer, as the replicas read the data
    if tokenizer(probe).input_ids != list(probe.encode()):
        from .models.hf import ModelDirError, open_model_dir
        from .models.tokens import load_tokenizer

        try:
            tokens = load_tokenizer(open_model_dir(path))
        except ModelDirError as e:
            raise UsageError(f"--model {e}") from None
    from .models.hf import context_of

    context = context_of(model.config)
    try:
        corpus = load_corpus(args.data, tokenizer=tokens)
        loss = evaluate(ex.LossHead(model), corpus.val, args.batch_size, context, args.batches, EVAL_SEED)
    except DataError as e:
        raise UsageError(f"--data: {e}") from None
    print(f"val_loss {loss:.6f} ({args.batches} batches of {args.batch_size} windows of {context} tokens, seed {EVAL_SEED}, data {corpus.source})")
    return 0


def _which_model(args: argparse.Namespace) -> str | Source:
    """--model DIR or --checkpoint PATH, checked before transformers loads (seconds)."""
    if args.checkpoint is not None:
        return find_source(Path(args.checkpoint))
    check_model_dir(args.model)
    return args.model


@contextmanager
def _opened(ex, which: str | Source):
    """(model, tokenizer, its directory) of an exported directory, or of checkpoints exported on
    the fly into a temporary one (gone on leaving), as `export` writes them."""
    if isinstance(which, str):
        yield (*_load(ex, which), which)
        return
    model = assemble(ex, which)
    with TemporaryDirectory(prefix="swarmtrain-model-") as tmp:
        model.write(Path(tmp))
        print(f"note: the model of {model.what}: {model.kind}", file=sys.stderr)
        yield (*_load(ex, tmp), tmp)


def _load(ex, path: str):
    try:
        return ex.load_hf(path)
    except ex.ExportError as e:
        raise UsageError(f"--model {e}") from None


COMMANDS = {"export": export, "sample": sample, "eval": evaluate}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # An exported directory is all it reads: never ask a model hub, whatever the path looks like.
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`swarmtrain-model`: take what a swarm trained out as a Hugging Face directory, and use it.

    export --checkpoint PATH --out DIR   a coordinator's data dir (its newest kept checkpoint) or one
                                         checkpoint directory -> a directory transformers loads
    sample --model DIR [--prompt TEXT]   print the prompt and the model's continuation
    eval --model DIR [--data PATH]       validation loss on the windows replicas report theirs on

The conversion is node/models/export.py; the checkpoint format node/state/checkpoint_dir.py. Every
mistake of the user's is one line on stderr and exit 2. The cheap checks come before torch and
transformers load (seconds), so a typo is answered at once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from protocol.manifest import MANIFEST, step_of_dir_name

from .cli import _Parser
from .runconfig import RunConfig

# What the coordinator keeps under its data dir (coordinator/service.py): replica checkpoints,
# and in pipeline mode one store per stage. Named here, not imported: node never imports coordinator.
REPLICA_CHECKPOINTS = "checkpoints"
STAGE_CHECKPOINTS = "stage-checkpoints"
MODEL_FILES = "model"  # a Hugging Face model's config and tokenizer, by pin (node/state/model_files.py)
HF_PACKAGES = ("transformers", "tokenizers", "safetensors")
SUPPORTED = "replica checkpoints (the built-in GPT tiny or small, or a Hugging Face model)"  # node/models/export.py says the same


class UsageError(Exception):
    """The user's input cannot be used: printed as one line, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    run = RunConfig()
    p = _Parser(prog="swarmtrain-model", description="Export a swarm's checkpoint as a Hugging Face model directory; sample from it; evaluate it.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{export,sample,eval}", parser_class=_Parser)
    e = sub.add_parser("export", help="a checkpoint -> a Hugging Face directory (config, model.safetensors, tokenizer)")
    e.add_argument("--checkpoint", required=True, metavar="PATH", help="a coordinator's data dir (its newest kept checkpoint), its checkpoints/ dir, or one step-XXXXXXXX/ dir")
    e.add_argument("--out", required=True, metavar="DIR", help="the directory to write (must not exist, or be empty)")
    s = sub.add_parser("sample", help="print a continuation of a prompt")
    s.add_argument("--model", required=True, metavar="DIR", help="an exported directory")
    s.add_argument("--prompt", default="def ", help="the text to continue (default %(default)r)")
    s.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens (bytes) to add (default %(default)s)")
    s.add_argument("--temperature", type=float, default=0.8, metavar="T", help="softmax temperature; 0: always the most likely token (default %(default)s)")
    s.add_argument("--seed", type=int, default=0, help="seed of the sampling (default %(default)s)")
    v = sub.add_parser("eval", help="validation loss, comparable to the swarm's reported val loss")
    v.add_argument("--model", required=True, metavar="DIR", help="an exported directory")
    v.add_argument("--data", metavar="PATH", help="text file or directory, as the nodes' --data (default: the built-in corpus)")
    v.add_argument("--batches", type=int, default=run.eval_batches, metavar="N", help="validation batches, as the run's eval_batches (default %(default)s)")
    v.add_argument("--batch-size", type=int, default=run.batch_size, metavar="B", help="windows per batch, as the run's batch_size (default %(default)s)")
    return p


# ---- finding the checkpoint (no torch) ------------------------------------------------------------


def _step_dirs(root: Path) -> list[Path]:
    """The step directories under `root`, newest first."""
    if not root.is_dir():
        return []
    dirs = [(step, p) for p in root.iterdir() if (step := step_of_dir_name(p.name)) is not None and p.is_dir() and not p.is_symlink()]
    return [p for _, p in sorted(dirs, reverse=True)]


def checkpoint_candidates(path: Path) -> list[Path]:
    """The checkpoint directories PATH may mean, newest first: itself (it has a manifest or a step
    directory's name), else the step directories of a coordinator's data dir or of a checkpoints root."""
    if not path.exists():
        raise UsageError(f"--checkpoint {path}: no such file or directory")
    if not path.is_dir():
        raise UsageError(f"--checkpoint {path}: not a directory (give a coordinator's data dir or a step-XXXXXXXX checkpoint dir)")
    if (path / MANIFEST).exists() or step_of_dir_name(path.name) is not None:
        return [path]
    found = _step_dirs(path / REPLICA_CHECKPOINTS) or _step_dirs(path)
    if found:
        return found
    if (path / STAGE_CHECKPOINTS).is_dir():
        raise UsageError(f"--checkpoint {path}: it holds pipeline stage checkpoints only; swarmtrain-model export supports {SUPPORTED} for now")
    raise UsageError(f"--checkpoint {path}: no checkpoint here (neither a {MANIFEST} nor step-XXXXXXXX directories under it or its {REPLICA_CHECKPOINTS}/)")


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


def _verified(candidates: list[Path]):
    """(path, manifest) of the newest candidate whose files match their hashes (and signature): the
    coordinator's newest kept checkpoint, which its store lists only once verified."""
    from .state.checkpoint_dir import CheckpointDirError, verify_checkpoint_dir

    problems = []
    for path in candidates:
        try:
            return path, verify_checkpoint_dir(path)
        except CheckpointDirError as e:
            problems.append(str(e))
            if len(candidates) > 1:
                print(f"note: skipping {e}", file=sys.stderr)
    raise UsageError(problems[-1] if len(problems) == 1 else f"no checkpoint under {candidates[0].parent} verifies (last: {problems[-1]})")


def export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    from .experts_export import export_experts, holds_experts

    if holds_experts(Path(args.checkpoint)):  # an experts run's coordinator: its shards and dense parts together
        return export_experts(Path(args.checkpoint), out)
    candidates = checkpoint_candidates(Path(args.checkpoint))
    check_out_dir(out)
    ex = _hf()
    from .state.checkpoint_dir import CheckpointDirError, load_files

    path, manifest = _verified(candidates)
    pin = (manifest.get("model_config") or {}).get("model") if isinstance(manifest.get("model_config"), dict) else None
    if isinstance(pin, str) and {"expert_shard", "dense"} & set(manifest["model_config"]):
        raise UsageError(f"{path}: one part of an experts run (a shard's experts or the dense parts): export the run from its coordinator's data dir")
    if isinstance(pin, str) and pin.startswith("hf:"):
        return _export_hf(ex, path, manifest, pin, out)
    try:
        cfg = ex.gpt_config_of(manifest.get("model_config"))
        if manifest["files"].keys() - {"model.safetensors", "outer.safetensors"} or "model.safetensors" not in manifest["files"]:
            raise ex.ExportError(f"it holds {', '.join(sorted(manifest['files']))}, not a replica's model (and outer) state; only {SUPPORTED} can be exported")
        state = load_files(path, {"files": {"model.safetensors": manifest["files"]["model.safetensors"]}})["model"]
        ex.gpt2_state_dict(state, cfg)  # refuses a wrong tensor before anything is written
    except (ex.ExportError, CheckpointDirError) as e:
        raise UsageError(f"{path}: {e}") from None
    _write_atomically(out, lambda tmp: ex.save_hf(state, cfg, tmp))
    print(f"exported step {manifest['step']} (state hash {manifest.get('state_hash')}) of {path} to {out}: a GPT2LMHeadModel, {cfg.n_layer} layers, width {cfg.n_embd}, context {cfg.context}")
    return 0


def _export_hf(ex, path: Path, manifest: dict, pin: str, out: Path) -> int:
    """A replica checkpoint of a Hugging Face model: its state, with the run's config and tokenizer
    files, which the coordinator keeps beside its checkpoints (DATA_DIR/model/<pin>)."""
    from .state.checkpoint_dir import CheckpointDirError, load_files

    files = next((d / MODEL_FILES / pin[3:] for d in (path.parent.parent, path.parent) if (d / MODEL_FILES / pin[3:] / "config.json").is_file()), None)
    if files is None:
        raise UsageError(f"{path}: a checkpoint of the Hugging Face model {pin[:19]}…, whose config and tokenizer the coordinator keeps in its "
                         f"data dir ({MODEL_FILES}/<pin>): export from a checkpoint inside the coordinator's data dir")  # fmt: skip
    try:
        state = load_files(path, {"files": {"model.safetensors": manifest["files"]["model.safetensors"]}})["model"]
    except (CheckpointDirError, KeyError) as e:
        raise UsageError(f"{path}: no model state ({e})") from None
    try:
        _write_atomically(out, lambda tmp: ex.save_hf_model(state, files, tmp))
    except ex.ExportError as e:
        raise UsageError(f"{path}: {e}") from None
    print(f"exported step {manifest['step']} (state hash {manifest.get('state_hash')}) of {path} to {out}: the run's Hugging Face model ({pin[:19]}…)")
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
    check_model_dir(args.model)
    ex = _hf()
    model, tokenizer = _load(ex, args.model)
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
    check_model_dir(args.model)
    ex = _hf()
    from .models.data import EVAL_SEED, DataError, evaluate, load_corpus

    model, tokenizer = _load(ex, args.model)
    probe = "def f(x):\n\treturn 'é€😀'\x00\xff"
    tokens = None  # bytes (the built-in GPT's), else the model's own tokenizer, as the replicas read the data
    if tokenizer(probe).input_ids != list(probe.encode()):
        from .models.hf import ModelDirError, open_model_dir
        from .models.tokens import load_tokenizer

        try:
            tokens = load_tokenizer(open_model_dir(args.model))
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

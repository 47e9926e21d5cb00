"""What `swarmtrain-model` reads (node/model_cli.py): the checkpoints `--checkpoint PATH` names,
verified and put together as one model, ready to be written as a Hugging Face directory.

    find_source(path)      which checkpoints PATH means, without torch (a typo is answered at once):
                           a replica's (newest first), or a pipeline's stages (one root per stage)
    assemble(ex, source)   -> Assembled: how to write the model, and what it was made of

What a coordinator keeps under its data dir (coordinator/service.py): replica checkpoints in
checkpoints/, a pipeline's in stage-checkpoints/stage-<i>/, one store per stage, and a Hugging
Face model's config and tokenizer files under model/<pin> (node/state/model_files.py). A replica
checkpoint is the whole model; a pipeline's model is every stage's newest verified checkpoint
put together (node/models/stage_merge.py). Each stage steps on its own, so the steps may differ:
what was taken is said.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.manifest import MANIFEST, step_of_dir_name

if TYPE_CHECKING:
    from .models.stage_merge import StageMeta

# Named here, not imported: node never imports coordinator.
REPLICA_CHECKPOINTS = "checkpoints"
STAGE_CHECKPOINTS = "stage-checkpoints"
STAGE_DIR = re.compile(r"stage-(0|[1-9][0-9]{0,5})")  # coordinator/service.py: f"stage-{i}"
MODEL_FILES = "model"  # a Hugging Face model's config and tokenizer, by pin (node/state/model_files.py)


class UsageError(Exception):
    """The user's input cannot be used: printed as one line, exit 2."""


@dataclass(frozen=True)
class Source:
    """The checkpoints PATH names: `replicas` (newest first) or `stages` (index -> the stage's
    checkpoint root), and the data dirs the run's model files may be under."""

    path: Path
    replicas: list[Path] = field(default_factory=list)
    stages: dict[int, Path] = field(default_factory=dict)
    data_dirs: tuple[Path, ...] = ()


def _step_dirs(root: Path) -> list[Path]:
    """The step directories under `root`, newest first."""
    if not root.is_dir():
        return []
    dirs = [(step, p) for p in root.iterdir() if (step := step_of_dir_name(p.name)) is not None and p.is_dir() and not p.is_symlink()]
    return [p for _, p in sorted(dirs, reverse=True)]


def _stage_roots(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    return {int(m.group(1)): p for p in root.iterdir() if (m := STAGE_DIR.fullmatch(p.name)) and p.is_dir() and not p.is_symlink()}


def _newest_mtime(dirs: list[Path]) -> float:
    return max((d.stat().st_mtime for d in dirs), default=0.0)


def find_source(path: Path) -> Source:
    """The checkpoints PATH may mean: itself (it has a manifest or a step directory's name), else
    the step directories of a coordinator's data dir or of a checkpoints root, else the stages of
    a pipeline's data dir or of its stage-checkpoints/. A data dir that holds both (a pipeline's
    whose model came with weights keeps them as a replica checkpoint) gives the kind written last."""
    if not path.exists():
        raise UsageError(f"--checkpoint {path}: no such file or directory")
    if not path.is_dir():
        raise UsageError(f"--checkpoint {path}: not a directory (give a coordinator's data dir or a step-XXXXXXXX checkpoint dir)")
    if (path / MANIFEST).exists() or step_of_dir_name(path.name) is not None:
        return Source(path, replicas=[path], data_dirs=(path.parent.parent, path.parent))
    replicas = _step_dirs(path / REPLICA_CHECKPOINTS) or _step_dirs(path)
    stage_root = next((r for r in (path / STAGE_CHECKPOINTS, path) if _stage_roots(r)), None)
    stages = _stage_roots(stage_root) if stage_root is not None else {}
    if replicas:
        staged = [d for root in stages.values() for d in _step_dirs(root)]
        if not staged or _newest_mtime(replicas) >= _newest_mtime(staged):
            return Source(path, replicas=replicas, data_dirs=(replicas[0].parent.parent, replicas[0].parent))
        print(f"note: {path} holds replica and pipeline stage checkpoints; taking the stages', written last", file=sys.stderr)
    if stages:
        return Source(path, stages=stages, data_dirs=(stage_root.parent,))
    raise UsageError(f"--checkpoint {path}: no checkpoint here (neither a {MANIFEST} nor step-XXXXXXXX directories under it, "
                     f"its {REPLICA_CHECKPOINTS}/, or the stage-<i>/ of its {STAGE_CHECKPOINTS}/)")  # fmt: skip


# ---- verifying and loading (torch from here on) ---------------------------------------------------


def verified(candidates: list[Path]):
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


def model_tensors(path: Path, manifest: dict):
    """The model tensors of a verified checkpoint (model.safetensors; not the optimizers' state)."""
    from .state.checkpoint_dir import CheckpointDirError, load_files

    if "model.safetensors" not in manifest["files"]:
        raise UsageError(f"{path}: no model.safetensors (it holds {', '.join(sorted(manifest['files']))})")
    try:
        return load_files(path, {"files": {"model.safetensors": manifest["files"]["model.safetensors"]}})["model"]
    except CheckpointDirError as e:
        raise UsageError(f"{path}: no model state ({e})") from None


def model_files(source: Source, pin: str, where: Path) -> Path:
    """The run's config and tokenizer files, which the coordinator keeps beside its checkpoints."""
    from .state.model_files import ModelFilesError, local_model_dir

    try:
        found = next((d for root in source.data_dirs if (d := local_model_dir(root / MODEL_FILES, pin)) is not None), None)
    except ModelFilesError as e:
        raise UsageError(f"{where}: its manifest names the model {e}") from None
    if found is None:
        raise UsageError(f"{where}: a checkpoint of the Hugging Face model {pin[:19]}…, whose config and tokenizer the coordinator keeps in its "
                         f"data dir ({MODEL_FILES}/<pin>): export from the coordinator's data dir")  # fmt: skip
    return found


@dataclass(frozen=True)
class Assembled:
    """A model ready to write: `write(dir)` fills an existing empty directory (UsageError if the
    tensors do not fit the model); `what` it was taken from, `kind` of model it is."""

    write: Callable[[Path], None]
    what: str
    kind: str


def _guarded(ex, where: Path, write: Callable[[Path], None]) -> Callable[[Path], None]:
    def run(out: Path) -> None:
        try:
            write(out)
        except ex.ExportError as e:
            raise UsageError(f"{where}: {e}") from None

    return run


def assemble(ex, source: Source) -> Assembled:
    """The model `source` holds (`ex`: node.models.export, imported by the caller)."""
    return _pipeline(ex, source) if source.stages else _replica(ex, source)


def _replica(ex, source: Source) -> Assembled:
    path, manifest = verified(source.replicas)
    what = f"step {manifest['step']} (state hash {manifest.get('state_hash')}) of {path}"
    config = manifest.get("model_config")
    pin = config.get("model") if isinstance(config, dict) else None
    if isinstance(pin, str) and {"expert_shard", "dense"} & set(config):
        raise UsageError(f"{path}: one part of an experts run (a shard's experts or the dense parts): export the run from its coordinator's data dir")
    if isinstance(pin, str) and pin.startswith("hf:") and "stage" not in config:
        files = model_files(source, pin, path)
        state = model_tensors(path, manifest)
        return Assembled(_guarded(ex, path, lambda out: ex.save_hf_model(state, files, out)), what, f"the run's Hugging Face model ({pin[:19]}…)")
    try:
        cfg = ex.gpt_config_of(config)
        if manifest["files"].keys() - {"model.safetensors", "outer.safetensors"} or "model.safetensors" not in manifest["files"]:
            raise ex.ExportError(f"it holds {', '.join(sorted(manifest['files']))}, not a replica's model (and outer) state; only {ex.SUPPORTED} can be exported")
        state = model_tensors(path, manifest)
        ex.gpt2_state_dict(state, cfg)  # refuses a wrong tensor before anything is written
    except ex.ExportError as e:
        raise UsageError(f"{path}: {e}") from None
    return Assembled(_guarded(ex, path, lambda out: ex.save_hf(state, cfg, out)), what, _gpt_kind(cfg))


def _gpt_kind(cfg) -> str:
    return f"a GPT2LMHeadModel, {cfg.n_layer} layers, width {cfg.n_embd}, context {cfg.context}"


@dataclass(frozen=True)
class _Stage:
    path: Path  # its checkpoint directory
    step: int
    manifest: dict
    meta: StageMeta


def _stage_checkpoints(ex, source: Source) -> tuple[dict[int, _Stage], dict[int, str]]:
    """Each stage's newest verified checkpoint, and why a stage has none."""
    from .models.stage_merge import StageMeta

    found, why = {}, {}
    for index, root in sorted(source.stages.items()):
        candidates = _step_dirs(root)
        if not candidates:
            why[index] = "no checkpoint in it"
            continue
        try:
            path, manifest = verified(candidates)
        except UsageError as e:
            why[index] = str(e)
            continue
        try:
            meta = StageMeta.of(manifest.get("model_config"))
        except ex.ExportError as e:
            raise UsageError(f"{path}: {e}") from None
        if meta.index != index:
            raise UsageError(f"{path}: its manifest says stage {meta.index}, its directory {root.name}")
        found[index] = _Stage(path, manifest["step"], manifest, meta)
    return found, why


def _all_stages(ex, source: Source, root: Path) -> list[_Stage]:
    """Every stage of the cut, in order; UsageError naming the stages that have no checkpoint, and why."""
    from .models.stage_merge import one_cut

    found, why = _stage_checkpoints(ex, source)
    if not found:
        raise UsageError(f"--checkpoint {source.path}: no stage has a checkpoint yet ({'; '.join(f'stage-{i}: {w}' for i, w in sorted(why.items()))})")
    try:
        num_stages = one_cut([s.meta for _, s in sorted(found.items())])
    except ex.ExportError as e:
        raise UsageError(f"{root}: {e}") from None
    missing = [i for i in range(num_stages) if i not in found]
    if missing:
        reasons = "; ".join(f"{STAGE_CHECKPOINTS}/stage-{i}: {why.get(i, 'no such directory')}" for i in missing)
        which = f"stage {missing[0]} of the {num_stages}-stage cut has" if len(missing) == 1 else f"stages {', '.join(map(str, missing))} of the {num_stages}-stage cut have"
        raise UsageError(f"--checkpoint {source.path}: {which} no checkpoint ({reasons}); every stage is needed to export the model")
    return [found[i] for i in range(num_stages)]


def _pipeline(ex, source: Source) -> Assembled:
    from .models.hf import ModelDirError, open_model_dir
    from .models.stage_merge import gpt_stages, hf_stages

    root = next(iter(source.stages.values())).parent
    stages = _all_stages(ex, source, root)
    parts = [(s.meta, model_tensors(s.path, s.manifest)) for s in stages]
    steps = ", ".join(f"stage {i} at step {s.step}" for i, s in enumerate(stages))
    what = f"the {len(stages)} stages of {root} ({steps})"
    pin = stages[0].meta.pin
    try:
        if pin is None:
            state, cfg = gpt_stages(parts)
            ex.gpt2_state_dict(state, cfg)  # refuses a wrong tensor before anything is written
            return Assembled(_guarded(ex, root, lambda out: ex.save_hf(state, cfg, out)), what, _gpt_kind(cfg))
        files = model_files(source, pin, root)
        state, untie = hf_stages(parts, open_model_dir(files).config)
    except (ex.ExportError, ModelDirError) as e:
        raise UsageError(f"{root}: {e}") from None
    kind = f"the run's Hugging Face model ({pin[:19]}…)" + (", its output head untied from the input embedding, as the pipeline trained it" if untie else "")
    return Assembled(_guarded(ex, root, lambda out: ex.save_hf_model(state, files, out, untie=untie)), what, kind)

"""`swarmtrain-model export` of an experts run: its coordinator keeps each shard's experts and the
trainers' dense parts in stores of their own (coordinator/expert_stores.py), and the newest
verified checkpoint of each becomes one Hugging Face directory (node/models/export_experts.py).
A shard without a kept checkpoint is refused by name (its experts would be missing), as is a run
of a built-in MoE preset, which has no Hugging Face class. The stores are synchronised each on
its own: the shards' and the dense parts' newest are of rounds close in time, not one step.
"""

from __future__ import annotations

import re
from pathlib import Path

EXPERT_CHECKPOINTS = "expert-checkpoints"  # coordinator/expert_stores.py's names (node never imports the coordinator)
DENSE = "dense"
_SHARD = re.compile(r"shard-(\d+)")


def holds_experts(path: Path) -> bool:
    """Whether `path` is the data dir of an experts run's coordinator."""
    return (path / EXPERT_CHECKPOINTS).is_dir()


def export_experts(path: Path, out: Path) -> int:
    """Export the experts run whose coordinator's data dir is `path` into `out` (UsageError, one
    line, for what cannot be exported)."""
    from .model_cli import _hf, _write_atomically, check_out_dir
    from .model_source import MODEL_FILES, UsageError, _step_dirs
    from .model_source import verified as _verified

    root = path / EXPERT_CHECKPOINTS
    stores = {int(m.group(1)): p for p in root.iterdir() if (m := _SHARD.fullmatch(p.name)) and p.is_dir()}
    where = f"--checkpoint {path}"
    if not stores:
        raise UsageError(f"{where}: {root} holds no shard-<i> checkpoints of an experts run")
    absent = sorted(set(range(max(stores) + 1)) - set(stores))
    if absent:
        raise UsageError(f"{where}: shard {absent[0]} has no store ({root / f'shard-{absent[0]}'} is missing): its experts cannot be exported")
    check_out_dir(out)
    picked = {}
    for i, store in sorted(stores.items()):
        candidates = _step_dirs(store)
        if not candidates:
            raise UsageError(f"{where}: shard {i} has no kept checkpoint (in {store}): its experts cannot be exported; let its hosts train until the coordinator keeps one")
        picked[i] = _verified(candidates)
    candidates = _step_dirs(root / DENSE)
    if not candidates:
        raise UsageError(f"{where}: the trainers' dense parts have no kept checkpoint (in {root / DENSE}); let the trainers train until the coordinator keeps one")
    dense_path, dense_manifest = _verified(candidates)
    models = {_model_of(m) for _, m in (*picked.values(), (dense_path, dense_manifest))}
    if len(models) != 1:
        raise UsageError(f"{where}: its checkpoints are of different models ({', '.join(sorted(map(str, models)))})")
    (pin,) = models
    if not (isinstance(pin, str) and pin.startswith("hf:")):
        raise UsageError(f"{where}: an experts run of a built-in MoE preset (tiny-moe, small-moe), which has no Hugging Face class; "
                         "swarmtrain-model exports experts runs of a Hugging Face Mixtral")  # fmt: skip
    files = path / MODEL_FILES / pin[3:]
    if not (files / "config.json").is_file():
        raise UsageError(f"{where}: the run's model files ({files}) are missing: the coordinator keeps them beside its checkpoints")
    ex = _hf()
    from .models.export_experts import save_experts_model

    shards = {i: _model_state(p, m, UsageError) for i, (p, m) in picked.items()}
    dense = _model_state(dense_path, dense_manifest, UsageError)
    try:
        _write_atomically(out, lambda tmp: save_experts_model(shards, dense, files, tmp))
    except ex.ExportError as e:
        raise UsageError(f"{where}: {e}") from None
    steps = ", ".join(f"shard {i} step {m['step']}" for i, (_, m) in sorted(picked.items()))
    print(f"exported the experts run of {path} to {out}: the run's Hugging Face model ({pin[:19]}…), {len(shards)} shards ({steps}), dense parts step {dense_manifest['step']}")
    return 0


def _model_of(manifest: dict):
    meta = manifest.get("model_config")
    return meta.get("model") if isinstance(meta, dict) else None


def _model_state(path: Path, manifest: dict, error: type[Exception]):
    from .state.checkpoint_dir import CheckpointDirError, load_files

    try:
        return load_files(path, {"files": {"model.safetensors": manifest["files"]["model.safetensors"]}})["model"]
    except (CheckpointDirError, KeyError) as e:
        raise error(f"{path}: no model state ({e})") from None

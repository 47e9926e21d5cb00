"""The training run's settings: set once on the coordinator (its flags, env vars and file map onto
them, see coordinator/config.py), handed to every member with its role as JSON, read back here.

`RunConfig` checks itself on construction like a wire message: every field's type (from its
hint) and bounds, a bad one refused as `RunConfigError` naming the field and the value. Its
defaults are the run's defaults everywhere: `TrainConfig` (node/models/diloco.py) takes its own from
here. Standard library only, so the coordinator's CLI reads it before torch loads.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import Check, ConfigError, at_least, below_one, between, check_fields, one_of, positive

if TYPE_CHECKING:
    from protocol.messages import RoleAssignment

    from .models.diloco import TrainConfig
    from .models.gpt import GPTConfig

# Named here without importing torch; a test keeps them equal to node/models/gpt.py PRESETS, the
# codecs registered in protocol/codecs.py, the int8 codec's block size range and the sparse codec's
# bounds (protocol/sparse.py).
MODEL_PRESETS = ("tiny", "small", "tiny-moe", "small-moe")  # *-moe: mixture-of-experts (node/models/moe.py MOE_PRESETS)
MOE_EXPERTS = {"tiny-moe": 4, "small-moe": 8}  # experts per layer of each MoE preset
CODECS = ("none", "fp16", "int8", "topk", "powersgd", "sparse")
STAGE_ROUTINGS = ("through", "relay")  # how a trainer's micro-batch travels between stages (node/roles/stage_server.py)
INNER_PHASES = ("steps", "time")  # how long a replica's inner phase lasts (node/roles/budget.py)
STAGE_CLIPS = ("global", "stage")  # what a stage's step clips its gradient by (node/roles/stage_compute.py clipped_step)
ACTIVATION_CODECS = ("none", "fp16", "int8")  # element-wise codecs: an activation's every value arrives
INT8_BLOCK_SIZES = (16, 1 << 20)
SPARSE_BITS = (1, 8)
SPARSE_CHUNKS = (16, 1 << 16)


class RunConfigError(ConfigError, ValueError):
    """A run setting is wrong (the coordinator's flag, or the config a coordinator sent)."""


@dataclass(frozen=True)
class RunConfig:
    """The run's training settings; the coordinator hands the same ones to every member."""

    # model preset (node/models/gpt.py, node/models/moe.py): tiny | small; experts mode: tiny-moe |
    # small-moe; or a Hugging Face model directory, which the coordinator replaces with its pin
    # (hf:<sha256>, node/state/model_files.py) before handing the run to anyone
    model: str = "tiny"
    inner_steps: int = 20  # H: local AdamW steps between two averaging rounds
    batch_size: int = 16  # sequences per inner step, per replica
    inner_lr: float = 3e-3  # peak AdamW learning rate, reached after warmup
    warmup_steps: int = 50  # inner steps of linear learning rate warmup
    total_steps: int = 5000  # inner steps of cosine learning rate decay; later steps hold the floor
    outer_lr: float = 1.0  # outer Nesterov SGD learning rate
    outer_momentum: float = 0.9  # outer Nesterov momentum, in [0, 1)
    codec: str = "int8"  # how pseudo-gradients travel: none | fp16 | int8 | topk | powersgd | sparse
    block_size: int = 1024  # int8 codec: values per absmax block
    sparse_density: float = 0.02  # sparse codec: fraction of each chunk's values sent (the largest), in (0, 1]
    sparse_bits: int = 2  # sparse codec: bits per sent value (a sign and bits - 1 of magnitude level)
    sparse_chunk: int = 4096  # sparse codec: elements per chunk (each sends its own largest values)
    max_outer_steps: int = 0  # replicas stop training after this many outer steps; 0: never
    checkpoint_every: int = 5  # outer steps between two checkpoints
    eval_batches: int = 8  # validation batches after each outer step
    seed: int = 0  # seed of the model's initialisation and of data sampling
    join_timeout_s: float = 15.0  # seconds an averaging round waits for late replicas
    min_replicas: int = 1  # training starts once this many replicas are registered; fewer never take an outer step (1: a lone replica trains on its own)
    # steps: every replica takes inner_steps per outer step (a round waits for the slowest); time: a
    # replica stops early once half of the replicas wait to average, weighed by its samples (node/roles/budget.py)
    inner_phase: str = "steps"
    # the model's parameters cut into this many fragments, each averaged in its own round while the
    # inner steps go on (Streaming DiLoCo, node/roles/streaming.py); 1: the whole model at once,
    # training paused while it is averaged. At most inner_steps
    fragments: int = 1
    # pipeline mode (the coordinator's --mode pipeline): the model cut into stages
    num_stages: int = 0  # stages the model is cut into (each holds at least one block)
    stage_blocks: str = ""  # blocks per stage, in order, e.g. "2,1,1" (they add up to the model's); empty: even
    activation_codec: str = "none"  # how activations and their gradients travel between stages: none | fp16 | int8
    stage_step_samples: int = 64  # samples a stage server accumulates gradients over before an optimizer step
    micro_batches_in_flight: int = 4  # micro-batches (of batch_size sequences) a trainer keeps in the pipeline
    # a trainer starts a stage step's micro-batches (stage_step_samples / batch_size) only once the
    # previous step's have all come back: synchronous pipeline training (no forward on weights
    # older than the last step) with one trainer, bounded staleness with several
    synchronous_steps: bool = False
    stage_routing: str = "through"  # through: stages hand activations to each other; relay: every activation goes back to the trainer
    # global: by the norm of every stage's gradient together, as one process clips the whole
    # model's (the stages hand each other their norms, and a step waits for the other stages');
    # stage: each stage by its own gradient's norm, as torch.distributed.pipelining's ranks clip
    # when each clips its own parameters (a stage steps once its share of the step is in)
    stage_clip: str = "global"
    stage_sync_every_s: float = 10.0  # seconds between two synchronisations of a stage's peers (with the run's codec)
    stage_outer_momentum: float = 0.0  # Nesterov momentum of those syncs' outer step (lr 1); 0: plain parameter averaging
    # experts mode (--mode experts): a MoE model's experts served by expert hosts; stage_step_samples,
    # stage_sync_every_s, stage_outer_momentum and activation_codec apply to them as to stages
    # trainers (pipeline and experts modes) send this fraction of their calls to stage servers and
    # expert hosts to a second peer of the slot too, and ban a peer caught answering wrong
    # (node/roles/audit.py; under stage_routing "through": this fraction of micro-batches go relay, each call checked); 0: never
    audit_fraction: float = 0.05
    expert_shards: int = 0  # the experts split into this many shards (expert e of every layer: shard e mod expert_shards); a host serves one shard

    def __post_init__(self) -> None:
        check_fields(self, _CHECKS, RunConfigError)
        if self.warmup_steps > self.total_steps:
            raise RunConfigError(f"warmup_steps ({self.warmup_steps}) must not exceed total_steps ({self.total_steps}): the learning rate would still be warming up when its decay ends", "warmup_steps")
        if self.inner_phase == "time" and self.fragments > 1:
            raise RunConfigError("inner_phase \"time\" needs fragments 1: with fragments every replica's rounds run alongside its inner steps", "inner_phase")
        if self.fragments > self.inner_steps:
            raise RunConfigError(f"fragments ({self.fragments}) must not exceed inner_steps ({self.inner_steps}): each fragment's round runs alongside at least one inner step", "fragments")
        if self.synchronous_steps and self.stage_step_samples % self.batch_size:
            raise RunConfigError(f"synchronous_steps needs stage_step_samples ({self.stage_step_samples}) to be a multiple of batch_size ({self.batch_size})", "stage_step_samples")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RunConfig:
        """Keys this version does not know are ignored: a newer coordinator may send more."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    @classmethod
    def from_json(cls, data: bytes) -> RunConfig:
        try:
            raw = json.loads(data) if data else {}
        except ValueError as e:
            raise RunConfigError(f"run config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise RunConfigError("run config must be a JSON object")
        try:
            return cls.from_dict(raw)
        except RunConfigError as e:
            raise RunConfigError(f"run config: {e}", e.setting) from None

    def codec_params(self) -> dict[str, Any]:
        """The params of the run's codec, as `protocol.make_codec(self.codec, **params)` takes them."""
        if self.codec == "int8":
            return {"block_size": self.block_size}
        if self.codec == "sparse":
            return {"density": self.sparse_density, "bits": self.sparse_bits, "chunk": self.sparse_chunk}
        return {}

    @property
    def is_moe(self) -> bool:
        return self.model in MOE_EXPERTS

    @property
    def is_hf(self) -> bool:
        """A Hugging Face model (its directory, or the pin nodes get)."""
        return self.model not in MODEL_PRESETS

    def model_config(self) -> GPTConfig:
        from .models.gpt import PRESETS

        if self.is_hf:
            raise RunConfigError(f"model {self.model!r} is a Hugging Face model, not a built-in preset", "model")
        if self.is_moe:
            return self.moe_preset()[0]
        return PRESETS[self.model]

    def moe_preset(self):
        """(GPTConfig, MoEConfig) of a MoE model; RunConfigError for a dense one."""
        from .models.moe import MOE_PRESETS

        if not self.is_moe:
            raise RunConfigError(f"model {self.model!r} has no experts (experts mode takes a -moe model: tiny-moe | small-moe, or a Hugging Face Mixtral)", "model")
        return MOE_PRESETS[self.model]

    def check_experts(self, experts: int | None = None) -> None:
        """RunConfigError unless the model has experts and expert_shards fits them (no torch).
        `experts`: experts per layer of a Hugging Face model (its config's num_local_experts)."""
        if experts is None:
            if not self.is_moe:
                raise RunConfigError(f"model {self.model!r} has no experts (experts mode takes a -moe model: tiny-moe | small-moe, or a Hugging Face Mixtral)", "model")
            experts = MOE_EXPERTS[self.model]
        if not 1 <= self.expert_shards <= experts:
            raise RunConfigError(f"expert_shards must be in 1..{experts} (the experts per layer of {self.model}), got {self.expert_shards}", "expert_shards")

    def expert_shard(self, shard: int, layers: int | None = None, experts: int | None = None) -> tuple[str, ...]:
        """The experts shard `shard` holds: expert e of every layer with e mod expert_shards == shard;
        RunConfigError when the shards do not fit the model. A preset's layers and experts are
        known; a Hugging Face model's come from its config (num_hidden_layers, num_local_experts)."""
        from .models.moe import expert_name

        if layers is None or experts is None:
            gpt, moe = self.moe_preset()
            layers, experts = gpt.n_layer, moe.num_experts
        self.check_experts(experts)
        if not 0 <= shard < self.expert_shards:
            raise RunConfigError(f"expert shard {shard} is not a shard of this run (0..{self.expert_shards - 1})", "expert_shards")
        return tuple(expert_name(layer, e) for layer in range(layers) for e in range(shard, experts, self.expert_shards))

    def stage_plan(self, dims=None) -> tuple[tuple[int, int], ...]:
        """[start, end) blocks of each stage (node/models/stages.py plan_stages) of a model sized by
        `dims` (default: the preset's config; a Hugging Face model's: hf_stages.dims_of);
        RunConfigError when num_stages and stage_blocks do not fit the model."""
        from .models.stages import plan_stages

        counts = [int(c) for c in self.stage_blocks.replace(" ", "").split(",")] if self.stage_blocks.strip() else None
        try:
            return plan_stages(self.model_config() if dims is None else dims, self.num_stages, counts)
        except ValueError as e:
            raise RunConfigError(f"pipeline cut: {e} (model {self.model!r}, num_stages {self.num_stages}, stage_blocks {self.stage_blocks!r})", "num_stages") from None

    def train_config(self) -> TrainConfig:
        from .models.diloco import TrainConfig

        run = self.to_dict()
        return TrainConfig(**{f.name: run[f.name] for f in dataclasses.fields(TrainConfig) if f.name in run})


_CHECKS: dict[str, Check] = {
    "model": lambda v: _model(v),
    "inner_steps": at_least(1), "batch_size": at_least(1), "inner_lr": positive, "warmup_steps": at_least(0),
    "total_steps": at_least(1), "outer_lr": positive, "outer_momentum": below_one, "codec": one_of(*CODECS),
    "block_size": between(*INT8_BLOCK_SIZES), "sparse_density": lambda v: None if 0 < v <= 1 else "must be in (0, 1]",
    "sparse_bits": between(*SPARSE_BITS), "sparse_chunk": between(*SPARSE_CHUNKS), "max_outer_steps": at_least(0), "checkpoint_every": at_least(1),
    "eval_batches": at_least(1), "seed": at_least(0), "join_timeout_s": positive, "min_replicas": at_least(1),
    "inner_phase": one_of(*INNER_PHASES),
    "fragments": at_least(1),
    "num_stages": at_least(0), "stage_blocks": lambda v: None if re.fullmatch(r"(\d+(,\d+)*)?", v.replace(" ", "")) else "must be block counts separated by commas, e.g. 2,1,1",
    "activation_codec": one_of(*ACTIVATION_CODECS), "stage_step_samples": at_least(1), "micro_batches_in_flight": at_least(1),
    "stage_routing": one_of(*STAGE_ROUTINGS), "stage_clip": one_of(*STAGE_CLIPS), "synchronous_steps": lambda v: None,  # (a bool: its type is all there is to check)
    "stage_sync_every_s": positive, "stage_outer_momentum": below_one, "expert_shards": at_least(0),
    "audit_fraction": lambda v: None if 0 <= v <= 1 else "must be in [0, 1]",
}  # fmt: skip


HF_PIN = re.compile(r"hf:[0-9a-f]{64}")


def _model(v: str) -> str | None:
    if v in MODEL_PRESETS or HF_PIN.fullmatch(v) or "/" in v or v.startswith((".", "~")):
        return None  # a path is checked by the coordinator (coordinator/config.py), which alone reads it
    return f"is an unknown model preset (known: {', '.join(MODEL_PRESETS)}), and not a path to a Hugging Face model directory"


def run_config_of(assignment: RoleAssignment) -> RunConfig:
    return RunConfig.from_json(assignment.config)

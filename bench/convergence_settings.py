"""The settings every arm of bench/convergence.py shares, and the warm-start checkpoint file.

Kept apart from the CLI so that the arm (a) workers (one process per rank) import only this,
torch and node/, never argparse wiring or the other arms.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from node.models.diloco import TrainConfig
from node.models.gpt import PRESETS, GPTConfig


@dataclass(frozen=True)
class Settings:
    """One convergence comparison. Steps are inner (optimizer) steps of one replica."""

    preset: str = "small"  # model shape, a key of node.models.gpt.PRESETS
    warmup_steps: int = 600  # steps of the shared synchronous warm start (one stream, before any arm)
    steps: int = 800  # steps every arm trains after the warm start (per replica / per rank)
    # H: inner steps between two outer steps; also the evaluation interval. 40, not the issue's
    # reference 50: 20% more bytes (still >150x fewer than sync DP), 0.5% lower loss here
    inner_steps: int = 40
    replicas: int = 4  # DiLoCo replicas / data-parallel ranks
    batch_size: int = 16  # sequences per step per replica (the sync arm's global batch is replicas·this)
    inner_lr: float = 3e-3  # peak AdamW lr of every arm
    warm_lr: float = 3e-3  # peak AdamW lr of the warm start
    lr_warmup: int = 50  # linear lr warmup steps at the start of the warm start and of each arm (fresh AdamW)
    outer_lr: float = 1.0  # DiLoCo outer Nesterov SGD lr
    # DiLoCo outer Nesterov momentum. 0.8, not the reference 0.9: on this model after the warm
    # start, 0.9 -> 1.2896, 0.85 -> 1.2815, 0.8 -> 1.2741, 0.7 -> 1.2803 (arm c, H=50)
    outer_momentum: float = 0.8
    codec: str = "int8"  # pseudo-gradient codec of (b)/(c): int8 | fp16 | none
    slow_replica: float = 1.0  # (b)/(u): the last replica's inner steps take this many times as long (a slower machine)
    block_size: int = 1024  # int8 codec: elements per absmax block
    # arm (s), DiLoCo with the sparse codec through the all-reduce's arithmetic: its own H and
    # outer step, and the codec's params (protocol/sparse.py)
    sparse_inner_steps: int = 40  # H of (s)
    sparse_outer_lr: float = 1.0
    sparse_outer_momentum: float = 0.8
    sparse_density: float = 0.02  # fraction of each chunk's values sent
    sparse_bits: int = 2  # bits per sent value
    sparse_chunk: int = 4096  # elements per chunk
    eval_batches: int = 16  # validation batches of batch_size windows each, every evaluation
    eval_seed: int = 1234  # which validation windows: the same for every arm and every evaluation
    seed: int = 0  # data sampling seed (rank/replica r samples with seed + r)
    threads: int = 1  # torch intra-op threads per process
    join_timeout_s: float = 60.0  # (b): how long an averaging round waits for late replicas (stragglers on shared cores)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r} (one of {', '.join(PRESETS)})")
        for name in ("steps", "inner_steps", "batch_size", "eval_batches", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if not (self.inner_lr > 0 and self.warm_lr > 0):
            raise ValueError(f"inner_lr and warm_lr must be > 0, got {self.inner_lr} and {self.warm_lr}")
        if self.warmup_steps < 0 or self.lr_warmup < 0 or self.seed < 0:
            raise ValueError("warmup_steps, lr_warmup and seed must be ≥ 0")
        if self.replicas < 2:
            raise ValueError(f"replicas must be ≥ 2 (an all-reduce needs peers), got {self.replicas}")
        for name in ("inner_steps", "sparse_inner_steps"):
            if getattr(self, name) < 1 or self.steps % getattr(self, name):
                raise ValueError(f"steps ({self.steps}) must be a multiple of {name} ({getattr(self, name)})")
        from protocol import LocalProtocolError, make_codec

        try:
            make_codec("sparse", **self.sparse_params())  # a bad param is named now, not after the warm start
        except LocalProtocolError as e:
            raise ValueError(str(e)) from None
        if not 1.0 <= self.slow_replica <= 100.0:
            raise ValueError(f"slow_replica must be in [1, 100], got {self.slow_replica}")
        if not self.join_timeout_s > 0:
            raise ValueError(f"join_timeout_s must be > 0, got {self.join_timeout_s}")
        if self.codec not in ("int8", "fp16", "none"):
            raise ValueError(f"codec must be int8, fp16 or none, got {self.codec!r}")

    @property
    def outer_steps(self) -> int:
        return self.steps // self.inner_steps

    def model_config(self) -> GPTConfig:
        return PRESETS[self.preset]

    def train_config(self) -> TrainConfig:
        """What each arm trains with after the warm start: a fresh AdamW whose lr warms up again
        and decays (cosine) over `steps`."""
        return TrainConfig(
            batch_size=self.batch_size, inner_lr=self.inner_lr, warmup_steps=self.lr_warmup,
            total_steps=self.steps, inner_steps=self.inner_steps, outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum, seed=self.seed,
        )  # fmt: skip

    def warm_train_config(self) -> TrainConfig:
        return TrainConfig(
            batch_size=self.batch_size, inner_lr=self.warm_lr, warmup_steps=min(self.lr_warmup, self.warmup_steps),
            total_steps=max(1, self.warmup_steps), seed=self.seed,
        )  # fmt: skip

    def warm_key(self) -> dict[str, Any]:
        """The settings the warm-start checkpoint depends on (to reuse one from an earlier run)."""
        keys = ("preset", "warmup_steps", "batch_size", "warm_lr", "lr_warmup", "seed")
        return {k: getattr(self, k) for k in keys}

    @staticmethod
    def comparable(d: dict[str, Any], arm: str | None = None) -> dict[str, Any]:
        """The fields that decide an arm's losses and bytes (not how fast or how patiently it ran):
        arms of runs with equal comparable settings can be put side by side. The synchronous arm
        (a) has no outer optimizer and no codec, so a DiLoCo sweep can reuse one run of it."""
        ignored = {"threads", "join_timeout_s"}
        diloco, sparse = {"outer_lr", "outer_momentum", "codec", "block_size"}, {k for k in d if k.startswith("sparse_")}
        if arm == "a":
            ignored |= diloco | sparse | {"slow_replica"}
        elif arm == "s":
            ignored |= diloco | {"slow_replica"}
        elif arm == "c":
            ignored |= sparse | {"slow_replica"}
        elif arm is not None:
            ignored |= sparse
        return {k: v for k, v in d.items() if k not in ignored}

    def codec_params(self) -> dict[str, Any]:
        return {"block_size": self.block_size} if self.codec == "int8" else {}

    def sparse_params(self) -> dict[str, Any]:
        return {"density": self.sparse_density, "bits": self.sparse_bits, "chunk": self.sparse_chunk}

    def sparse_train_config(self) -> TrainConfig:
        """Arm (s)'s: `train_config` with its own H and outer step."""
        return replace(self.train_config(), inner_steps=self.sparse_inner_steps, outer_lr=self.sparse_outer_lr, outer_momentum=self.sparse_outer_momentum)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Settings:
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown Settings field(s): {', '.join(unknown)}")
        return cls(**d)


def ring_allreduce_bytes(numel: int, n: int, bytes_per_elem: float = 4.0) -> float:
    """Bytes one member sends in a ring (or butterfly) all-reduce of `numel` elements among n:
    (n−1)/n of the vector in the reduce-scatter, as much again in the all-gather."""
    return 2 * (n - 1) / n * numel * bytes_per_elem


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first parallel work; harmless if too late
        pass


def thread_env(n: int) -> dict[str, str]:
    """Environment for a child process that should use n threads (OpenMP/MKL read these at start)."""
    return {**os.environ, "OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(path: Path, obj: Any) -> None:
    """Write through a temp file and rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)

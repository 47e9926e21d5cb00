"""Byzantine peers, for tests, chaos drills and benches: what a replica that lies sends in place
of its pseudo-gradient (`Attack`), and what a stage server or an expert host that lies answers
with (`AnswerAttack`); the node settings `fault_attack` and `fault_attack_scale`.
Each lie is well formed (the right shapes, finite values): the all-reduce's checks pass it,
and only a robust aggregator and the evidence against its sender stand between it and the
model. The attacks are those robust distributed training is measured against:

- `sign-flip`: the update reversed and scaled, -scale x g (BTARD's, at scale 1000).
- `scaled`: the update scaled, scale x g.
- `constant`: one direction for every round and every attacker (all coordinates equal), at
  scale x the honest norm: colluders that agree on a direction without talking.
- `noise`: Gaussian noise at scale x the honest norm (seeded): as large as an honest update,
  and as useless.
- `ipm` (inner product manipulation): -scale x g, with a small scale (0.1): the attacker's own
  honest update stands for the honest mean, and a small push against it hides among the honest.
- `stale`: the update of `scale` rounds ago (the oldest kept, until that many were).
- `alie` (a little is enough): every coordinate moved against the update by `scale` (z, default
  1) times the honest spread, each within the spread, so that no one coordinate stands out. An
  attacker sees no other peer's update: its own stands for the honest mean, and the spread of
  coordinate j is its own last update's distance from that round's aggregate (`observe`). Its
  first round, with nothing seen yet, is honest.
- `other-data`: an honest update on data nobody else trains on: the attacker reads every token
  as its mirror in the vocabulary (`data`), the label flip of a language model. It has no
  strength.

`Attack.apply` is pure but for what `stale` and `alie` keep (per shape of update: a fragment's
rounds keep their own).

A stage server's or an expert host's lies replace each activation or gradient it answers with
(each computed honestly first), well formed too; only a trainer's checks catch them
(node/roles/audit.py):

- `scaled`: scale x the honest tensor (default 1000).
- `noise`: Gaussian noise at scale x the honest tensor's norm (default 1), a new draw each time.
- `replay`: the honest answer to the previous call of that tensor's name and shape (the first
  call: its own).
- `zero`: zeros.

A stage server or an expert host may lie in its slot's syncs instead (`sync-` and a replica's
kind, e.g. `sync-sign-flip`): the replica's lie, in place of the pseudo-gradient it averages
with the slot's other peers (node/roles/slot_sync.py). A robust aggregator (three peers of the
slot or more) clips it, but nothing bans it: slot syncs accuse nobody, as trainers call a slot's
fastest peer most and, beside partners that took a step or none, the busy honest peer's update
is the far one (AveragerConfig.accuse). Judging slot syncs needs each peer's steps since the
last sync.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from .role import RoleError

DEFAULT_SCALE = {"sign-flip": 1000.0, "scaled": 1000.0, "constant": 1000.0, "noise": 1.0, "ipm": 0.1, "stale": 5.0, "alie": 1.0, "other-data": 1.0}


def _checked(kind: str, scale: float, defaults: dict[str, float], whose: str) -> float:
    """The attack's scale (its kind's default for 0); ValueError naming a kind or scale it lacks."""
    if kind not in defaults:
        raise ValueError(f"{whose} fault_attack must be one of {', '.join(defaults)}, got {kind!r}")
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"fault_attack_scale must be a finite number >= 0, got {scale}")
    return scale or defaults[kind]


@dataclass
class Attack:
    kind: str
    scale: float = 0.0  # 0: the kind's default (DEFAULT_SCALE)
    seed: int = 0
    kept: dict[tuple, deque] = field(default_factory=dict)  # stale: updates of earlier rounds, per shape
    rounds: int = 0  # updates replaced so far (noise: each round its own draw)
    honest: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)  # alie: the honest update of the round under way, per shape
    seen: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)  # alie: per shape, |our honest update - the aggregate| of our last round

    def __post_init__(self):
        self.scale = _checked(self.kind, self.scale, DEFAULT_SCALE, "a replica's")

    def apply(self, update: list[torch.Tensor]) -> list[torch.Tensor]:
        """What this attacker sends in place of its honest `update` (new tensors)."""
        self.rounds += 1
        norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in update))
        if self.kind in ("sign-flip", "ipm"):
            return [t * -self.scale for t in update]
        if self.kind == "scaled":
            return [t * self.scale for t in update]
        if self.kind == "constant":
            n = sum(t.numel() for t in update)
            return [torch.full_like(t, self.scale * norm / math.sqrt(n)) for t in update]
        if self.kind == "noise":
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rounds)
            noise = [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) for t in update]
            noise_norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in noise)) or 1.0
            return [t * (self.scale * norm / noise_norm) for t in noise]
        if self.kind == "alie":
            return self._alie(update)
        if self.kind == "other-data":  # the lie was in the data (`data`): the update is honest
            return [t.clone() for t in update]
        return self._stale(update)

    def observe(self, aggregate: list[torch.Tensor]) -> None:
        """The aggregate of the round this attacker just took part in (alie: the spread it
        estimates from)."""
        key = _shapes(aggregate)
        if self.kind == "alie" and key in self.honest:
            self.seen[key] = [(h - a).abs() for h, a in zip(self.honest.pop(key), aggregate)]

    def data(self, batches, vocab_size: int):
        """The batches this attacker trains on (`batches`, a node/models/data.Batches):
        other-data's mirror every token id, id -> vocab_size - 1 - id."""
        return _Mirrored(batches, vocab_size) if self.kind == "other-data" else batches

    def _alie(self, update: list[torch.Tensor]) -> list[torch.Tensor]:
        key = _shapes(update)
        self.honest[key] = [t.clone() for t in update]
        spread = self.seen.get(key)
        if spread is None:  # nothing seen yet: honest, this once
            return [t.clone() for t in update]
        return [t - self.scale * s for t, s in zip(update, spread)]

    def _stale(self, update: list[torch.Tensor]) -> list[torch.Tensor]:
        key = _shapes(update)
        kept = self.kept.setdefault(key, deque())
        kept.append([t.clone() for t in update])
        while len(kept) > int(self.scale) + 1:
            kept.popleft()
        return [t.clone() for t in kept[0]]


def _shapes(update: list[torch.Tensor]) -> tuple:
    """What `stale` and `alie` keep their rounds under: the update's shapes (a fragment's rounds
    keep their own)."""
    return tuple(tuple(t.shape) for t in update)


class _Mirrored:
    """Batches with every token id read as vocab_size - 1 - id (other-data)."""

    def __init__(self, batches, vocab_size: int):
        self.batches, self.top = batches, vocab_size - 1

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batches.next()
        return self.top - x, self.top - y


ANSWER_SCALE = {"scaled": 1000.0, "noise": 1.0, "replay": 0.0, "zero": 0.0}


@dataclass
class AnswerAttack:
    kind: str
    scale: float = 0.0  # 0: the kind's default (ANSWER_SCALE)
    seed: int = 0
    last: dict[tuple, torch.Tensor] = field(default_factory=dict)  # replay: the honest answer of the previous call, per name and shape
    draws: int = 0

    def __post_init__(self):
        self.scale = _checked(self.kind, self.scale, ANSWER_SCALE, "a stage server's or expert host's")

    def apply(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """What this peer answers in place of its honest tensor `t` (named `name`)."""
        if self.kind == "scaled":
            return t * self.scale
        if self.kind == "zero":
            return torch.zeros_like(t)
        if self.kind == "noise":
            self.draws += 1
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.draws)
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            return (noise * (self.scale * float(t.double().norm()) / (float(noise.double().norm()) or 1.0))).to(t.dtype)
        key = (name, tuple(t.shape))
        before = self.last.get(key, t)
        self.last[key] = t.detach().clone()
        return before


SYNC = "sync-"  # the prefix of a slot peer's lies in its syncs


def replica_attack(config) -> Attack | None:
    """A replica's lie from the node settings (None: honest); RoleError for a kind replicas lack."""
    return _from_settings(Attack, config.fault_attack, config)


def answer_attack(config) -> AnswerAttack | None:
    """A stage server's or expert host's lie in its answers, from the node settings (None: honest,
    or it lies in its syncs instead); RoleError for a kind they lack."""
    if config.fault_attack.startswith(SYNC):
        return None
    return _from_settings(AnswerAttack, config.fault_attack, config)


def sync_attack(config) -> Attack | None:
    """What a stage server or an expert host sends in its slot's syncs in place of its
    pseudo-gradient (None: honest, or it lies in its answers instead)."""
    if not config.fault_attack.startswith(SYNC):
        return None
    return _from_settings(Attack, config.fault_attack.removeprefix(SYNC), config)


def _from_settings(cls, kind: str, config):
    if not kind:
        return None
    try:
        return cls(kind, config.fault_attack_scale, seed=max(config.shard_index, 0))
    except ValueError as e:
        raise RoleError(str(e)) from None

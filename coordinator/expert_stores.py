"""Experts mode: the checkpoints the coordinator keeps of an experts run (each shard's experts and
the trainers' dense parts) and the hash reports that let an upload in.

A shard's hosts report (sync round, hash) in their heartbeats after each sync of the shard; the
trainers report theirs after each round of the dense parts. An upload names what it is in its
manifest's model_config (`expert_shard`: i, or `dense`: true) and is kept once that slot's
members reported its hash as the quorum asks (planner.checkpoint_quorum), as a pipeline stage's
is.

    DATA_DIR/expert-checkpoints/shard-<i>/step-XXXXXXXX/   shard i's experts
    DATA_DIR/expert-checkpoints/dense/step-XXXXXXXX/       the trainers' dense parts

Nodes ask for them by index as a pipeline stage's servers ask for a stage's (CheckpointQuery's
stage): shard i at i, the dense parts at the number of shards (`dense_index`).

(node/model_cli.py reads these names to export the run: keep them in step.)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from protocol import RemoteProtocolError
from protocol.signatures import SigningKey

from .checkpoints import CheckpointStore

EXPERT_CHECKPOINTS = "expert-checkpoints"
DENSE = "dense"  # the slot of the trainers' dense parts
KEEP_ROUNDS = 64  # rounds of hash reports kept per slot


def dense_index(shards: int) -> int:
    """The index nodes ask for the dense parts' checkpoints by (node/roles/expert_trainer.py says the same)."""
    return shards


def slot_of(role: str | None, expert: str | None) -> str | None:
    """The slot whose state a member holds: its shard ("shard1") for an expert host, DENSE for a
    trainer, None for anyone else."""
    return expert if role == "expert" and expert else DENSE if role == "trainer" else None


class ExpertStores:
    """One checkpoint store per shard and one for the dense parts, and the reports of their hashes."""

    def __init__(self, root: Path, shards: int, keep: int, signing_key: SigningKey | None):
        self.shards = {i: CheckpointStore(root / f"shard-{i}", keep=keep, signing_key=signing_key) for i in range(shards)}
        self.dense = CheckpointStore(root / DENSE, keep=keep, signing_key=signing_key)
        self.reports: dict[tuple[str, int], dict[str, str]] = {}  # (slot, round) -> peer -> hash

    def report(self, peer: str, role: str | None, expert: str | None, step: int, state_hash: str) -> None:
        """A heartbeat's (round, hash) of the slot its sender holds (nothing for other members)."""
        slot = slot_of(role, expert)
        if slot is None:
            return
        self.reports.setdefault((slot, step), {})[peer] = state_hash
        while len(self.reports) > KEEP_ROUNDS * (len(self.shards) + 1):  # a bounded window of the newest rounds
            del self.reports[min(self.reports, key=lambda k: k[1])]

    def by_index(self) -> dict[int, CheckpointStore]:
        """The stores as nodes ask for them: shard i at i, the dense parts at the number of shards."""
        return {**self.shards, dense_index(len(self.shards)): self.dense}

    def store_for(self, manifest: Any) -> tuple[str, CheckpointStore]:
        """(slot, store) of an upload's manifest; RemoteProtocolError naming what it must say."""
        meta = manifest.get("model_config") if isinstance(manifest, dict) else None
        shard = meta.get("expert_shard") if isinstance(meta, dict) else None
        if isinstance(meta, dict) and meta.get("dense") is True and shard is None:
            return DENSE, self.dense
        if isinstance(shard, int) and not isinstance(shard, bool) and shard in self.shards:
            return f"shard{shard}", self.shards[shard]
        raise RemoteProtocolError(
            f"a checkpoint of this experts run names its shard (expert_shard 0..{len(self.shards) - 1}) or the dense parts (dense: true) "
            f"in model_config, got expert_shard {shard!r}", "manifest",
        )  # fmt: skip

    def reported(self, slot: str, step: int, members: Iterable[Any]) -> tuple[int, dict[str, str]]:
        """(how many of `members` (registry Members) hold the slot, peer -> the hash each reported
        for round `step`): what planner.checkpoint_quorum decides on."""
        return sum(1 for m in members if slot_of(m.role, m.expert) == slot), self.reports.get((slot, step), {})

    def listed(self) -> dict[str, list[dict[str, Any]]]:
        """slot -> its kept checkpoints (step, state hash), oldest first: what /status shows."""
        stores = {**{f"shard{i}": s for i, s in self.shards.items()}, DENSE: self.dense}
        return {slot: [{"step": c.step, "state_hash": c.manifest.get("state_hash")} for c in store.list()] for slot, store in stores.items()}

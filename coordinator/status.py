"""What GET /status shows of the swarm's parts, built from the registry's members and the
checkpoint stores: pure functions of what they are given (service.py gathers it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from .checkpoints import CheckpointStore
from .registry import Member


def member_rows(members: Iterable[Member]) -> list[dict]:
    return [{**dataclasses.asdict(m), "maddrs": list(m.maddrs)} for m in members]


def checkpoint_rows(store: CheckpointStore) -> list[dict]:
    """The whole model's kept checkpoints; `verified_by`: replicas that reported its hash (1:
    verified by one replica; null: the initial state)."""
    return [
        {"step": i.step, "created_at": i.manifest.get("created_at"), "state_hash": i.manifest.get("state_hash"),
         "files": i.manifest.get("files"), "verified_by": i.manifest.get("verified_by")}
        for i in store.list()
    ]  # fmt: skip


def _slot(peers: Sequence[Member], checkpoints: list) -> dict:
    """A stage's or a shard's peers, the hashes they report (one after a sync), their throughput."""
    return {
        "peers": sorted(m.peer_id for m in peers),
        "state_hashes": sorted({m.state_hash for m in peers if m.state_hash}),
        "checkpoints": checkpoints,
        "samples_per_second": sum(m.samples_per_second or 0.0 for m in peers),
    }


def stage_views(members: Sequence[Member], num_stages: int, stores: Mapping[int, CheckpointStore]) -> dict[str, dict]:
    """Pipeline mode: per stage (by its index as a string)."""
    views = {}
    for i in range(num_stages):
        kept = [{"step": c.step, "state_hash": c.manifest.get("state_hash")} for c in stores[i].list()] if i in stores else []
        views[str(i)] = _slot([m for m in members if m.role == "stage" and m.stage == i], kept)
    return views


def shard_views(members: Sequence[Member], slots: Iterable[str], kept: Mapping[str, list]) -> dict[str, dict]:
    """Experts mode: per shard of experts."""
    return {slot: _slot([m for m in members if m.role == "expert" and m.expert == slot], kept.get(slot, [])) for slot in slots}


def dense_view(members: Sequence[Member], kept: Mapping[str, list]) -> dict:
    """Experts mode: the trainers, who hold the dense parts, and those parts' checkpoints."""
    return {"peers": sorted(m.peer_id for m in members if m.role == "trainer"), "checkpoints": kept.get("dense", [])}

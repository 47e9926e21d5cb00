"""What a soak (bench/soak.py) keeps of its swarm, and its summary. All pure but `Record.read`.

A role's stats file keeps only its newest entries (a replica's last 1,000 outer steps, a slot
server's last 200 syncs, a trainer's last 500 reports): hours of a swarm outrun them. So the
soak reads every node's file at every sample and keeps what it has not seen (`Record`), tagged
with the node and, for a slot server, the slot it held then (the planner may move it).
"""

from __future__ import annotations

import json
from pathlib import Path

# a node's kind of process, by the first letter of its name in the soak
KINDS = {"c": "coordinator", "r": "replica", "s": "server", "t": "trainer"}


class Record:
    """Every entry the nodes' stats files held while the soak sampled them.
    replicas: node -> outer step -> entry; slots: (slot, sync) -> node -> hash; trainer:
    micro-batches -> loss."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict[int, dict]] = {}
        self.slots: dict[tuple[str, int], dict[str, str]] = {}
        self.trainer: dict[int, float] = {}

    def read(self, work: Path, name: str) -> None:
        """Take in node `name`'s stats file (a missing or half-written one: nothing)."""
        kind = KINDS.get(name[0])
        files = {"replica": ["replica"], "server": ["stage", "expert"], "trainer": ["trainer"]}.get(kind or "", [])
        for path in (work / name / f"{f}-stats.json" for f in files):
            try:
                stats = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            self.take(name, kind, stats)

    def take(self, name: str, kind: str | None, stats: dict) -> None:
        history = stats.get("history", [])
        if kind == "replica":
            mine = self.replicas.setdefault(name, {})
            for e in history:
                mine.setdefault(e["outer_step"], e)
        elif kind == "server":
            starts = [i for i, e in enumerate(history) if e.get("start")]
            slot = f"stage {stats['stage']}" if "stage" in stats else f"shard {stats.get('expert_shard')}"
            for e in history[starts[-1] if starts else 0 :]:
                if "sync" in e and e.get("group", 0) >= 2:  # (alone, a peer's hash is its own)
                    self.slots.setdefault((slot, e["sync"]), {}).setdefault(name, e["state_hash"])
        elif kind == "trainer":
            for e in history:
                self.trainer.setdefault(e["micro_batches"], e["loss"])

    def split(self) -> list:
        """The outer steps (replicas) or [slot, sync] (slot servers) whose peers recorded more
        than one hash: a failed round returned as a success."""
        out: list = []
        steps = set().union(*(set(h) for h in self.replicas.values())) if self.replicas else set()
        for k in sorted(steps):
            seen = {h[k]["state_hash"] for h in self.replicas.values() if k in h and "start" not in h[k]}
            if len(seen) > 1:
                out.append(k)
        out += [[slot, n] for (slot, n), hashes in sorted(self.slots.items()) if len(set(hashes.values())) > 1]
        return out

    def loss_curve(self) -> list[tuple[int, float]]:
        """(samples so far, loss): the replicas' validation loss against the inner steps averaged
        into the state (`loss_curve`), or the trainer's training loss against its micro-batches."""
        if self.replicas:
            return loss_curve([list(h.values()) for h in self.replicas.values()])
        return sorted(self.trainer.items())

    def progress(self) -> dict:
        if self.replicas:
            return {"outer_steps": max((max(h, default=0) for h in self.replicas.values()), default=0)}
        return {"micro_batches": max(self.trainer, default=0), "syncs_of_two_or_more": len(self.slots)}


def loss_curve(histories: list[list[dict]]) -> list[tuple[int, float]]:
    """(inner steps trained into the shared state so far, summed over replicas; the validation
    loss after that outer step) for every outer step some replica averaged. A round's samples
    count once it is averaged: work lost to a failed round or a kill is not counted."""
    by_step: dict[int, list[dict]] = {}
    for h in histories:
        for e in h:
            if "start" not in e and "caught_up_from" not in e and "val_loss" in e:
                by_step.setdefault(e["outer_step"], []).append(e)
    curve, total = [], 0
    for k in sorted(by_step):
        total += sum(e.get("inner_steps", 0) for e in by_step[k])
        curve.append((total, sum(e["val_loss"] for e in by_step[k]) / len(by_step[k])))
    return curve


def loss_at_equal_samples(faulted: list[tuple[int, float]], clean: list[tuple[int, float]]) -> float | None:
    """The faulted swarm's loss over the clean one's at the same samples (the clean curve
    interpolated), the mean over the second half of the faulted curve where the clean one
    reaches (one point's loss is noisy). None where they do not overlap."""
    ratios = []
    for n, loss in faulted[len(faulted) // 2 :]:
        below = [(m, v) for m, v in clean if m <= n]
        above = [(m, v) for m, v in clean if m >= n]
        if not below or not above:
            continue
        (m0, v0), (m1, v1) = below[-1], above[0]
        ref = v0 if m1 == m0 else v0 + (v1 - v0) * (n - m0) / (m1 - m0)
        ratios.append(loss / ref)
    return round(sum(ratios) / len(ratios), 4) if ratios else None


def summarize(samples: list[dict], warmup_s: float) -> dict:
    """Per kind of process: the most any one of them grew in resident memory from the warm-up's
    end to the end (its numbers then and at the end), the most open files and threads any had.
    (A node killed and started again after the warm-up is compared across its lives.)"""
    out = {}
    for letter, kind in KINDS.items():
        series: dict[str, list[tuple[float, dict]]] = {}
        for s in samples:
            for name, v in s["procs"].items():
                if name.startswith(letter) and v["rss_mib"]:
                    series.setdefault(name, []).append((s["t"], v))
        if not series:
            continue
        growth = {}
        for name, rows in series.items():
            after = [v for t, v in rows if t >= warmup_s] or [v for _, v in rows]
            growth[name] = (after[-1]["rss_mib"] / after[0]["rss_mib"] - 1, after[0]["rss_mib"], after[-1]["rss_mib"])
        worst = max(growth, key=lambda n: growth[n][0])
        rows = [v for r in series.values() for _, v in r]
        out[kind] = {
            "rss_growth": round(growth[worst][0], 3), "rss_mib_after_warmup": growth[worst][1], "rss_mib_at_end": growth[worst][2], "grew_most": worst,
            "open_files_max": max(v["open_files"] for v in rows), "threads_max": max(v["threads"] for v in rows),
        }  # fmt: skip
    out["disk_mib_max"] = max((max(s["disk"].values()) for s in samples if s["disk"]), default=0.0)
    return out

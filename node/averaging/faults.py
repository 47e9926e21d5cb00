"""Fault injection: one small typed interface, off by default, for swarm tests and chaos drills.

Kill and stall are done from outside (SIGKILL, SIGSTOP); what needs the daemon's cooperation is
here: corrupting or delaying what it sends. Production code calls these hooks at the few points
where data leaves the node; with the default `Faults()` they do nothing.
"""

from __future__ import annotations

import asyncio
import math
import struct
from dataclasses import dataclass, replace

from protocol import EncodedTensor

CORRUPTIONS = ("", "nan", "shape", "huge")


@dataclass(frozen=True)
class Faults:
    corrupt_parts: str = ""  # outgoing averaging parts: "nan" (NaN values), "shape" (wrong shape), "huge" (1e30 values)
    delay_parts_s: float = 0.0  # sleep before sending each averaging part: a straggler
    delay_reports_s: float = 0.0  # sleep before reporting a scatter to the leader: slow between phases
    corrupt_only_to: tuple[str, ...] = ()  # peer ids: corrupt only parts sent to these (a selective liar)
    replay_gather_s: float = 0.0  # this long after a committed round, send our slices again, zeroed (a late or replayed part)
    lose_join_replies: int = 0  # as a leader: hang up on this many joins after counting them in the group (lost replies)
    lose_decision_replies: int = 0  # as a round's leader: hang up on this many reports instead of answering (lost replies)

    def __post_init__(self):
        if self.corrupt_parts not in CORRUPTIONS:
            raise ValueError(f"corrupt_parts must be one of {CORRUPTIONS}, got {self.corrupt_parts!r}")
        for name in ("delay_parts_s", "delay_reports_s", "replay_gather_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be >= 0")
        if self.lose_decision_replies < 0 or self.lose_join_replies < 0:
            raise ValueError("lose_decision_replies and lose_join_replies must be >= 0")
        object.__setattr__(self, "corrupt_only_to", tuple(self.corrupt_only_to))

    @property
    def active(self) -> bool:
        return bool(self.corrupt_parts or self.delay_parts_s or self.delay_reports_s)

    async def before_send(self) -> None:
        if self.delay_parts_s:
            await asyncio.sleep(self.delay_parts_s)

    async def before_report(self) -> None:
        if self.delay_reports_s:
            await asyncio.sleep(self.delay_reports_s)

    def outgoing(self, enc: EncodedTensor, peer: str = "") -> EncodedTensor:
        """What we send to `peer` instead of `enc` (the same, unless corrupting)."""
        kind = self.corrupt_parts
        if self.corrupt_only_to and peer not in self.corrupt_only_to:
            return enc
        if kind == "shape":
            return replace(enc, shape=(*enc.shape[:-1], enc.shape[-1] + 1) if enc.shape else (2,))
        if kind in ("nan", "huge") and enc.codec == "none" and enc.dtype == "float32":
            value = struct.pack("<f", math.nan if kind == "nan" else 1e30)
            payload = bytearray(enc.payload)
            payload[: len(value)] = value
            return replace(enc, payload=payload)
        if kind in ("nan", "huge") and enc.codec in ("int8",):
            # the first block's scale carries the corruption into every value of that block
            value = struct.pack("<f", math.nan if kind == "nan" else 1e30)
            payload = bytearray(enc.payload)
            payload[:4] = value
            return replace(enc, payload=payload)
        if kind in ("nan", "huge") and enc.codec == "sparse" and enc.nbytes >= 8:
            # the first chunk's scales: a NaN lo, or a hi (its top level) of 1e30
            payload = bytearray(enc.payload)
            at = 0 if kind == "nan" else 4
            payload[at : at + 4] = struct.pack("<f", math.nan if kind == "nan" else 1e30)
            return replace(enc, payload=payload)
        if kind in ("nan", "huge") and enc.codec == "fp16":
            value = b"\x00\x7e" if kind == "nan" else b"\xff\x7b"  # fp16 NaN / 65504
            payload = bytearray(enc.payload)
            payload[:2] = value
            return replace(enc, payload=payload)
        return enc

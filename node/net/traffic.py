"""Bytes a node moved, by plane and peer: what its /metrics exports and its heartbeats total.

Planes: `libp2p` (streams through the node's p2pd), `direct` (the TCP data plane, node/net/direct.py)
and `relayed` (libp2p streams carried by a relay). Directions: `sent`, `received`. What is counted
is the frames of calls (node/net/streams.py counts them for each stream's `Meter`), not the
libp2p, sealing or relay-hello bytes around them.
"""

from __future__ import annotations

from collections import defaultdict

PLANES = ("libp2p", "direct", "relayed")


class Traffic:
    """Byte counters keyed by (plane, peer id, direction); they only grow."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str, str], int] = defaultdict(int)

    def sent(self, plane: str, peer: str, n: int) -> None:
        self.bytes[(plane, peer, "sent")] += n

    def received(self, plane: str, peer: str, n: int) -> None:
        self.bytes[(plane, peer, "received")] += n

    def meter(self, plane: str, peer: str) -> Meter:
        """The counters of one stream to `peer` over `plane`."""
        return Meter(self.bytes, plane, peer)

    def totals(self) -> tuple[int, int]:
        """(bytes sent, bytes received), every plane and peer together."""
        sent = sum(n for (_, _, d), n in self.bytes.items() if d == "sent")
        return sent, sum(self.bytes.values()) - sent

    def by_plane(self) -> dict[str, dict[str, int]]:
        """{plane: {"sent": bytes, "received": bytes}}, every plane, peers together."""
        out = {plane: {"sent": 0, "received": 0} for plane in PLANES}
        for (plane, _, direction), n in list(self.bytes.items()):
            out.setdefault(plane, {"sent": 0, "received": 0})[direction] += n
        return out


class Meter:
    """One stream's counters: a dict add per frame written or buffer read, nothing per byte."""

    __slots__ = ("plane", "_bytes", "_sent", "_received")

    def __init__(self, counters: dict[tuple[str, str, str], int], plane: str, peer: str):
        self.plane, self._bytes = plane, counters
        self._sent, self._received = (plane, peer, "sent"), (plane, peer, "received")

    def sent(self, n: int) -> None:
        self._bytes[self._sent] += n

    def received(self, n: int) -> None:
        self._bytes[self._received] += n

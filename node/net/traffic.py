"""Bytes a node moved, by plane and peer: what its /metrics exports and its heartbeats total.

Planes: `libp2p` (streams through the node's p2pd), `direct` (the TCP data plane, node/net/direct.py)
and `relayed` (libp2p streams carried by a relay). Directions: `sent`, `received`.
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

    def totals(self) -> tuple[int, int]:
        """(bytes sent, bytes received), every plane and peer together."""
        sent = sum(n for (_, _, d), n in self.bytes.items() if d == "sent")
        return sent, sum(self.bytes.values()) - sent

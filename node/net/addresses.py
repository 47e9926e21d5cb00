"""Multiaddr helpers every layer uses (standard library only: the CLI's checks import them
before torch or hivemind load)."""

from __future__ import annotations

from collections.abc import Sequence


def split_peer_maddr(maddr: str) -> tuple[str, str]:
    """'/ip4/../p2p/<id>' -> (transport part, peer id)."""
    head, sep, peer_id = maddr.rpartition("/p2p/")
    if not sep or not peer_id or "/" in peer_id:
        raise ValueError(f"{maddr} lacks a /p2p/<peer id> suffix")
    return head, peer_id


def tcp_ip4s(maddrs: Sequence[str]) -> list[str]:
    """The IPv4 addresses of the /ip4/<ip>/tcp/... multiaddrs among `maddrs`, first seen first."""
    out: list[str] = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if len(parts) >= 5 and parts[1] == "ip4" and parts[3] == "tcp" and parts[2] not in out:
            out.append(parts[2])
    return out

"""Relay hops for peers that nobody can dial (behind a NAT without port forwarding).

A node started with `--relays MADDR` keeps a connection open to each relay (a public node or
coordinator started with `--serve-relay`) and announces `<relay maddr>/p2p-circuit` beside its
own addresses. A caller whose libp2p open to such a peer fails (or hangs past `OPEN_AGAIN_S`)
opens a stream to one of its relays instead (`HOP_PROTOCOL`) and writes a `RelayHello` signed
with its own key: origin, target, protocol, time, nonce. The relay checks that the hello is the
caller's own, opens `RELAYED_PROTOCOL` to the target over the connection the target keeps to it,
writes the hello there and copies bytes both ways. It carries streams only to peers that pinged
it lately (every `KEEPALIVE_S`: it is nobody's proxy to the rest of the network), at most
`RELAY_STREAMS_PER_PEER` at once for one caller, and refuses callers it has banned. The target
verifies the hello (signature, itself as target, fresh, nonce not seen) and serves the stream as
a call or pipe of the origin: the gate, scores and limits apply to the origin as on a direct
stream.

Why not the libp2p daemon's own circuit relay: the p2pd hivemind ships serves relay hops with
go-libp2p's default limits (a relayed connection is reset after 128 KiB or 2 minutes; see
bench/RESULTS.md), and its flags for larger limits do not reach the relay that actually serves
(`EnableRelayV2` starts a second one with the defaults). Here the relay copies bytes without a limit and counts them.

What a relay can do: read and alter what it carries (streams are end-to-end authenticated only
in who opened them, not in content), delay or drop it. It cannot open streams in anyone's name.
"""

from __future__ import annotations

import asyncio
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence

HOP_PROTOCOL = "/swarmtrain/relay-hop/1"  # caller -> relay
RELAYED_PROTOCOL = "/swarmtrain/relayed/1"  # relay -> target
CIRCUIT = "/p2p-circuit"
HELLO_FRESH_S = 60.0  # a hello older (or further in the future) than this is refused: clocks differ by less
MAX_HELLO = 4096
COPY_CHUNK = 1 << 16
KEEPALIVE_S = 10.0  # a relayed node pings each relay this often (and reconnects when a ping fails)


def circuit_addr(relay_maddr: str) -> str:
    """What a node reachable through the relay at `relay_maddr` (".../p2p/<relay id>") announces."""
    return relay_maddr + CIRCUIT


def relay_ids(maddrs: Sequence[str]) -> tuple[str, ...]:
    """The relays (peer ids) a peer announced circuit addresses through, first announced first."""
    out: list[str] = []
    for m in maddrs:
        head, sep, _ = m.partition(CIRCUIT)
        if sep and "/p2p/" in head:
            rid = head.rsplit("/p2p/", 1)[1].strip("/")
            if rid and rid not in out:
                out.append(rid)
    return tuple(out)


def relay_maddr_problem(maddr: str) -> str | None:
    if "/p2p/" not in maddr or CIRCUIT in maddr:
        return f"relay {maddr!r} must be a relay's own multiaddr ending in /p2p/<its peer id>"
    return None


def frame_hello(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


async def read_hello(reader: asyncio.StreamReader) -> bytes:
    (n,) = struct.unpack(">H", await reader.readexactly(2))
    if not 0 < n <= MAX_HELLO:
        raise ValueError(f"a relay hello of {n} bytes (at most {MAX_HELLO})")
    return await reader.readexactly(n)


class Nonces:
    """Hello nonces seen in the last 2 * HELLO_FRESH_S: a hello carried once is refused again."""

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def fresh(self, nonce: bytes, now: float) -> bool:
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = now + 2 * HELLO_FRESH_S
        return True


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: Callable[[int], None]) -> None:
    try:
        while data := await reader.read(COPY_CHUNK):
            count(len(data))
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # the other side's hang-up, passed on: a reply may still come back
    except (ConnectionError, OSError):
        pass


async def splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter], count: Callable[[int], None]) -> None:
    """Copy bytes both ways until both sides have hung up (or one is reset)."""
    ab = asyncio.ensure_future(_copy(a[0], b[1], count))
    ba = asyncio.ensure_future(_copy(b[0], a[1], count))
    try:
        await asyncio.gather(ab, ba)
    finally:
        ab.cancel()
        ba.cancel()
        for w in (a[1], b[1]):
            try:
                w.close()
            except Exception:  # gone already
                pass

"""Every place we reach into a library's private internals, each behind one small function.

Each function names the library version it was written against, what it touches, and what
happens when that internal is gone (a clear `CompatError`, or a stated fallback). When a
library is upgraded, `tests/test_compat.py` runs each of them against the installed version.

This module imports no third-party library: the caller passes the library's objects in (so
`node/net/host.py` stays the only module that imports hivemind).
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence


class CompatError(RuntimeError):
    """An installed library lacks an internal we rely on: the message names it and the library
    version this code was written against."""


# -- asyncio (CPython 3.11.7) ----------------------------------------------------------------------


def take_stream_reader_buffer(reader: asyncio.StreamReader) -> bytes:
    """Take (copy and clear) what an `asyncio.StreamReader` has read but nobody consumed yet,
    so another protocol can take the transport over without losing those bytes.

    Written against CPython 3.11.7. Touches `StreamReader._buffer` (a bytearray): asyncio has
    no public way to take buffered bytes without awaiting. If the field is gone we cannot hand
    over safely, so this raises `CompatError` rather than drop bytes."""
    buf = getattr(reader, "_buffer", None)
    if not isinstance(buf, bytearray):
        raise CompatError(
            "asyncio.StreamReader has no _buffer bytearray in this Python: a stream cannot be handed"
            " to the frame reader without losing bytes (written against CPython 3.11)"
        )
    data = bytes(buf)
    buf.clear()
    return data


def stream_reader_paused(reader: asyncio.StreamReader) -> bool:
    """Whether an `asyncio.StreamReader` has paused its transport's reading (its buffer went over
    the limit), so a protocol taking the transport over knows it must resume it.

    Written against CPython 3.11.7. Touches `StreamReader._paused`. If the field is gone: True,
    so the new protocol resumes reading once; `resume_reading()` on a transport that reads is
    a no-op in asyncio and uvloop, while a paused transport never resumed would stall."""
    paused = getattr(reader, "_paused", None)
    return True if paused is None else bool(paused)


# -- hivemind 1.1.12 (hivemind.p2p.P2P) ---------------------------------------------------------


def add_p2pd_flags(p2p_class: Any, **flags: Any) -> None:
    """Make every p2pd that `p2p_class` (hivemind's `P2P`) launches in this process get extra
    command-line flags, e.g. `noise=False` (hivemind has no switch for p2pd's Noise security).

    Written against hivemind 1.1.12. Touches `P2P._make_process_args(*args, **kwargs)`, the
    static method `P2P.create` builds p2pd's argv with: it is wrapped, and our flags override
    its own. If it is gone, raises `CompatError` (security="noise+tls" needs no flags)."""
    make_args = getattr(p2p_class, "_make_process_args", None)
    if not callable(make_args):
        raise CompatError(
            f"{p2p_class.__qualname__} has no _make_process_args: cannot pass {sorted(flags)} to p2pd"
            " (written against hivemind 1.1.12; use security='noise+tls')"
        )
    p2p_class._make_process_args = staticmethod(lambda *a, **kw: make_args(*a, **{**kw, **flags}))


async def p2pd_disconnect(p2p: Any, peer_id: Any) -> None:
    """Ask the p2pd behind a hivemind `P2P` to close its connections to `peer_id`: after a
    link was down, a connection whose TCP is still backing off its retransmits carries new
    streams only once it recovers (seconds to tens of seconds); a fresh dial works at once.
    hivemind's public API has no such call. Written against hivemind 1.1.12: touches
    `P2P._client` and calls its public `disconnect`; raises `CompatError` if it is missing."""
    client = getattr(p2p, "_client", None)
    disconnect = getattr(client, "disconnect", None)
    if not callable(disconnect):
        raise CompatError(f"{type(p2p).__qualname__} has no started _client with disconnect() (written against hivemind 1.1.12)")
    await disconnect(peer_id)


async def p2pd_connect(p2p: Any, peer_id: Any, maddrs: Sequence[Any]) -> None:
    """Ask the p2pd behind a hivemind `P2P` to connect to `peer_id` (a hivemind `PeerID`) at
    transport addresses `maddrs` (`Multiaddr`s). hivemind's public API has no such call.

    Written against hivemind 1.1.12. Touches `P2P._client` (its `p2pclient.Client`) and calls
    its public `connect`; the client's own errors (ControlFailure, DispatchFailure, OSError)
    pass through. If `_client` is gone or not started, raises `CompatError`."""
    client = getattr(p2p, "_client", None)
    connect = getattr(client, "connect", None)
    if not callable(connect):
        raise CompatError(
            f"{type(p2p).__qualname__} has no started _client with connect(): cannot tell p2pd where a peer is"
            " (written against hivemind 1.1.12)"
        )
    await connect(peer_id, list(maddrs))

"""Our membership certificate (an owned swarm, see node/net/gate.py), presented to each peer
before our first call to it and again after a renewal: one `MemberProof` call per peer and
certificate, shared by the calls that wait for it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from protocol import MemberProof

if TYPE_CHECKING:
    from .transport import Transport


class Presenter:
    """Which peers accepted which certificate of ours, and the presentations under way."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._presented: dict[str, bytes] = {}  # peer -> the certificate of ours it accepted
        self._presenting: dict[tuple[str, bytes], asyncio.Future] = {}

    async def present(self, peer_id: str, timeout: float | None) -> None:
        """Our membership certificate to `peer_id`, unless it has it already (one call, shared by
        the calls that wait for it). RemoteError(unauthorized) if the peer refuses it."""
        credential = self.transport.gate.credential
        if self._presented.get(peer_id) == credential:
            return
        key = (peer_id, credential)
        pending = self._presenting.get(key)
        if pending is None:
            # (`send` presents nothing before a MemberProof itself)
            pending = self._presenting[key] = asyncio.ensure_future(self.transport.send(peer_id, MemberProof(certificate=credential), (), timeout))
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read even when every waiter was cancelled)
        try:
            await asyncio.shield(pending)
        finally:
            if pending.done() and self._presenting.get(key) is pending:
                del self._presenting[key]
        self._presented[peer_id] = credential

    def forget(self, peer_id: str) -> None:
        """The peer forgot our certificate (it restarted): present it again before the next call."""
        self._presented.pop(peer_id, None)

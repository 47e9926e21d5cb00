"""What an averager answers to the members of its rounds: their parts (scatter, early and
gather slices), their reports to us as leader, their questions about a decision. Every field
that comes from a peer is checked before it is used; a peer's bad input is refused with a
`RemoteProtocolError` or `RPCError` that names it (the transport scores the peer down)."""

from __future__ import annotations

import asyncio
import logging

from protocol import Ack, AvgDecision, AvgDecisionQuery, AvgReport, Message, RemoteProtocolError, TensorAssembler, TensorPart

from ..net.transport import CallContext, RPCError
from .round import Round

log = logging.getLogger(__name__)


def parse_part_key(key: str) -> tuple[str, str, int]:
    """(group id, phase, slice) of a part's key `<group>|<phase>|<slice>`."""
    try:
        group_id, phase, j_text = key.split("|")
        j = int(j_text)
    except ValueError:
        raise RemoteProtocolError("expected <group>|<phase>|<slice>", "key") from None
    if len(group_id) > 64:
        raise RemoteProtocolError("group id too long", "key")
    return group_id, phase, j


class RoundHandlers:
    """The handlers of one averager's rounds (`rounds`: group id -> Round, kept by the averager)."""

    def __init__(self, averager):
        self.avg = averager
        self.config = averager.config
        self.replies_to_lose = averager.faults.lose_decision_replies

    async def on_part(self, ctx: CallContext, rnd: Round, phase: str, j: int) -> Ack:
        first: TensorPart = ctx.request
        g, sender = rnd.group, ctx.peer_id
        if sender not in g.members:
            raise RPCError("unauthorized", "not a member of this group")
        if rnd.done:
            raise RPCError("not_found", f"round {g.group_id} is over here")
        if phase not in ("scatter", "gather", "early") or not 0 <= j < g.n_slices:
            raise RemoteProtocolError(f"no slice {phase} {j} in this group", "key")
        if phase == "early" and sender != g.first_owner(j):
            raise RPCError("unauthorized", f"slice {j} is not this sender's to send")
        n = rnd.slice_len(j)
        expected_codec = g.codec if phase == "scatter" else g.gather_codec
        asm = TensorAssembler(max_total_size=max(64, n * 8 + 4096))
        part: Message = first
        try:
            while True:
                if not isinstance(part, TensorPart) or part.key != first.key:
                    raise RemoteProtocolError("expected the next part of the same tensor", "part")
                enc = asm.add(part)
                if enc is not None:
                    break
                part = await ctx.receive()
            if enc.codec != expected_codec:
                raise RemoteProtocolError(f"codec {enc.codec}, this group uses {expected_codec}", "codec")
            if enc.dtype != "float32" or enc.shape != (n,):
                raise RemoteProtocolError(f"expected float32 of shape ({n},), got {enc.dtype} {enc.shape}", "shape")
            if phase == "scatter":  # kept per sender until the slice is aggregated
                tensor = await asyncio.get_running_loop().run_in_executor(None, rnd.decoded, enc, self.config.max_abs)
            elif not await self._decode_slice(rnd, phase, j, sender, enc):
                return Ack()  # an early slice the decision voided: its owner sends it again
        except RemoteProtocolError as e:
            if phase != "early":  # a broken early slice is just not used: the commit says if it is missing
                rnd.blamed.setdefault(sender, f"bad {phase} part: {e}")
                rnd.arrived.set()
            # one penalty per sender and round, at every receiver alike: how many of a sender's
            # bad parts reach us before the round is decided is a race, and a ban must not
            # depend on it (else one receiver bans, the sender is left out of its groups, and
            # the other receivers never see enough to ban it)
            if sender in rnd.refused:
                raise RPCError("bad_request", str(e)) from None
            rnd.refused.add(sender)
            raise
        if phase == "scatter":
            rnd.received.setdefault((phase, j), {})[sender] = tensor
        rnd.report.bytes_received += enc.nbytes
        log.debug("got %s %d from %s: %d bytes", phase, j, sender[-6:], enc.nbytes)
        rnd.arrived.set()
        return Ack()

    async def _decode_slice(self, rnd: Round, phase: str, j: int, sender: str, enc) -> bool:
        """Decode an averaged slice straight into the result; whether it counts. A gather slice
        comes from the slice's owner after the decision; an early one from its first owner
        before it, and counts only if the decision excluded nobody."""
        g = rnd.group
        if phase == "gather":
            decided = rnd.decisions.get("scatter")
            if decided is None:  # who owns what is not known here yet: wait for the decision
                try:
                    await asyncio.wait_for(rnd.decided["scatter"].wait(), timeout=g.deadline_s + 2 * self.config.decision_grace_s)
                except TimeoutError:
                    raise RPCError("timeout", "no decision here in time for this slice") from None
                decided = rnd.decisions["scatter"]
            if not decided.commit or sender != decided.owners[j]:
                raise RPCError("unauthorized", f"slice {j} is not this sender's to send")
        async with rnd.lock(j):
            if rnd.done or (phase == "early" and (rnd.early_ok is False or j in rnd.final)):
                return False
            out = rnd.result[g.bounds[j] : g.bounds[j + 1]]
            await asyncio.get_running_loop().run_in_executor(None, rnd.decoded, enc, self.config.max_abs, out)
            if phase == "gather":
                rnd.final.add(j)
            elif rnd.early_ok is False:  # voided while decoding: what comes after overwrites it
                return False
            else:
                rnd.early_got.add((j, sender))
        rnd.received.setdefault(("gather", j), {})[sender] = out
        return True

    async def on_report(self, ctx: CallContext, rnd: Round) -> AvgDecision:
        rep: AvgReport = ctx.request
        if rnd.leader != rnd.me:
            raise RPCError("bad_request", "not the leader of this round")
        if ctx.peer_id not in rnd.members:
            raise RPCError("unauthorized", "not a member of this group")
        rnd.reports[rep.phase][ctx.peer_id] = rep
        rnd.reported[rep.phase].set()
        try:
            await asyncio.wait_for(rnd.decided[rep.phase].wait(), timeout=rnd.group.deadline_s + 4 * self.config.decision_grace_s)
        except TimeoutError:
            raise RPCError("timeout", "no decision in time") from None
        if self.replies_to_lose > 0:  # fault injection: the member never hears back from us
            self.replies_to_lose -= 1
            raise ConnectionError("fault injection: decision reply lost")
        return rnd.decisions[rep.phase]

    async def on_decision_query(self, ctx: CallContext, rnd: Round | None) -> AvgDecision:
        q: AvgDecisionQuery = ctx.request
        if rnd is None or q.phase not in rnd.decisions or ctx.peer_id not in rnd.members:
            raise RPCError("not_found", "no such decision here")
        return rnd.decisions[q.phase]

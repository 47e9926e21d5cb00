"""The averaging service of one transport: it owns the averaging message types (joins, parts,
reports, decision queries) and hands each call to the averager it is for. Any number of
averagers share a transport, one per namespace (e.g. "replicas", "stage-2",
"expert-l1-e3"): a join names its namespace; parts, reports and queries name their round,
and a round belongs to the averager that runs it. No averager sees another's traffic."""

from __future__ import annotations

import asyncio
import weakref

from protocol import Ack, AvgDecision, AvgDecisionQuery, AvgGroup, AvgJoin, AvgReport, TensorPart

from ..net.transport import CallContext, Registration, RPCError, Transport
from .handlers import parse_part_key

ROUND_WAIT_S = 5.0  # a part or report may come a moment before its round starts here
ROUND_KEEP_S = 60.0  # a finished round stays this long for members asking for its decisions


class NamespaceTaken(Exception):
    """Our bug: two averagers of one process want the same namespace."""


class AveragingService:
    _of: weakref.WeakKeyDictionary[Transport, AveragingService] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, transport: Transport) -> AveragingService:
        """The transport's averaging service (made on first use)."""
        service = cls._of.get(transport)
        if service is None:
            service = cls._of[transport] = cls(transport)
        return service

    def __init__(self, transport: Transport):
        self.transport = transport
        self.averagers: dict[str, object] = {}  # namespace -> Averager
        self.rounds: dict[str, tuple[object, object]] = {}  # group id -> (Averager, Round)
        self._ready: dict[str, asyncio.Event] = {}
        self._registration: Registration | None = None

    def attach(self, averager) -> None:
        ns = averager.config.namespace
        if ns in self.averagers:
            raise NamespaceTaken(f"an averager of namespace {ns!r} already runs on this transport")
        if self._registration is None:
            self._registration = self.transport.serve(
                {AvgJoin: self._on_join, TensorPart: self._on_part, AvgReport: self._on_report, AvgDecisionQuery: self._on_decision_query},
                owner="averaging",
            )
        self.averagers[ns] = averager

    def detach(self, averager) -> None:
        ns = averager.config.namespace
        if self.averagers.get(ns) is averager:
            del self.averagers[ns]
        for group_id in [g for g, (a, _) in self.rounds.items() if a is averager]:
            self.rounds.pop(group_id, None)
            self._ready.pop(group_id, None)
        if not self.averagers and self._registration is not None:
            self._registration.close()
            self._registration = None
            AveragingService._of.pop(self.transport, None)

    # ---- rounds ----

    def add_round(self, averager, rnd) -> None:
        group_id = rnd.group.group_id
        self.rounds[group_id] = (averager, rnd)
        self._ready.setdefault(group_id, asyncio.Event()).set()

    def forget_round(self, group_id: str) -> None:
        self.rounds.pop(group_id, None)
        self._ready.pop(group_id, None)

    async def _round_for(self, group_id: str) -> tuple[object, object]:
        if group_id in self.rounds:
            return self.rounds[group_id]
        ev = self._ready.setdefault(group_id, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), timeout=ROUND_WAIT_S)
        except TimeoutError:
            self._ready.pop(group_id, None)
            raise RPCError("not_found", f"no round {group_id} here") from None
        if group_id not in self.rounds:  # its averager left meanwhile
            raise RPCError("not_found", f"no round {group_id} here")
        return self.rounds[group_id]

    # ---- handlers: route to the averager the call is for ----

    async def _on_join(self, ctx: CallContext) -> AvgGroup:
        avg = self.averagers.get(ctx.request.namespace)
        if avg is None:
            return AvgGroup(status="closed", reason="not averaging this key")
        return await avg.matchmaker.on_join(ctx)

    async def _on_part(self, ctx: CallContext) -> Ack:
        group_id, phase, j = parse_part_key(ctx.request.key)
        avg, rnd = await self._round_for(group_id)
        return await avg.handlers.on_part(ctx, rnd, phase, j)

    async def _on_report(self, ctx: CallContext) -> AvgDecision:
        avg, rnd = await self._round_for(ctx.request.group_id)
        return await avg.handlers.on_report(ctx, rnd)

    async def _on_decision_query(self, ctx: CallContext) -> AvgDecision:
        avg, rnd = self.rounds.get(ctx.request.group_id, (None, None))
        if avg is None:
            raise RPCError("not_found", "no such decision here")
        return await avg.handlers.on_decision_query(ctx, rnd)

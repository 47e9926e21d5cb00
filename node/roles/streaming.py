"""Streaming DiLoCo: a replica's outer step as F fragment rounds overlapped with its inner steps.

One cycle (H inner steps, one outer step of every fragment), as `Streaming.cycle` runs it:

    for each fragment f, in order (fragments.py `Schedule`):
        send:  the fragment's pseudo-gradient θ_outer,f − θ_local,f; its round starts in the
               background, keyed by the outer step, f and the hash of the fragment's outer state
        train: the fragment period's inner steps (H/F), the round running meanwhile
        apply: once the period is over and the round is done (`when_to_apply`; waiting only for
               a round over its deadline, and giving it up OVERDUE_S past its join window): the
               fragment's outer Nesterov step, then its local parameters move by what its outer
               parameters moved (below)

Merging the new outer parameters into the local ones: θ_local,f ← θ_outer,f(new) +
(θ_local,f(now) − θ_local,f(at send)). The fragment period's inner steps were taken on top of the
parameters the round started from; they are kept, re-based onto the new outer parameters, so no
inner step is lost and each one enters exactly one pseudo-gradient of its fragment (the next
round's). Overwriting the local fragment with the new outer parameters (the Streaming DiLoCo
paper's α = 0) would throw a fragment period of every fragment's training away per cycle; its α
mix keeps a part of them but counts them twice. A failed round changes nothing: its progress is
in the fragment's next pseudo-gradient.

Every replica of a fragment's round applies the same average to the same outer bits (the key says
so), so they hold bitwise-equal outer state of that fragment afterwards; after a cycle, of the
whole model. Each fragment carries its own error feedback (averager state key "outer-f<f>").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..averaging import AverageReport
from ..models.diloco import OuterOptimizer, state_hash
from .fragments import Outcome, Schedule, when_to_apply

log = logging.getLogger(__name__)

OVERDUE_S = 120.0  # longest training waits on a round past its fragment period and its join window: then it is given up

Average = Callable[[str, list[torch.Tensor], str, float], Awaitable[tuple[list[torch.Tensor] | None, AverageReport, bool]]]


def fragment_key(step: int, fragment: int, fragment_hash: str) -> str:
    """The round key of a fragment: replicas at another outer step or with other outer bits of
    this fragment never average together."""
    return f"outer-{step}-f{fragment}-{fragment_hash[:8]}"


@dataclass
class Cycle:
    """What one cycle did: its inner steps' losses and time, the time it waited on the network,
    and each fragment round's outcome and report (fewer than F when the cycle was cut short)."""

    losses: list[float] = field(default_factory=list)
    inner_s: float = 0.0
    wait_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    reports: list[AverageReport] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.reports)

    @property
    def applied(self) -> int:
        return sum(o.ok for o in self.outcomes)

    @property
    def leader(self) -> str:
        """The leader of the cycle's last round that was done ("" if none was)."""
        return next((r.leader for o, r in zip(reversed(self.outcomes), reversed(self.reports)) if o.ok), "")

    @property
    def members(self) -> int:
        return min((len(r.survivors) for o, r in zip(self.outcomes, self.reports) if o.ok), default=0)


class Streaming:
    """Runs a replica's cycles (see the module's docstring). `parts`: each fragment's range of
    the model's parameter tensors (fragments.py `split`); `compute(fn, *args)` runs fn on the
    replica's compute thread; `train(n)` takes n inner steps there and returns their losses;
    `average(key, tensors, state_key, window)` runs one round: (average or None, report, whether
    it was given up because the other replicas are ahead)."""

    def __init__(self, parts: Sequence[range], inner_steps: int, compute, train: Callable[[int], list[float]], average: Average):
        self.parts, self.schedule = list(parts), Schedule(inner_steps, len(parts))
        self.compute, self.train, self.average = compute, train, average

    async def cycle(self, model: torch.nn.Module, outer: OuterOptimizer, step: int, window: float, stopped: Callable[[], bool]) -> Cycle:
        cycle, params = Cycle(), list(model.parameters())
        for f, part in enumerate(self.parts):
            local = params[part.start : part.stop]
            sent, pseudo, frag_hash = await self.compute(_send, outer, local, part)
            key = fragment_key(step, f, frag_hash)
            task = asyncio.create_task(self.average(key, pseudo, f"outer-f{f}", window), name=key)
            try:
                period, trained = self.schedule.period(f), 0
                while (decision := when_to_apply(trained, period, task.done())).action == "train":
                    t0 = time.monotonic()
                    cycle.losses += await self.compute(self.train, period - trained)
                    cycle.inner_s += time.monotonic() - t0
                    trained = period
                    if stopped():
                        return cycle
                if decision.action == "wait":
                    log.debug("%s: %s", key, decision.reason)
                    t0 = time.monotonic()
                    await asyncio.wait({task}, timeout=window + OVERDUE_S)
                    cycle.wait_s += time.monotonic() - t0
                if task.done():
                    avg, report, moved_on = task.result()
                else:  # (the finally below cancels it)
                    avg, report, moved_on = None, AverageReport(key=key, reason=f"still running {window + OVERDUE_S:.0f} s after its fragment period: given up"), False
            finally:
                if not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            cycle.outcomes.append(Outcome(f, avg is not None, report.late, moved_on))
            cycle.reports.append(report)
            if avg is not None:
                await self.compute(_apply, outer, local, part, avg, sent)
            else:
                log.warning("outer step %d, fragment %d: averaging failed (%s)", step, f, report.reason)
            if moved_on:  # the others are at a later outer step: take their state, not average alone
                break
        return cycle


def _send(outer: OuterOptimizer, local: list[torch.Tensor], part: range) -> tuple[list[torch.Tensor], list[torch.Tensor], str]:
    """The fragment's local parameters as they are sent (kept to merge the result), its
    pseudo-gradient, and the hash of its outer state (parameters and momentum)."""
    sent = [p.detach().clone() for p in local]
    return sent, outer.pseudo_gradient(local, part), state_hash([*outer.params[part.start : part.stop], *outer.buffers[part.start : part.stop]])


@torch.no_grad()
def _apply(outer: OuterOptimizer, local: list[torch.Tensor], part: range, avg: list[torch.Tensor], sent: list[torch.Tensor]) -> None:
    """The fragment's outer step, and its local parameters moved onto the new outer ones (the
    module's docstring says why they keep the inner steps taken since the round started)."""
    for p, new, s in zip(local, outer.apply(avg, part), sent):
        p.add_(new.to(p.device) - s)

"""The decisions of a stage server (and of a trainer's side of the global clip), as plain classes
that take `now` and say why: no torch, no network, tested with time moved by hand.

    take_batch    which queued calls share one compute
    KeptGraphs    the forward graphs a server keeps for their backward: at most `limit`, each for `ttl_s`
    StepSchedule  when the stage's optimizer step is due and when it is taken, and when its stats
                  are written (see its docstring: the global clip's waiting lives here)
    NormBook      a trainer's: the newest gradient norm of every stage's step it heard, handed on
                  in every call, and which peers to tell once a step's micro-batches all came back
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Decision:
    """What the server does now: "step", "report" or "wait" (`until` a monotonic time, None:
    until a call comes), and why."""

    action: str
    reason: str
    until: float | None = None


class Queued(Protocol):
    op: str
    alone: bool  # computed on its own: its graph is kept, or was
    samples: int
    shape: tuple[int, ...]


def take_batch(queue: deque[Queued], max_samples: int) -> tuple[list[Queued], str]:
    """The first queued call and those queued behind it that can share its compute (the same op
    and sequence shape, none that keeps a graph, at most `max_samples` sequences together); the
    rest stay queued in order. Several trainers' forwards then share one, with no waiting added."""
    first = queue.popleft()
    if first.alone:
        return [first], "its graph is kept: computed alone"
    batch, n, rest = [first], first.samples, deque()
    while queue:
        p = queue.popleft()
        if not p.alone and p.op == first.op and p.shape[1:] == first.shape[1:] and n + p.samples <= max_samples:
            batch.append(p)
            n += p.samples
        else:
            rest.append(p)
    queue.extend(rest)
    return batch, f"{len(batch)} {first.op} calls queued together, {n} sequences"


class KeptGraphs:
    """Forward graphs kept for their backward, by key, oldest first: at most `limit`, none older
    than `ttl_s` (its trainer went elsewhere)."""

    def __init__(self, limit: int, ttl_s: float):
        self.limit, self.ttl_s = limit, ttl_s
        self._kept: OrderedDict[Hashable, tuple[float, Any]] = OrderedDict()

    def keep(self, key: Hashable, now: float, graph: Any) -> list[tuple[Hashable, str]]:
        """Keep `graph`; the (key, why) of those it pushed out."""
        dropped = self.expire(now)
        while len(self._kept) >= self.limit:
            old, _ = self._kept.popitem(last=False)
            dropped.append((old, f"the oldest of {self.limit} graphs kept"))
        self._kept[key] = (now, graph)
        return dropped

    def expire(self, now: float) -> list[tuple[Hashable, str]]:
        old = [k for k, (when, _) in self._kept.items() if now - when > self.ttl_s]
        for k in old:
            del self._kept[k]
        return [(k, f"kept over {self.ttl_s:.0f} s without its backward") for k in old]

    def take(self, key: Hashable) -> Any | None:
        kept = self._kept.pop(key, None)
        return None if kept is None else kept[1]

    def drop(self, key: Hashable) -> None:
        self._kept.pop(key, None)

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._kept


@dataclass(frozen=True)
class ServeTiming:
    pending_s: float = 1.0  # longest a due step waits for the next call (which brings the other stages' norms)
    report_s: float = 0.5  # after steps, the stats are written at most this often (syncs and the like at once)


class StepSchedule:
    """When a stage's optimizer step is due and when it is taken.

    A step is due once `step_samples` samples' gradients accumulated. Clipped by the stage's own
    norm (`clip_across` False), it is taken right after the batch that made it due. Clipped by
    one global norm, as one process clips the whole model's, the stage needs the other stages'
    norms of the same step: when the step falls due the stage puts its own gradient's squared norm
    in every answer from then on (`due_norm`, with a count of its steps due, so an older answer
    cannot bring an older norm back), trainers hand every stage's latest on in their calls, and
    the stage takes the step when the next call comes (`before_batch`) or when a call that carries
    none of its work brings them (`heard`: a trainer's norms call), or after `pending_s` with no
    call at all, with the norms it heard last. The stats are written after a step at most every
    `report_s`, and once the calls pause."""

    def __init__(self, step_samples: int, stages: int, index: int, clip_across: bool, pending_s: float, report_s: float):
        self.step_samples, self.stages, self.index, self.clip_across = step_samples, stages, index, clip_across
        self.pending_s, self.report_s = pending_s, report_s
        self.acc_samples = 0
        self.acc_calls = 0  # micro-batches in the accumulation (gradients are averaged over them)
        self.due_norm: tuple[int, float] = (0, -1.0)  # (steps due so far, the squared norm of the latest one's gradient)
        self.others2: float | None = None  # the other stages' squared norms together, from the latest call that carried them all
        self.norms_due = False  # they came while our step was due: the step need wait no longer
        self.next_report, self.unreported = 0.0, False

    @property
    def due(self) -> bool:
        return self.acc_samples >= self.step_samples

    def accumulated(self, samples: int, calls: int) -> bool:
        """Gradients of `samples` samples in `calls` micro-batches accumulated. True when that
        made a step due that clips by every stage's norm: the caller then gives `norm_due` ours."""
        was = self.due
        self.acc_samples += samples
        self.acc_calls += calls
        return self.clip_across and not was and self.due

    def norm_due(self, norm2: float) -> None:
        self.due_norm = (self.due_norm[0] + 1, norm2)

    def heard(self, norms2: tuple[float, ...]) -> bool:
        """A call's norms of every stage's latest step: ours clips by them with its own (only when
        it names them all; a caller that has not heard of every stage yet changes nothing). True
        when they came while our step is due: they are that step's, it need wait no longer."""
        if len(norms2) != self.stages:
            return False
        others = [v for i, v in enumerate(norms2) if i != self.index]
        if not all(v >= 0 for v in others):
            return False
        self.others2 = sum(others)
        if self.due:
            self.norms_due = True
        return self.due

    def answer_completes(self, norm_steps: tuple[int, ...]) -> bool:
        """The first stage, on the answer to a through call whose backward made its step due:
        whether the answer brought every later stage's norm of that same step (their counts of
        steps due are ours), so the step need not wait for the next call."""
        return self.index == 0 and self.due and all(n == self.due_norm[0] for n in norm_steps)

    def when_idle(self, now: float, idle_since: float) -> Decision:
        """No call is queued (since `idle_since`): step, write the stats, or wait."""
        if self.clip_across and self.due:
            if self.norms_due:
                return Decision("step", "a call brought the other stages' norms of this step")
            until = idle_since + self.pending_s
            if now >= until:
                return Decision("step", f"no call for {self.pending_s:g} s: stepping with the norms heard last")
            return Decision("wait", "the next call brings the other stages' norms of this step", until)
        if self.unreported:
            until = idle_since + self.report_s
            if now >= until:
                return Decision("report", "the calls paused: the steps since the last report are written")
            return Decision("wait", "steps to report once the calls pause", until)
        return Decision("wait", "nothing due: waiting for a call")

    def before_batch(self) -> Decision | None:
        if self.clip_across and self.due:
            return Decision("step", "a due step is taken before the next batch uses the weights")
        return None

    def after_batch(self) -> Decision | None:
        if self.due and not self.clip_across:
            return Decision("step", "its share of the step is in, clipped by its own norm")
        return None

    def stepped(self, now: float) -> bool:
        """The step was taken. True: write the stats now (else once the calls pause)."""
        self.acc_samples = self.acc_calls = 0
        self.norms_due = False
        if now >= self.next_report:
            return True
        self.unreported = True
        return False

    def reported(self, now: float) -> None:
        self.next_report, self.unreported = now + self.report_s, False


class NormBook:
    """A trainer's side of the global clip: every call carries the newest squared gradient norm
    of each stage's step it heard (-1: none yet); the newest step of each wins, so answers that
    cross on the way do not bring an older one back."""

    def __init__(self, stages: int):
        self.stages = stages
        self._norms: dict[int, tuple[str, int, float]] = {}  # stage -> (peer, its steps due, squared norm)
        self._step_peers: set[tuple[int, str]] = set()  # (stage, peer) that answered since the last step's norms went out

    def norms2(self) -> tuple[float, ...]:
        return tuple(self._norms[s][2] if s in self._norms else -1.0 for s in range(self.stages))

    def heard(self, peers: list[str], first: int, norm_steps: Iterable[int], norms2: Iterable[float]) -> None:
        """The norms an answer carries, of the stages from `first` on (served by `peers`)."""
        for i, (steps, norm2) in enumerate(zip(norm_steps, norms2)):
            if i >= len(peers) or norm2 < 0:
                continue
            self._step_peers.add((first + i, peers[i]))
            held = self._norms.get(first + i)
            if held is None or held[0] != peers[i] or steps > held[1]:
                self._norms[first + i] = (peers[i], steps, norm2)

    def to_tell(self) -> tuple[tuple[float, ...], list[tuple[int, str]]]:
        """Synchronous steps, a step's micro-batches all back: the norms and the (stage, peer) of
        the later stages to hand them to now, so the stages step side by side rather than each on
        the way of the next micro-batch (none until every stage's norm is known)."""
        norms2, peers = self.norms2(), sorted(p for p in self._step_peers if p[0] > 0)
        self._step_peers.clear()
        return (norms2, peers) if min(norms2, default=-1.0) >= 0 else (norms2, [])

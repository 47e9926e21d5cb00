"""A trainer's spot checks of the peers that serve the model's slots (stage servers, expert hosts).

A peer can answer with well-formed lies: activations or gradients scaled, zeroed, replaced by
noise, or an earlier call's answer replayed. Each passes every check of form. So a trainer sends
a random `audit_fraction` of its calls to a second peer of the same slot too (the same request:
a peer cannot tell a check from a call) and compares the two answers:

- they agree (each tensor within `tolerance` of the larger, relative, and of one size within
  SIZE_FACTOR): both stand, and the answer's size against its input's is noted as the size an
  honest answer of that kind has (`SizeBook`). The tolerance is wide: two honest peers of a slot
  drift apart between their syncs, most while training starts; noise of an honest answer's size
  is sqrt(2) apart;
- they disagree: one of them lies, or both do. `judge` decides, in this order:
  1. a third peer of the slot, where there is one: an answer that agrees with another is
     honest, one that agrees with none lies;
  2. each of the two asked the same again: a peer whose two answers from the same weights
     disagree lies (noise, replays). Each answer names its weights' version: an honest peer's
     answers differ once it stepped or synced, most while training starts;
  3. the answers' sizes against their inputs', against the sizes honest answers of the kind
     had lately: the one SIZE_VERDICT times outside them lies (scaled, zeroed), where the
     other is of their size;
  and where none of these tells, the dispute stays open: logged, nobody punished.

A peer judged to lie is banned through the transport's scores at once, with the reason: its
calls stop (`SlotPeers` skips peers the scores ban), the ban is in the node's /status, and the
peer hears why when it calls us. `judge` and the book are pure; `Auditor.check` makes the calls
through the role's `ask`.

What the checks do not see: a stage server that lies only in the calls stages make to each other
(stage_routing "through"), not in the trainer's own (checks are the trainer's forward and train
calls); gradients (a backward is not checked); a replay of an answer close to the right one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

Answer = Sequence[torch.Tensor]  # one call's answer: its tensors, in a fixed order
TOLERANCE = 1.2  # relative distance under which two answers to one call agree
SIZE_FACTOR = 4.0  # two answers to one call this many times apart in size disagree
# an answer this many times larger or smaller than honest ones of its kind lately is wrong, where
# another is of their size (an honest expert's answers grow severalfold in its first steps)
SIZE_VERDICT = 100.0
BOOK_MIN = 4  # honest sizes of a kind needed before sizes judge anything
ASKS = 3  # answers to one call asked of a peer in a dispute, at most


def compare(a: Answer, b: Answer) -> tuple[float, float]:
    """How far apart two answers are, tensor by tensor (a loss beside an activation's gradient
    would hide the gradient), the worst of their tensors: (the norm of the difference over the
    larger norm: 0 equal, 1 one is zero, about 1.4 unrelated tensors of one size; the ratio of
    the larger norm to the smaller: 1 one size)."""
    worst, ratio = 0.0, 1.0
    for x, y in zip(a, b, strict=True):
        nx, ny = float(x.double().norm()), float(y.double().norm())
        if max(nx, ny) > 0.0:
            worst = max(worst, float((x.double() - y.double()).norm()) / max(nx, ny))
        if nx != ny:
            ratio = max(ratio, math.inf if min(nx, ny) == 0.0 else max(nx, ny) / min(nx, ny))
    return worst, ratio


def distance(a: Answer, b: Answer) -> float:
    return compare(a, b)[0]


def agree(a: Answer, b: Answer, tolerance: float = TOLERANCE) -> bool:
    d, ratio = compare(a, b)
    return d <= tolerance and ratio <= SIZE_FACTOR


def apart(a: Answer, b: Answer) -> str:
    """How two answers differ, in words: "1.41 apart, 1x in size"."""
    d, ratio = compare(a, b)
    return f"{d:.2f} apart, {ratio:.3g}x in size"


def log_size(answer: Answer, inputs: torch.Tensor | None) -> float | None:
    """The answer's first tensor's size, as a logarithm: against its input's where that is a
    float tensor, else its root mean square (a first stage's input is token ids). None for an
    empty answer."""
    a = answer[0]
    if a.numel() == 0:
        return None
    size = float(a.double().norm())
    if inputs is not None and inputs.is_floating_point() and (x := float(inputs.double().norm())) > 0.0:
        return math.log(max(size, 1e-30) / x)
    return math.log(max(size / math.sqrt(a.numel()), 1e-30))


class SizeBook:
    """The sizes honest answers of each kind had (answers two peers agreed on)."""

    def __init__(self, keep: int = 64):
        self.sizes: dict[str, deque[float]] = {}
        self.keep = keep

    def note(self, kind: str, size: float | None) -> None:
        if size is not None:
            self.sizes.setdefault(kind, deque(maxlen=self.keep)).append(size)

    def median(self, kind: str) -> float | None:
        sizes = sorted(self.sizes.get(kind, ()))
        return sizes[len(sizes) // 2] if len(sizes) >= BOOK_MIN else None


@dataclass
class Verdict:
    liars: dict[str, str] = field(default_factory=dict)  # peer -> the reason
    open: str = ""  # why nothing could be decided (no liar named)


Given = tuple[Answer, int]  # an answer, and the version of the weights it came from (0: not known)


def same_weights_pair(given: list[Given]) -> tuple[Answer, Answer] | None:
    """Two of a peer's answers to one call that came from the same weights (a known version), if
    it gave two: an honest peer's two such answers agree."""
    seen: dict[int, Answer] = {}
    for answer, version in given:
        if version > 0 and version in seen:
            return seen[version], answer
        seen.setdefault(version, answer)
    return None


def judge(answers: dict[str, list[Given]], sizes: dict[str, float | None], honest_size: float | None, tolerance: float = TOLERANCE) -> Verdict:
    """Who lied, from the answers each peer gave to one call (the first, then any re-asks, each
    with its weights' version) and each first answer's size against its input (`log_size`);
    `honest_size` is the median honest size of the kind (SizeBook), None when unknown."""
    first = {p: a[0][0] for p, a in answers.items()}
    peers = sorted(first)
    if len(peers) >= 3:
        agrees = {p: [q for q in peers if q != p and agree(first[p], first[q], tolerance)] for p in peers}
        honest = [p for p in peers if agrees[p]]
        if honest:
            return Verdict({p: f"its answer agreed with none of {len(peers) - 1} other peers of the slot, {len(honest)} of which agreed with each other"
                            for p in peers if not agrees[p]})  # fmt: skip
    pairs = {p: pair for p, given in answers.items() if (pair := same_weights_pair(given))}
    inconsistent = {p: (a, b) for p, (a, b) in pairs.items() if not agree(a, b, tolerance)}
    if inconsistent:
        return Verdict({p: f"it answered the same call twice from the same weights with answers {apart(a, b)}"
                        for p, (a, b) in inconsistent.items()})  # fmt: skip
    if honest_size is not None:
        off = {p: abs(s - honest_size) for p, s in sizes.items() if s is not None and p in first}
        far = {p for p, o in off.items() if o > math.log(SIZE_VERDICT)}
        if far and any(o <= math.log(SIZE_FACTOR) for o in off.values()):  # (another answer of the usual size)
            return Verdict({p: f"its answer was {math.exp(sizes[p] - honest_size):.3g}x the size honest answers have against their input" for p in far})
    a, b = first[peers[0]], first[peers[1]]
    return Verdict(open=f"the answers of {', '.join(p[-8:] for p in peers)} disagree ({apart(a, b)}) and nothing tells which is wrong")


class Auditor:
    """When to check a call, and the check itself: the second peer's answer, the dispute's
    judgement, the bans. `scores` is the transport's PeerScores."""

    def __init__(self, fraction: float, scores, what: str, rng: random.Random | None = None, tolerance: float = TOLERANCE):
        self.fraction, self.scores, self.what, self.tolerance = fraction, scores, what, tolerance
        self.rng = rng or random.Random()
        self.book = SizeBook()
        self.counts = {"checked": 0, "agreed": 0, "disputes": 0, "open": 0, "caught": 0}

    def due(self) -> bool:
        return self.fraction > 0 and self.rng.random() < self.fraction

    async def check(self, kind: str, peers: Sequence[str], first: str, given: Given, inputs: torch.Tensor | None,
                    ask: Callable[[str], Awaitable[Given | None]]) -> tuple[str, Answer]:  # fmt: skip
        """Check `first`'s answer (`given`: it and its weights' version) against another peer of
        the slot (`peers`; `ask(peer)` makes the same call to it: its answer and version, or None
        if the call failed). Returns the peer and answer to go on with: `first`'s, unless it was
        caught lying and an honest answer is known."""
        now = time.monotonic()
        others = [p for p in peers if p != first and not self.scores.banned(p, now)]
        if not others:
            return first, given[0]
        self.rng.shuffle(others)
        second = others[0]
        other = await ask(second)
        if other is None:
            return first, given[0]
        self.counts["checked"] += 1
        if agree(given[0], other[0], self.tolerance):
            self.counts["agreed"] += 1
            self.book.note(kind, log_size(given[0], inputs))
            return first, given[0]
        self.counts["disputes"] += 1
        answers = {first: [given], second: [other]}
        if len(others) > 1 and (third := await ask(others[1])) is not None:
            answers[others[1]] = [third]
        if len(answers) < 3:
            await asyncio.gather(*(self._ask_again(p, answers[p], ask) for p in (first, second)))
        return self._settle(kind, first, answers, inputs)

    @staticmethod
    async def _ask_again(peer: str, given: list[Given], ask) -> None:
        """Ask `peer` the same again, until two of its answers came from the same weights (at most
        ASKS in all: a step or a sync between two asks changes them)."""
        while len(given) < ASKS and same_weights_pair(given) is None:
            got = await ask(peer)
            if got is None:
                return
            given.append(got)

    def _settle(self, kind: str, first: str, answers: dict[str, list[Given]], inputs) -> tuple[str, Answer]:
        """The dispute's verdict carried out: the liars banned; the answer to go on with."""
        verdict = judge(answers, {p: log_size(a[0][0], inputs) for p, a in answers.items()}, self.book.median(kind), self.tolerance)
        if verdict.open:
            self.counts["open"] += 1
            log.info("%s check of %s: %s", self.what, kind, verdict.open)
            return first, answers[first][0][0]
        now = time.monotonic()
        for peer, why in verdict.liars.items():
            if self.scores.banned(peer, now):  # (caught by a check that ran alongside this one)
                continue
            self.counts["caught"] += 1
            self.scores.penalize(peer, -self.scores.config.ban_score, now, f"a wrong answer ({kind}), caught by a check: {why}")
        honest = [p for p in answers if p not in verdict.liars]
        if first not in verdict.liars or not honest:
            return first, answers[first][0][0]
        return honest[0], answers[honest[0]][0][0]

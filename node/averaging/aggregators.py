"""How the owner of a slice combines the contributions it received. Pure functions of the
members' contributions (a list of equal-length vectors, in member order) and per-member
weights; deterministic, so every run over the same inputs gives the same bits.

- `mean`: the weighted mean. Exact, trusts everyone.
- `trimmed_mean`: per coordinate, drop the `trim` largest and smallest values, average the rest
  (unweighted). Survives up to `trim` arbitrary senders.
- `centered_clip`: CenteredClip (Karimireddy et al. 2021): start at the coordinate-wise median,
  then repeatedly move towards the weighted mean of the contributions, each clipped to radius
  `tau` around the current estimate. Bounded influence of any single sender. `tau` by default
  is the group's own spread (the median distance of the contributions from the coordinate-wise
  median): a fixed radius is wrong at every scale but one (larger than the honest spread, it
  let two liars of eight move the result by most of an honest update's norm).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def mean(parts: Sequence[torch.Tensor], weights: torch.Tensor, **_) -> torch.Tensor:
    w = (weights / weights.sum()).tolist()
    out = torch.mul(parts[0], w[0])
    for p, wi in zip(parts[1:], w[1:]):  # a fixed order: bitwise reproducible
        out.add_(p, alpha=wi)
    return out


def trimmed_mean(parts: Sequence[torch.Tensor], weights: torch.Tensor, trim: int | None = None, **_) -> torch.Tensor:
    parts = torch.stack(list(parts))
    n = parts.shape[0]
    trim = max(0, (n - 1) // 4) if trim is None else trim
    if n - 2 * trim < 1:
        raise ValueError(f"cannot trim {trim} from each side of {n} contributions")
    if trim == 0:
        return parts.mean(dim=0)
    ordered, _ = torch.sort(parts, dim=0)
    return ordered[trim : n - trim].mean(dim=0)


def centered_clip(parts: Sequence[torch.Tensor], weights: torch.Tensor, tau: float | None = None, iterations: int = 20, **_) -> torch.Tensor:
    parts = torch.stack(list(parts))
    w = (weights / weights.sum()).to(parts.dtype)
    v = parts.median(dim=0).values
    if tau is None:
        tau = float((parts - v).norm(dim=1).median())
    for _ in range(iterations):
        diff = parts - v
        norms = diff.norm(dim=1)
        scale = torch.clamp(tau / torch.clamp(norms, min=1e-12), max=1.0)
        step = (w * scale).unsqueeze(1).mul(diff).sum(dim=0)
        v = v + step
        if float(step.norm()) <= 1e-7 * max(1.0, float(v.norm())):
            break
    return v


AGGREGATORS = {"mean": mean, "trimmed_mean": trimmed_mean, "centered_clip": centered_clip}

# a part this many times the group's spread away from the robust aggregate is evidence against its
# sender. Honest replicas on their own data shards lie up to about 6x away (bench/RESULTS.md,
# byzantine: one of eight was banned at 4x, round after round); the lies that do harm lie from
# tens to thousands of times away
FAR = 10.0


def far_parts(parts: Sequence[torch.Tensor], result: torch.Tensor, members: Sequence[str], far: float = FAR) -> dict[str, float]:
    """The members whose part lies more than `far` times the group's spread from `result` (a
    robust aggregate of `parts`), each with how many times: the evidence a slice's owner holds
    against a liar. The spread is the median distance of the parts from `result`; with fewer
    than three parts there is no majority to measure against, and nobody is far."""
    if len(parts) < 3:
        return {}
    dist = torch.stack([(p - result).norm() for p in parts])
    spread = float(dist.median())
    if spread <= 0.0:
        return {}
    return {m: round(float(d) / spread, 1) for m, d in zip(members, dist) if float(d) > far * spread}


# the judge by harm: a part that, applied alone in place of its slice, raises the loss of its own
# sender's data while the robust aggregate lowers it points the wrong way, however near the
# others it lies. A check batch is noisy (an honest part now and then raises it a little), so
# only a run of HARM_RUN rounds each raising it by more than HARM times the aggregate's gain is
# evidence (bench/RESULTS.md, byzantine: the judge by harm)
HARM = 0.05
HARM_RUN = 5


def harm_ratios(losses: Sequence[tuple[float, float, float]], members: Sequence[str]) -> dict[str, float]:
    """How much each member's part raised the loss of its check batch, in times what the
    aggregate lowered it there (negative: it lowered it too). `losses`, per member: (at θ, with
    the aggregate's slice, with its part's slice). A member is not judged where the aggregate
    did not lower its batch's loss (nothing to measure harm against) or a loss is not a
    number; nobody with fewer than three parts (no majority)."""
    if len(losses) < 3:
        return {}
    out = {}
    for m, (base, with_aggregate, with_part) in zip(members, losses):
        gain = base - with_aggregate
        if gain > 0 and math.isfinite(base) and math.isfinite(with_part):
            out[m] = round((with_part - base) / gain, 3)
    return out


class HarmRuns:
    """Each peer's run of committed rounds in which its part raised its check batch's loss (by
    more than HARM times the aggregate's gain, in a slice we own); a round that judged it and
    found no harm ends its run, one that did not judge it leaves the run as it was."""

    def __init__(self, harm: float = HARM, run: int = HARM_RUN):
        self.harm, self.run = harm, run
        self.runs: dict[str, int] = {}

    def add(self, judged: dict[int, dict[str, float]]) -> dict[str, tuple[int, float]]:
        """One committed round's ratios (slice -> member -> ratio): the peers whose run reached
        HARM_RUN rounds, each with its run and its largest ratio this round."""
        worst: dict[str, float] = {}
        for ratios in judged.values():
            for m, r in ratios.items():
                worst[m] = max(r, worst.get(m, -math.inf))
        for m, r in worst.items():
            self.runs[m] = self.runs.get(m, 0) + 1 if r > self.harm else 0
        return {m: (self.runs[m], worst[m]) for m in worst if self.runs[m] >= self.run}


def get(name: str):
    try:
        return AGGREGATORS[name]
    except KeyError:
        raise ValueError(f"unknown aggregator {name!r}; known: {', '.join(AGGREGATORS)}") from None


def tolerance(name: str, n: int) -> int:
    """How many arbitrary senders the aggregator tolerates in a group of n."""
    if name == "trimmed_mean":
        return max(0, (n - 1) // 4)
    if name == "centered_clip":
        return max(0, math.ceil(n / 2) - 1)
    return 0

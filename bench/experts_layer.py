"""What every arm of bench/experts.py shares: its settings and the loop that times a layer's calls
(the bench's docstring tells the arms)."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = 8  # micro-batches per loss report of a trainer (node/roles/stats.py REPORT_EVERY)
WINDOW = 32  # micro-batches the final loss is the mean of (a multiple of REPORT)
HM_PREFIX = "expert."  # hivemind expert uids: expert.0 .. expert.{E-1}


@dataclass(frozen=True)
class Settings:
    model: str = "tiny-moe"
    hosts: int = 2  # expert host processes (every arm but (a)); the swarm's --expert-shards
    tokens: int = 128  # tokens per forward+backward of the layer (2 sequences of 64)
    steps: int = 30  # measured calls per layer arm (the batches; repeated in order while under min_seconds)
    min_seconds: float = 20.0  # a layer arm's calls last at least this long (more calls of the same batches)
    warmup: int = 5  # calls before the measured ones
    kill_every_s: float = 30.0  # (d), (b-kill): a host SIGKILLed and restarted this often
    kill_run_s: float = 95.0  # (d), (b-kill): seconds of calls (kills at 30, 60, 90 s)
    train_micro_batches: int = 256  # (a), (c): micro-batches trained; 0: no training
    batch_size: int = 8  # sequences per micro-batch
    lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0
    hm_expert: str = "mlp"  # mlp: our expert registered with hivemind; ffn: hivemind's FeedforwardBlock
    hm_handlers: int = 0  # hivemind connection handler processes per server; 0: hivemind's default (8 per expert)
    hm_timeout_s: float = 10.0  # hivemind forward_timeout / backward_timeout (ours: 10 s for a host never measured)
    hm_after_k_min_s: float = 2.0  # hivemind timeout_after_k_min (ours: at least 2 s per call)


def _env() -> dict:
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _presets(s: Settings):
    from node.models.moe import MOE_PRESETS

    return MOE_PRESETS[s.model]


def token_batches(s: Settings, n: int):
    """The layer arms' inputs: n batches of `tokens` vectors of width d, from one seed."""
    import torch

    gpt, _ = _presets(s)
    gen = torch.Generator().manual_seed(s.seed + 1)
    return [torch.randn(s.tokens, gpt.n_embd, generator=gen) for _ in range(n)]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))]


class LayerLoop:
    """Runs a layer's calls after `warmup` ones: the `steps` batches in order, again and again
    until at least `steps` calls and `min_seconds` (a fast arm's statistics need more than a few
    calls); or, for a kill arm, for `seconds`. Catches what a call raises (counted, the loop goes
    on, as a training loop that survives would have to)."""

    def __init__(self, s: Settings, call, seconds: float | None = None, started: Path | None = None, log: bool = False):
        self.s, self.call, self.seconds, self.started, self.log = s, call, seconds, started, log

    def _more(self, i: int, elapsed: float) -> bool:
        if self.seconds is not None:
            return elapsed < self.seconds
        return i < self.s.steps or elapsed < self.s.min_seconds

    def run(self) -> dict:
        s = self.s
        batches = token_batches(s, s.warmup + s.steps)
        for i in range(s.warmup):
            try:
                self.call(f"w{i}", batches[i])
            except Exception as e:
                print(f"warm-up call {i}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if self.started is not None:
            self.started.write_text(str(time.time()))
        lat, tokens, pairs, pairs_ok, unrouted, skipped, exceptions, nonfinite, errors = [], 0, 0, 0, 0, 0, 0, 0, []
        timeline = []  # (seconds since start, tokens) of each call that returned finite values
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        i = 0
        while self._more(i, time.perf_counter() - t0):
            x = batches[s.warmup + i % s.steps]
            c0 = time.perf_counter()
            try:
                out = self.call(f"m{i}", x)
            except Exception as e:  # must never happen in the swarm's arms; hivemind's may raise
                exceptions += 1
                if len(errors) < 3:
                    errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                i += 1
                continue
            lat.append(time.perf_counter() - c0)
            if self.log:
                print(f"call {i}: {lat[-1]:.3f} s {out}", file=sys.stderr, flush=True)
            pairs += out["pairs"]
            unrouted += out.get("unrouted", 0)
            skipped += out.get("skipped", 0)
            if not out["finite"]:
                nonfinite += 1
            else:
                tokens += x.size(0)
                pairs_ok += out["pairs"]
                timeline.append((time.perf_counter() - t0, x.size(0)))
            i += 1
        seconds = time.perf_counter() - t0
        row = {
            "samples_per_s": tokens / seconds if seconds > 0 else 0.0, "latency_p50_s": _pct(lat, 0.5), "latency_p99_s": _pct(lat, 0.99),
            "token_expert_pairs_per_s": pairs_ok / seconds if seconds > 0 else 0.0,
            "calls": i, "calls_ok": len(lat) - nonfinite, "seconds": seconds, "token_expert_pairs_per_call": pairs / max(len(lat), 1),
            "tokens_without_expert": unrouted, "exceptions": exceptions, "nonfinite_calls": nonfinite, "skipped_experts": skipped,
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # the machine's, before and after: 2 cores
        }  # fmt: skip
        if errors:
            row["errors"] = errors
        if self.seconds is not None:  # per kill period: what the calls did between two kills
            period = self.s.kill_every_s
            n = max(1, math.ceil(seconds / period))
            row["samples_per_s_by_period"] = [
                round(sum(k for t, k in timeline if j * period <= t < (j + 1) * period) / max(1e-9, min(period, seconds - j * period)), 1) for j in range(n)
            ]
        return row


def _routed(routing, n: int) -> dict:
    """Token-expert pairs a routing sent, and tokens it sent to no expert (over capacity)."""
    import torch

    idx = [t for t in routing.tokens if t.numel()]
    reached = int(torch.cat(idx).unique().numel()) if idx else 0
    return {"pairs": sum(int(t.numel()) for t in routing.tokens), "unrouted": n - reached}


def _finite(*ts) -> bool:
    import torch

    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)

"""What every arm of bench/allreduce_peer.py shares: the peers' tensors and their exact mean,
error measures, and `Arm`, the base each implementation's arm builds on."""

from __future__ import annotations

import os
import time

from bench.workers import session_pids

# ---------------------------------------------------------------------------- data


def shapes(numel: int, n_tensors: int) -> list[tuple[int, ...]]:
    """`n_tensors` matrices of 1024 columns (or vectors, for tiny sizes) with `numel` elements in all."""
    cols = 1024 if numel >= 1024 * n_tensors else 1
    rows = numel // cols
    n = min(n_tensors, rows)
    return [((rows * (j + 1)) // n - (rows * j) // n, cols) for j in range(n)]


def make_tensors(seed: int, numel: int, n_tensors: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes(numel, n_tensors)]


def exact_mean(seed: int, n_peers: int, numel: int, n_tensors: int):
    """The mean over all peers of their tensors, summed in float64, tensor by tensor."""
    import torch

    gens = [torch.Generator().manual_seed(seed + i) for i in range(n_peers)]
    out = []
    for s in shapes(numel, n_tensors):
        acc = torch.zeros(s, dtype=torch.float64)
        for g in gens:
            acc += torch.randn(s, generator=g)
        out.append((acc / n_peers).to(torch.float32))
    return out


def rel_error(result, reference) -> float:
    """||result - reference|| / ||reference||, summed in float64, a slice at a time (cheap on
    CPU and memory: peers still finishing their round share these cores)."""
    num = den = 0.0
    step = 1 << 18
    for r, m in zip(result, reference):
        r, m = r.reshape(-1), m.reshape(-1)
        for a in range(0, m.numel(), step):
            d = (r[a : a + step].float() - m[a : a + step]).double()
            md = m[a : a + step].double()
            num += float(d.dot(d))
            den += float(md.dot(md))
    return (num / den) ** 0.5


def _daemon_cpu() -> float:
    """CPU seconds used so far by the p2pd daemons in this peer's session (ours: one)."""
    from node.osutil import process_cpu

    used = [process_cpu(pid) for pid in session_pids(os.getsid(0))]
    return sum(seconds for name, seconds in filter(None, used) if name == "p2pd")


def wait_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


# ---------------------------------------------------------------------------- arms


class Arm:
    """Base: holds the peer's own tensors, the working copy and the exact mean."""

    def __init__(self, cfg: dict):
        import torch

        self.cfg = cfg
        self.n = cfg["n_peers"]
        torch.set_num_threads(cfg["threads"])
        self.original = make_tensors(cfg["seed"] + cfg["rank"], cfg["numel"], cfg["n_tensors"])
        self.work = [t.clone() for t in self.original]
        self.result = None  # the last round's result, until `check`
        self.reference = exact_mean(cfg["seed"], self.n, cfg["numel"], cfg["n_tensors"])

    def setup(self) -> dict:
        return {}

    def prepare(self, rnd: int) -> dict:
        for w, o in zip(self.work, self.original):
            w.copy_(o)
        return {}

    def go(self, rnd: int, at: float) -> dict:
        """Average, timed; keep the result in `self.result` for `check`."""
        raise NotImplementedError

    def check(self) -> dict:
        """The last result against the exact mean. A command of its own, sent once every peer
        has answered `go`: a peer that finished first must not spend the cores the others are
        still finishing their round on (measuring 100 MB in float64 is ~0.1 s of CPU)."""
        result, self.result = self.result, None  # not held into the next round: its memory is free for it
        return {"rel_error": rel_error(result, self.reference)}

    def abort(self) -> dict:
        """Undo a `prepare` whose round will not run (another peer failed to prepare)."""
        return {}

    def close(self) -> None:
        pass

    # ---- bench/faults.py: whole rounds among whoever is there, checked against their exact mean

    def subset_mean(self, ranks: frozenset[int]) -> list:
        """The exact mean of the tensors of peers `ranks` (cached: a fault run sees few subsets)."""
        cache = self.__dict__.setdefault("_subset_means", {})
        if ranks not in cache:
            import torch

            out = []
            gens = {r: torch.Generator().manual_seed(self.cfg["seed"] + r) for r in sorted(ranks)}
            for s in shapes(self.cfg["numel"], self.cfg["n_tensors"]):
                acc = torch.zeros(s, dtype=torch.float64)
                for g in gens.values():
                    acc += torch.randn(s, generator=g)
                out.append(acc / len(ranks))
            cache[ranks] = out
        return cache[ranks]

    def reset(self) -> None:
        """Every peer averages its own original tensors afresh each round."""
        Arm.prepare(self, 0)

    def fault_round(self, msg: dict) -> dict:
        """One whole round (reset, average at `at`, matchmaking included) with a deadline, its
        result measured against the exact mean of the peers it says took part: "members" when
        the implementation says who was averaged, else "group" (its group) and, when a suspect
        was in it, "group_minus_suspects" (the caller takes the closest)."""
        ranks = {p: int(r) for p, r in msg["ranks"].items()}
        self.reset()
        out, result = self.average_round(msg)

        def error(ids) -> float:
            if unknown := [p for p in ids if p not in ranks]:
                raise RuntimeError(f"the round names peers this run does not know: {unknown}")
            return max_abs_error(result, self.subset_mean(frozenset(ranks[p] for p in ids)))

        refs = {}
        if out.get("members") is not None:
            refs["members"] = out["members"]
        else:
            refs["group"] = group = out["group"]
            rest = [p for p in group if p not in set(msg.get("suspects") or ())]
            if rest and len(rest) < len(group):
                refs["group_minus_suspects"] = rest
        errors = {name: error(ids) for name, ids in refs.items()}
        tol = msg.get("tolerance")
        if tol is not None and min(errors.values()) > tol:  # a wrong success: which parts are wrong, and how
            means = {name: self.subset_mean(frozenset(ranks[p] for p in ids)) for name, ids in refs.items()}
            out["blocks"] = block_matches(result, {**means, "own": self.original}, tol)
        return {**out, "errors": errors}

    def average_round(self, msg: dict) -> tuple[dict, list]:
        raise NotImplementedError(f"{type(self).__name__} does not run fault rounds")


def block_matches(result, references: dict, tol: float, block: int = 1024) -> dict:
    """Blocks of `block` elements of the flat result, counted by the first reference each one
    matches within `tol` ("none": none does). Tells a wrong result's parts apart: averaged over
    the group, over part of it, or never averaged (the peer's own values)."""
    import torch

    flat = torch.cat([t.reshape(-1).double() for t in result])
    block = min(block, flat.numel())
    n = flat.numel() // block * block
    label = torch.full((n // block,), -1)
    for k, ref in enumerate(references.values()):
        ref = torch.cat([t.reshape(-1).double() for t in ref])
        ok = (flat[:n] - ref[:n]).abs().view(-1, block).amax(1) <= tol
        label[(label < 0) & ok] = k
    counts = {name: int((label == k).sum()) for k, name in enumerate(references)}
    return {**counts, "none": int((label < 0).sum()), "block_elements": block}


def max_abs_error(result, reference) -> float:
    """max |result - reference| over all elements, in float64."""
    worst = 0.0
    for r, m in zip(result, reference):
        worst = max(worst, float((r.double() - m).abs().max()))
    return worst

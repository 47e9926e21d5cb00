"""What a process tree holds in memory, summed over its processes, sampled while a bench runs.

    tree_pids(root)       the root, every process in its session and every descendant
    tree_memory(root)     {rss_mib, pss_mib, cpu_s, processes}: the tree's summed RSS and PSS, and
                          the CPU seconds its live processes used so far
    available_mib()       what the machine can still give (MemAvailable)
    MemoryWatch           samples named trees every `interval_s` in a thread: each tree's peaks,
                          and the CPU seconds trees used between two times

RSS counts every resident page of every process: pages two processes share (a forked DHT
child's copy-on-write pages, the same shared libraries) are counted once per process. PSS
(/proc/PID/smaps_rollup) splits each shared page among the processes that map it: summed over a
tree it is what the tree costs, counting pages it shares with processes outside the tree at
their share. Linux only.
"""

from __future__ import annotations

import os
import threading
import time

MIB = 1 << 20
TICKS = os.sysconf("SC_CLK_TCK")  # CPU time in /proc/PID/stat is counted in these per second


Procs = dict[int, tuple[int, int, str, int]]


def _scan() -> Procs:
    """pid -> (parent pid, session id, command name, CPU ticks used: user + system) of every live process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                head, _, rest = f.read().rpartition(b")")
        except OSError:
            continue
        fields = rest.split()
        if len(fields) < 13 or fields[0] == b"Z":
            continue
        out[int(entry)] = (int(fields[1]), int(fields[3]), head.partition(b"(")[2].decode(errors="replace"), int(fields[11]) + int(fields[12]))
    return out


def available_mib() -> int:
    """The memory this machine can still give without swapping (MemAvailable), MiB."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("MemAvailable:"))


def tree_pids(root: int, procs: Procs | None = None) -> list[int]:
    """`root`, the processes of its session (it was started with start_new_session: its DHT child,
    p2pd) and every descendant (one that moved to a session of its own, torch_shm_manager)."""
    procs = _scan() if procs is None else procs
    found = {p for p, (_, sid, _, _) in procs.items() if sid == root} | ({root} if root in procs else set())
    grew = True
    while grew:
        more = {p for p, (ppid, _, _, _) in procs.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return sorted(found)


def _rollup(pid: int) -> tuple[int, int] | None:
    """(Rss, Pss) of one process in bytes; None once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    got = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("Rss", "Pss"):
            got[key] = int(value.split()[0]) * 1024
    return (got["Rss"], got["Pss"]) if len(got) == 2 else None


def tree_memory(root: int, procs: Procs | None = None) -> dict | None:
    """The tree's summed RSS and PSS (MiB), the CPU seconds its live processes used so far (all,
    and the root's alone), and their names; None when none is alive."""
    procs = _scan() if procs is None else procs
    rss = pss = ticks = 0
    names = []
    for pid in tree_pids(root, procs):
        got = _rollup(pid)
        if got is None:
            continue
        rss, pss, ticks = rss + got[0], pss + got[1], ticks + procs[pid][3]
        names.append(procs[pid][2])
    if not names:
        return None
    root_s = procs[root][3] / TICKS if root in procs else 0.0
    return {"rss_mib": round(rss / MIB, 1), "pss_mib": round(pss / MIB, 1), "cpu_s": ticks / TICKS, "root_cpu_s": root_s, "processes": sorted(names)}


class MemoryWatch:
    """Samples the trees it watches every `interval_s` (one scan of /proc per sample) in a daemon
    thread. `watch(name, pid)` starts a tree afresh; `forget(name)` stops it and gives its
    peaks: {rss_mib, pss_mib, pss_mib_last, peak_pss_at_s (after the watch began), processes,
    samples}, the RSS and PSS peaks maybe from different samples; `cpu_between(names, t0, t1)`
    the CPU seconds trees used between two wall-clock times. Use as a context manager: the
    thread stops on exit."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._roots: dict[str, int] = {}
        self._since: dict[str, float] = {}
        self._peaks: dict[str, dict] = {}
        self._cpu: dict[str, list[tuple[float, float, float]]] = {}  # name -> (time.time(), CPU seconds so far: the tree's, its root's) per sample
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def watch(self, name: str, pid: int) -> None:
        with self._lock:
            self._roots[name], self._since[name] = pid, time.time()
            self._peaks.pop(name, None)
            self._cpu[name] = []
        self.sample([name])

    def forget(self, name: str) -> dict | None:
        """Stop sampling `name`'s tree (one last sample first); its peaks."""
        self.sample([name])
        with self._lock:
            self._roots.pop(name, None)
            return self._peaks.pop(name, None)

    def cpu_between(self, names: list[str], t0: float, t1: float) -> dict:
        """CPU seconds the trees of `names` used from their last sample at or before `t0` to
        their first at or after `t1`: {cpu_s, by_tree: {name: {cpu_s, root_cpu_s}}, from, to
        (the samples' times)}; sampled every interval_s, so the span is up to that much wider
        than asked. ValueError without samples."""
        by, first, last = {}, t0, t1
        with self._lock:
            for name in names:
                series = self._cpu.get(name) or []
                before = [s for s in series if s[0] <= t0]
                after = [s for s in series if s[0] >= t1]
                if not before or not after:
                    raise ValueError(f"{name}: no CPU samples around {t0:.1f}..{t1:.1f}")
                by[name] = {"cpu_s": round(after[0][1] - before[-1][1], 2), "root_cpu_s": round(after[0][2] - before[-1][2], 2)}
                first, last = min(first, before[-1][0]), max(last, after[0][0])
        return {"cpu_s": round(sum(b["cpu_s"] for b in by.values()), 2), "by_tree": by, "from": first, "to": last}

    def sample(self, names: list[str] | None = None) -> None:
        procs, now_t = _scan(), time.time()
        with self._lock:
            roots = {n: p for n, p in self._roots.items() if names is None or n in names}
        for name, pid in roots.items():
            now = tree_memory(pid, procs)
            if now is None:
                continue
            with self._lock:
                if name not in self._roots:
                    continue
                self._cpu[name].append((now_t, now["cpu_s"], now["root_cpu_s"]))
                old = self._peaks.get(name)
                at = round(now_t - self._since[name], 1)
                if old is None:
                    self._peaks[name] = {**{k: v for k, v in now.items() if not k.endswith("cpu_s")}, "pss_mib_last": now["pss_mib"], "peak_pss_at_s": at, "samples": 1}
                    continue
                old["samples"] += 1
                old["pss_mib_last"] = now["pss_mib"]
                old["rss_mib"] = max(old["rss_mib"], now["rss_mib"])
                if now["pss_mib"] > old["pss_mib"]:
                    old["pss_mib"], old["processes"], old["peak_pss_at_s"] = now["pss_mib"], now["processes"], at

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

"""One peer of bench/allreduce.py: an OS process that averages its tensors with N-1 others.

Started by the parent (`python -m bench.allreduce_peer`, maybe behind `ip netns exec`) and
commanded over stdin/stdout, one JSON object per line; it answers every command with one line
(`{"error": ...}` on failure). Anything else written to stdout (library prints) goes to stderr,
which the parent keeps as this peer's log.

    {"cmd": "setup", "impl": "gloo"|"hivemind"|"swarmtrain", ...}  -> {"ok": true, "maddrs": [...]}
    {"cmd": "prepare", "round": r}   reset the tensors (hivemind: also find the group) -> {"ok": true}
    {"cmd": "go", "round": r, "at": t}   at monotonic time t, average -> {"seconds", "start_lag", ...}
    {"cmd": "check"}                 the last result against the exact mean -> {"rel_error": e}
    {"cmd": "round", "round": r, "at": t, "timeout": s, "ranks": {peer id: rank}, "expected": [ids] | null,
     "suspects": [ids]}              bench/faults.py: reset, average at t (matchmaking included) and
                                     measure the result against the exact mean of the peers the round
                                     says took part -> {"seconds", "members", "leader", "errors", ...}
    {"cmd": "exit"}                  shut down cleanly -> {"ok": true, "leftover": [...]}, exit 0

Peer i's tensors are N(0, 1) from seed `seed + i`; every peer rebuilds the exact mean of all
peers' tensors (in float64) to measure its result against. If stdin closes without an "exit"
(the parent died), the peer SIGKILLs everything in its session (DHT, averager, p2pd) and itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

from bench.workers import kill_session, session_pids


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


class GlooArm(Arm):
    """torch.distributed all_reduce (SUM) on gloo, then divide by N: the dense fp32 anchor."""

    def setup(self) -> dict:
        import datetime

        import torch.distributed as dist

        os.environ["GLOO_SOCKET_IFNAME"] = self.cfg["ifname"]
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{self.cfg['master_addr']}:{self.cfg['master_port']}",
            rank=self.cfg["rank"],
            world_size=self.n,
            timeout=datetime.timedelta(seconds=self.cfg["timeout"]),
        )
        return {}

    def go(self, rnd: int, at: float) -> dict:
        import torch.distributed as dist

        wait_until(at)
        t0 = time.monotonic()
        for t in self.work:
            dist.all_reduce(t)
        for t in self.work:
            t.div_(self.n)
        seconds = time.monotonic() - t0
        self.result = self.work
        return {"seconds": seconds, "start_lag": t0 - at, "members": self.n}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


HIVEMIND_COMPRESSION = {"none": "NoCompression", "fp16": "Float16Compression", "int8": "Uniform8BitQuantization"}


class HivemindArm(Arm):
    """hivemind.averaging.DecentralizedAverager, set up as hivemind/benchmarks/benchmark_averaging.py does.

    Each round is one `averager.step()`, split at hivemind's own trigger: `prepare` runs the
    matchmaking until the group is assembled (AWAITING_TRIGGER), `go` triggers the all-reduce at
    the common start time, so the timed part is the all-reduce alone, like gloo's. The
    matchmaking time is reported separately.
    """

    def setup(self) -> dict:
        os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
        import warnings

        warnings.simplefilter("ignore")
        import hivemind
        import hivemind.compression as hc
        from hivemind.averaging import DecentralizedAverager

        codec = self.cfg["codec"]
        if codec not in HIVEMIND_COMPRESSION:
            raise ValueError(f"no hivemind compression matches codec {codec!r}")
        compression = getattr(hc, HIVEMIND_COMPRESSION[codec])()
        ip = self.cfg["ip"]
        self.dht = hivemind.DHT(
            initial_peers=self.cfg.get("initial_peers") or None, host_maddrs=[f"/ip4/{ip}/tcp/0"], start=True
        )
        if self.cfg.get("hivemind_leader_log"):
            _log_hivemind_leaders(self.cfg["hivemind_leader_log"])  # before the averager forks: it inherits this
        self.averager = DecentralizedAverager(
            self.work,
            self.dht,
            prefix=f"bench_{codec}",
            target_group_size=self.n,
            # bench/allreduce.py: a round counts only with every peer in it; bench/faults.py: hivemind's default (2)
            min_group_size=self.cfg.get("hivemind_min_group_size") or self.n,
            min_matchmaking_time=self.cfg["hivemind_min_matchmaking_time"],
            request_timeout=self.cfg["hivemind_request_timeout"],
            allreduce_timeout=self.cfg["timeout"],
            next_chunk_timeout=self.cfg.get("hivemind_next_chunk_timeout"),  # None: hivemind's default (no timeout)
            compression=compression,
            bandwidth=self.cfg.get("hivemind_bandwidth"),
            start=True,
        )
        # wire ratio of the compression on one all-reduce part (hivemind sends parts of 512 KiB)
        from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

        sample = self.original[0].flatten()[: DEFAULT_PART_SIZE_BYTES // 4].contiguous()
        msg = compression.compress(sample, hc.CompressionInfo.from_tensor(sample))
        self.ratio = msg.ByteSize() / (sample.numel() * 4)
        self.ctrl = None
        return {"maddrs": [str(m) for m in self.dht.get_visible_maddrs()], "compression_ratio": self.ratio, "peer_id": str(self.dht.peer_id)}

    def prepare(self, rnd: int) -> dict:
        from hivemind.averaging.control import AveragingStage

        with self.averager.get_tensors() as tensors:
            for t, o in zip(tensors, self.original):
                t.copy_(o)
        t0 = time.monotonic()
        timeout = self.cfg["hivemind_matchmaking_timeout"]
        self.ctrl = self.averager.step(wait=False, require_trigger=True, weight=1.0, timeout=timeout)
        deadline = t0 + timeout + 5
        while self.ctrl.stage != AveragingStage.AWAITING_TRIGGER:
            if self.ctrl.done():
                self.ctrl.result(timeout=1)  # raises the matchmaking error
                raise RuntimeError("matchmaking ended without a group")
            if time.monotonic() > deadline:
                self.ctrl.cancel()
                raise TimeoutError(f"no group within {timeout} s")
            time.sleep(0.002)
        elapsed = time.monotonic() - t0
        if elapsed >= timeout - 0.5:
            # hivemind moves to AWAITING_TRIGGER even when its matchmaking timed out without a group
            self.abort()
            raise TimeoutError(f"no group within {timeout} s (hivemind matchmaking timed out)")
        return {"matchmaking_seconds": elapsed}

    def abort(self) -> dict:
        """Cancel a step that found its group but will not be triggered (another peer failed)."""
        ctrl, self.ctrl = self.ctrl, None
        if ctrl is not None and not ctrl.done():
            ctrl.cancel()
            try:
                ctrl.result(timeout=10)
            except BaseException:  # cancelled or failed: either way this step is over
                pass
        return {}

    def go(self, rnd: int, at: float) -> dict:
        ctrl, self.ctrl = self.ctrl, None
        wait_until(at)
        t0 = time.monotonic()
        ctrl.allow_allreduce()
        gathered = ctrl.result(timeout=self.cfg["timeout"])
        seconds = time.monotonic() - t0
        if gathered is None:
            raise RuntimeError("averager.step returned None (round failed)")
        return {"seconds": seconds, "start_lag": t0 - at, "members": len(gathered)}

    def check(self) -> dict:
        with self.averager.get_tensors() as tensors:
            return {"rel_error": rel_error(tensors, self.reference)}

    def reset(self) -> None:
        with self.averager.get_tensors() as tensors:
            for t, o in zip(tensors, self.original):
                t.copy_(o)

    def average_round(self, msg: dict) -> tuple[dict, list]:
        """One `step()` as hivemind's benchmark runs it (matchmaking, then all-reduce, retried
        within its matchmaking timeout), cancelled at the round's deadline."""
        from hivemind.averaging.control import AveragingStage

        wait_until(msg["at"])
        t0 = time.monotonic()
        ctrl = self.averager.step(wait=False, weight=1.0, timeout=self.cfg["hivemind_matchmaking_timeout"])
        deadline, matched = t0 + msg["timeout"], None
        while not ctrl.done():
            if matched is None and ctrl.stage == AveragingStage.RUNNING_ALLREDUCE:
                matched = time.monotonic() - t0
            if time.monotonic() > deadline:
                ctrl.cancel()
                try:
                    ctrl.result(timeout=10)
                except BaseException:  # cancelled or failed: either way this step is over
                    pass
                raise TimeoutError(f"no result within {msg['timeout']:.0f} s")
            time.sleep(0.005)
        gathered = ctrl.result(timeout=1)  # raises what failed the step
        seconds = time.monotonic() - t0
        if gathered is None:
            raise RuntimeError("averager.step returned None (round failed)")
        with self.averager.get_tensors() as tensors:
            result = [t.clone() for t in tensors]
        # hivemind says which group it formed, not whose data the average holds (a sender that
        # timed out is left out of it): no "members"
        out = {"seconds": seconds, "start_lag": t0 - msg["at"], "matchmaking_seconds": matched or 0.0,
               "group": sorted(str(p) for p in gathered), "leader": _last_hivemind_leader(self.cfg.get("hivemind_leader_log"))}
        return out, result

    def close(self) -> None:
        if getattr(self, "averager", None) is not None:
            self.averager.shutdown()
        if getattr(self, "dht", None) is not None:
            self.dht.shutdown()


_LEADER_EVENTS = (" - assembled group of ", " - follower assembled group with leader ")


def _log_hivemind_leaders(path: str) -> None:
    """Append one line per group hivemind's matchmaking assembles in this process or its forks:
    the leader's peer id. hivemind tells this only in debug records ("assembled group" on the
    leader, "follower assembled group with leader X" on the others); those are caught here and
    dropped, every other record goes on as before."""
    import logging

    def catch(record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG:
            return True
        text = record.getMessage()
        if _LEADER_EVENTS[0] in text:
            leader = text.split(" - ", 1)[0]
        elif _LEADER_EVENTS[1] in text:
            leader = text.rsplit(" ", 1)[-1]
        else:
            return False
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} {leader}\n")
        return False

    logger = logging.getLogger("hivemind.averaging.matchmaking")
    logger.setLevel(logging.DEBUG)
    logger.addFilter(catch)


def _last_hivemind_leader(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path) as f:
            lines = f.read().split()
    except OSError:
        return None
    return lines[-1] if lines else None


class SwarmtrainArm(Arm):
    """Our averager (node.averaging) over our libp2p host and transport, on its own event loop thread."""

    def setup(self) -> dict:
        import asyncio

        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="swarmtrain-loop", daemon=True)
        self.thread.start()
        self.host = self.transport = self.avg = None
        return self._run(self._setup(), self.cfg["timeout"])

    def _run(self, coro, timeout: float):
        import asyncio
        import concurrent.futures

        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no result within {timeout:.0f} s") from None

    async def _setup(self) -> dict:
        from node.averaging import Averager, AveragerConfig
        from node.net.host import Host, HostConfig
        from node.net.transport import Transport, TransportConfig
        from protocol import SigningKey

        ip = self.cfg["ip"]
        self.host = await Host.start(
            SigningKey.generate(),
            HostConfig(
                initial_peers=tuple(self.cfg.get("initial_peers") or ()), host_maddrs=(f"/ip4/{ip}/tcp/0",), security=self.cfg.get("security", "tls")
            ),
        )
        self.transport = Transport(self.host, TransportConfig(direct=self.cfg.get("direct", True)))
        await self.transport.start()
        config = AveragerConfig(codec=self.cfg["codec"], codec_params=self.cfg["codec_params"], **self.cfg["averager_opts"])
        self.avg = Averager(self.host, self.transport, config)
        await self.avg.start()
        return {"maddrs": await self.host.visible_maddrs(), "peer_id": self.host.peer_id}

    def go(self, rnd: int, at: float) -> dict:
        wait_until(at)
        cpu0, daemon0 = time.process_time(), _daemon_cpu()
        t0 = time.monotonic()
        self.result, report = self._run(self._average(rnd), self.cfg["timeout"])
        seconds = time.monotonic() - t0
        cpu = {"python": time.process_time() - cpu0, "p2pd": _daemon_cpu() - daemon0}
        failed = [[str(p)[-8:], str(r)] for p, r in (getattr(report, "failed", None) or [])]
        return {
            "seconds": seconds,
            "start_lag": t0 - at,
            "members": len(getattr(report, "members", ()) or ()),
            "bytes_sent": getattr(report, "bytes_sent", None),
            "bytes_received": getattr(report, "bytes_received", None),
            "report_seconds": getattr(report, "seconds", None),
            "matchmaking_seconds": (getattr(report, "phases", None) or {}).get("matchmaking", 0.0),
            "phases": dict(getattr(report, "phases", None) or {}),
            "cpu": cpu,
            "direct_pipes": self.transport.stats["direct_pipes"],
            "schedule": getattr(report, "schedule", ""),
            "failed": failed,
        }

    def prepare(self, rnd: int) -> dict:
        out = super().prepare(rnd)
        self._run(self._reset_feedback(), 30)
        return out

    def reset(self) -> None:
        super().reset()
        self._run(self._reset_feedback(), 30)

    def average_round(self, msg: dict) -> tuple[dict, list]:
        """One `average()`: expected peers by id where the caller knows them (as our replica
        passes them), else the count."""
        wait_until(msg["at"])
        t0 = time.monotonic()
        key = f"{self.cfg['run_id']}-{self.cfg['codec']}-round-{msg['round']}"
        expected = set(msg["expected"]) if msg.get("expected") else self.n
        coro = self.avg.average(key=key, tensors=self.work, weight=1.0, expected_peers=expected, state_key=self._state_key)
        result, report = self._run(coro, msg["timeout"])
        out = {
            "seconds": time.monotonic() - t0, "start_lag": t0 - msg["at"], "leader": report.leader,
            "group": list(report.members), "members": list(report.survivors),  # survivors: whose data the mean holds
            "matchmaking_seconds": report.phases.get("matchmaking", 0.0), "phases": dict(report.phases),
            "failed": [[str(p)[-8:], str(r)] for p, r in report.failed],
        }
        return out, result

    @property
    def _state_key(self) -> str:
        return f"{self.cfg['run_id']}-{self.cfg['codec']}"

    async def _reset_feedback(self) -> None:
        # Zeroed error feedback each round: each round averages the same data afresh and is
        # measured against its exact mean, so no residual of an earlier round may leak into it.
        # One state key, zeroed in place (untimed, like the tensors' reset): the buffers are
        # reused, as in training.
        self.avg.reset_feedback(self._state_key)

    async def _average(self, rnd: int):
        key = f"{self.cfg['run_id']}-{self.cfg['codec']}-round-{rnd}"
        return await self.avg.average(key=key, tensors=self.work, weight=1.0, expected_peers=self.n, state_key=self._state_key)

    def close(self) -> None:
        if getattr(self, "loop", None) is None:
            return
        try:
            self._run(self._close(), 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)

    async def _close(self) -> None:
        for closer in (self.avg, self.transport, self.host):
            if closer is None:
                continue
            try:
                await (closer.shutdown() if closer is self.host else closer.close())
            except Exception as e:  # keep closing the rest; the parent sweeps the session anyway
                print(f"close {type(closer).__name__}: {e!r}", file=sys.stderr)


ARMS = {"gloo": GlooArm, "hivemind": HivemindArm, "swarmtrain": SwarmtrainArm}


# ---------------------------------------------------------------------------- command loop


def main() -> None:
    if os.environ.get("STB_ALLOCATOR", "keep") == "keep":
        from node.osutil import keep_freed_memory

        keep_freed_memory()  # before any thread allocates (see its docstring); every arm gets it
    # The protocol gets its own descriptors; 0 and 1 become /dev/null and stderr. Stray prints
    # from libraries land in the log, and processes forked by hivemind (whose multiprocessing
    # closes sys.stdin in the child) never touch a file object our reader thread holds locked.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    commands_fd = os.dup(0)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(os.devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    commands: list = []
    cond = threading.Condition()
    exiting = threading.Event()

    def reader() -> None:
        buf = b""
        while chunk := os.read(commands_fd, 1 << 16):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            with cond:
                commands.extend(line for line in lines if line.strip())
                cond.notify()
        if not exiting.is_set():  # the parent is gone: take the whole session down now
            kill_session(os.getpid(), exclude=os.getpid())
            os._exit(1)

    threading.Thread(target=reader, name="stdin", daemon=True).start()

    def reply(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")

    import torch  # noqa: F401  (imported before "hello", so setup times measure setup, not imports)

    if level := os.environ.get("STB_PEER_LOG"):  # e.g. STB_PEER_LOG=DEBUG: our node's logs into the peer log
        import logging

        logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
        for noisy in ("hivemind", "asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)

    arm = None
    reply({"hello": os.getpid()})
    while True:
        with cond:
            while not commands:
                cond.wait(1.0)  # the reader thread ends the process if the parent goes away
            line = commands.pop(0)
        try:
            msg = json.loads(line)
            cmd = msg["cmd"]
            if cmd == "exit":
                exiting.set()
                break
            if cmd == "setup":
                arm = ARMS[msg["impl"]](msg)
                reply({"ok": True, **arm.setup()})
            elif cmd == "prepare":
                reply({"ok": True, **arm.prepare(msg["round"])})
            elif cmd == "abort":
                reply({"ok": True, **(arm.abort() if arm else {})})
            elif cmd == "go":
                reply({"ok": True, **arm.go(msg["round"], msg["at"])})
            elif cmd == "check":
                reply({"ok": True, **arm.check()})
            elif cmd == "round":
                reply({"ok": True, **arm.fault_round(msg)})
            else:
                reply({"error": f"unknown command {cmd!r}"})
        except Exception as e:
            traceback.print_exc()
            text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
            if (report := getattr(e, "report", None)) is not None:  # our AveragingFailed: when and where it failed
                text += f" (after {getattr(report, 'seconds', 0):.2f} s; phases {getattr(report, 'phases', {})})"
            reply({"error": text})
    leftover: list[int] = []
    try:
        if arm is not None:
            arm.close()
    except Exception as e:
        traceback.print_exc()
        print(f"close failed: {e!r}", file=sys.stderr)
    finally:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            leftover = [p for p in session_pids(os.getpid()) if p != os.getpid()]
            if not leftover:
                break
            time.sleep(0.1)
        reply({"ok": True, "leftover": leftover})
        kill_session(os.getpid(), exclude=os.getpid())
        proto.flush()
        os._exit(0)


if __name__ == "__main__":
    main()

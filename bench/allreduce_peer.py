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
Here: the command loop, gloo's arm and ours; allreduce_arm.py: the tensors, their exact mean and
the arms' base; allreduce_hivemind.py: hivemind's arm.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

from bench.allreduce_arm import Arm, _daemon_cpu, wait_until
from bench.allreduce_hivemind import HivemindArm
from bench.workers import kill_session, session_pids


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


def _own_descriptors():
    """The protocol gets its own descriptors; 0 and 1 become /dev/null and stderr. Stray prints
    from libraries land in the log, and processes forked by hivemind (whose multiprocessing
    closes sys.stdin in the child) never touch a file object our reader thread holds locked.
    Returns (the reply file, the commands' descriptor)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    commands_fd = os.dup(0)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(os.devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    return proto, commands_fd


def _handle(arm: Arm | None, msg: dict) -> tuple[Arm | None, dict]:
    """One command (but "exit") -> (the arm from now on, the reply)."""
    cmd = msg["cmd"]
    if cmd == "setup":
        arm = ARMS[msg["impl"]](msg)
        return arm, {"ok": True, **arm.setup()}
    if cmd == "abort":
        return arm, {"ok": True, **(arm.abort() if arm else {})}
    calls = {"prepare": lambda: arm.prepare(msg["round"]), "go": lambda: arm.go(msg["round"], msg["at"]),
             "check": lambda: arm.check(), "round": lambda: arm.fault_round(msg)}  # fmt: skip
    if cmd not in calls:
        return arm, {"error": f"unknown command {cmd!r}"}
    return arm, {"ok": True, **calls[cmd]()}


def _error_reply(e: Exception) -> dict:
    traceback.print_exc()
    text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
    if (report := getattr(e, "report", None)) is not None:  # our AveragingFailed: when and where it failed
        text += f" (after {getattr(report, 'seconds', 0):.2f} s; phases {getattr(report, 'phases', {})})"
    return {"error": text}


def _shut_down(arm: Arm | None, reply) -> None:
    """Close the arm, tell the parent what is left of the session, take it down, exit 0."""
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
        os._exit(0)


def main() -> None:
    if os.environ.get("STB_ALLOCATOR", "keep") == "keep":
        from node.osutil import keep_freed_memory

        keep_freed_memory()  # before any thread allocates (see its docstring); every arm gets it
    proto, commands_fd = _own_descriptors()
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
        proto.flush()

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
            if msg["cmd"] == "exit":
                exiting.set()
                break
            arm, answer = _handle(arm, msg)
        except Exception as e:
            answer = _error_reply(e)
        reply(answer)
    _shut_down(arm, reply)


if __name__ == "__main__":
    main()

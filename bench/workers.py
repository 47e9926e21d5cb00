"""Benchmark peers as OS processes, commanded by the parent over JSON lines, none ever leaked.

Each peer is `python -m bench.allreduce_peer` (optionally behind `ip netns exec`), started in its
own session so a Ctrl-C in the terminal reaches only the parent, which then takes every peer down
in order. Whatever a peer starts (hivemind's DHT and averager processes, p2pd) stays in that
session, so `kill()` finds and SIGKILLs all of it, even processes that changed process group.
If the parent itself is SIGKILLed, each peer sees its stdin close and does the same to its session.

Every wait has a deadline: `recv(timeout)` raises PeerFailed with the tail of the peer's log.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from node.osutil import session_pids

ROOT = Path(__file__).resolve().parent.parent


class PeerFailed(Exception):
    """A peer answered with an error, died, or did not answer in time."""


class PeerRefused(PeerFailed):
    """A peer answered a command with an error; it is alive and takes further commands."""


def exit_code(rows: list[dict]) -> int:
    """A benchmark's exit status: 0 if every row ran or was skipped (with its reason), else 1."""
    return 0 if all(r.get("status") in ("ok", "skipped") for r in rows) else 1


def clean_up(topo, log_dir: Path, keep_logs: bool) -> None:
    """A benchmark's last step, whatever happened: its network namespaces (`topo`, or None)
    and, unless kept, its peers' logs. A second Ctrl-C or a SIGTERM must not stop it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if topo:
        topo.destroy()
    if not keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)


def kill_session(sid: int, exclude: int | None = None) -> None:
    for pid in session_pids(sid):
        if pid != exclude:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Worker:
    def __init__(self, name: str, argv_prefix: list[str], log_dir: Path, env: dict[str, str]):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self._queue: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(
            [*argv_prefix, sys.executable, "-m", "bench.allreduce_peer"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        threading.Thread(target=self._read, name=f"read-{name}", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self._queue.put(json.loads(line))
            except ValueError:
                self._queue.put({"error": f"unreadable line from peer: {line[:200]!r}"})
        self._queue.put(None)  # EOF: the peer exited

    def send(self, msg: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise PeerFailed(f"{self.name} is gone ({self.proc.poll()}): {self.log_tail()}") from None

    def recv(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self._queue.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                break
            except queue.Empty:
                # its children (hivemind's forks) may hold our pipe open after it died: poll as well
                if self.proc.poll() is not None:
                    try:  # its last words may still be in the pipe
                        msg = self._queue.get(timeout=1.0)
                    except queue.Empty:
                        msg = None
                    break
                if time.monotonic() >= deadline:
                    raise PeerFailed(f"{self.name} did not answer within {timeout:.0f} s: {self.log_tail()}") from None
        if msg is None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            raise PeerFailed(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
        if "error" in msg:
            raise PeerRefused(f"{self.name}: {msg['error']}")
        return msg

    def has_answer(self) -> bool:
        """Whether an answer (or the end of the peer's output) is waiting: `recv` returns at once."""
        return not self._queue.empty()

    def log_tail(self, lines: int = 6) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip()[:300] for line in text[-lines:])

    def kill(self) -> None:
        """SIGKILL the peer and everything in its session; reap it."""
        kill_session(self.proc.pid)
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self._log.close()


class Group:
    """N workers; `call_all` sends one message to each and collects every answer by a deadline."""

    def __init__(self, workers: list[Worker]):
        self.workers = workers

    @classmethod
    def start(cls, n: int, log_dir: Path, wrap=None, label: str = "peer") -> Group:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        workers = []
        try:
            for i in range(n):
                prefix = wrap(i, []) if wrap else []
                workers.append(Worker(f"{label}{i}", prefix, log_dir, env))
        except BaseException:
            for w in workers:
                w.kill()
            raise
        return cls(workers)

    def call(self, i: int, msg: dict, timeout: float) -> dict:
        self.workers[i].send(msg)
        return self.workers[i].recv(timeout)

    def call_all(self, msgs: list[dict], timeout: float, indices: list[int] | None = None) -> list[dict]:
        indices = list(range(len(self.workers))) if indices is None else indices
        for i, msg in zip(indices, msgs):
            self.workers[i].send(msg)
        deadline = time.monotonic() + timeout
        return [self.workers[i].recv(max(0.1, deadline - time.monotonic())) for i in indices]

    def gather_all(self, msgs: list[dict], timeout: float) -> list[dict | PeerRefused]:
        """Like call_all, but a peer's error answer is returned in its place (after every answer is in).

        A peer that dies or misses the deadline still raises PeerFailed.
        """
        for w, msg in zip(self.workers, msgs):
            w.send(msg)
        deadline = time.monotonic() + timeout
        out: list[dict | PeerRefused] = []
        for w in self.workers:
            try:
                out.append(w.recv(max(0.1, deadline - time.monotonic())))
            except PeerRefused as e:
                out.append(e)
        return out

    def close(self, timeout: float = 20.0) -> list[str]:
        """Ask every peer to exit, then kill whatever is left; return the names that had to be killed."""
        for w in self.workers:
            try:
                w.send({"cmd": "exit"})
            except PeerFailed:
                pass
        deadline = time.monotonic() + timeout
        killed = []
        for w in self.workers:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed.append(w.name)
            if session_pids(w.proc.pid):
                killed.append(w.name)
            w.kill()
        return sorted(set(killed))

    def kill(self) -> None:
        for w in self.workers:
            w.kill()

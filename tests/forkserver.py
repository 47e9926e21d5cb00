"""Daemons forked from one process that imported their modules once: the swarm tests' launcher.

Every daemon imports torch, hivemind and its own modules: about 3 s of one core each, and a
suite starts a few hundred of them on two cores. The fork server (`python -m tests.forkserver`)
imports them once, then forks each daemon from itself; the child takes its own session, log,
environment, working directory and argv, and runs the console script's `main`, as the script
would. The server stays single-threaded (no lock can be held across a fork) and reaps its
children, reporting each exit status to the launcher, so `Forked` answers like `Popen`.

Used by tests/swarm.py where `STB_FORK_DAEMONS=1` (tests/conftest.py sets it, so the benches the
smoke tests start use it too). A daemon that runs in a network namespace (`ip netns exec NS`)
enters it itself, after the fork (setns: what `ip netns exec` does for a daemon's sockets).

Protocol, one JSON object per line: launcher -> server `{"script", "args", "env", "cwd",
"log", "netns"}`; server -> launcher `{"pid"}` or `{"error"}` in answer, and `{"exited", "code"}`
whenever a child ends (code as `Popen.returncode`: negative for a signal).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import traceback
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRELOAD = (
    *("torch", "hivemind", "node.cli", "node.daemon", "node.roles.registry", "coordinator.cli", "coordinator.service"),
    # the Hugging Face models the tests build (3 s more, once)
    *("transformers", "tokenizers", "safetensors", "transformers.masking_utils", "transformers.models.auto.modeling_auto"),
    *(f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "llama", "mixtral")),
)


# -- the server --


def _enter_netns(name: str) -> None:
    import ctypes

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def _above_2(fd: int) -> int:
    """`fd`, or (in place of a standard descriptor, which dup2 replaces anyway) a copy above 2."""
    return fd if fd > 2 else fcntl.fcntl(fd, fcntl.F_DUPFD, 3)


def _entry(script: str):
    (ep,) = entry_points(group="console_scripts", name=script)
    return ep.load()


def _run_child(req: dict, server_fds: list[int]) -> None:
    """In the forked child: become the daemon `req` names, and never return."""
    code = 1
    try:
        os.setsid()
        # (above 2 before they are put there: opened into a standard descriptor the server had
        # closed, one would be closed again below, and the daemon's output would go to whatever
        # file it opened next)
        null = _above_2(os.open(os.devnull, os.O_RDONLY))
        log = _above_2(os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        os.dup2(null, 0)  # in place of the server's pipes
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (null, log, *server_fds):
            os.close(fd)
        if req.get("netns"):
            _enter_netns(req["netns"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = [req["script"], *req["args"]]
        main = _entry(Path(req["script"]).name)
        try:
            code = main()
        except SystemExit as e:
            code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        threading._shutdown()  # as the interpreter's own exit: non-daemon threads, then atexit
        atexit._run_exitfuncs()
    except KeyboardInterrupt:
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code if isinstance(code, int) else 1)


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    out = sys.stdout.buffer
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    children: dict[int, int] = {}  # pidfd -> pid
    pending = b""

    def send(msg: dict) -> None:
        out.write(json.dumps(msg).encode() + b"\n")
        out.flush()

    while True:
        for key, _ in sel.select():
            if key.fd != 0:
                pid = children.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            data = os.read(0, 1 << 16)
            if not data:  # the launcher is gone: so is the server (its children live on)
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as e:
                    send({"error": str(e)})
                    continue
                if pid == 0:
                    _run_child(req, [sel.fileno(), *children])
                pidfd = os.pidfd_open(pid)
                children[pidfd] = pid
                sel.register(pidfd, selectors.EVENT_READ)
                send({"pid": pid})


# -- the launcher, in the test's process --


class Forked:
    """A forked daemon, answering as much of `subprocess.Popen` as the swarm harness uses."""

    def __init__(self, server: ForkServer, pid: int):
        self._server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"forked daemon {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not a pid the kernel may have given to another process
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One server per launching process, started on first use and ended with it."""

    _instance: ForkServer | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> ForkServer:
        with cls._instance_lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls()
                atexit.register(cls._instance.close)
            return cls._instance

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._cond = threading.Condition()
        self._answers: list[dict] = []
        self._codes: dict[int, int] = {}
        self._spawn_lock = threading.Lock()
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "exited" in msg:
                    self._codes[msg["exited"]] = msg["code"]
                else:
                    self._answers.append(msg)
                self._cond.notify_all()
        with self._cond:
            self._answers.append({"error": f"the fork server exited ({self.proc.wait()})"})
            self._cond.notify_all()

    def spawn(self, args: list[str], env: dict, cwd: Path, log: Path, netns: str | None = None) -> Forked:
        req = {"script": args[0], "args": args[1:], "env": env, "cwd": str(cwd), "log": str(log), "netns": netns}
        with self._spawn_lock:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            with self._cond:
                self._cond.wait_for(lambda: self._answers)
                answer = self._answers.pop(0)
        if "error" in answer:
            raise OSError(f"the fork server could not start {args[0]}: {answer['error']}")
        return Forked(self, answer["pid"])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._codes, timeout)
            return self._codes.get(pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def forks_daemons() -> bool:
    return os.environ.get("STB_FORK_DAEMONS") == "1"


def server_pids() -> set[int]:
    """The fork server of this process, if one runs (the orphan check does not count it)."""
    s = ForkServer._instance
    return {s.proc.pid} if s is not None and s.proc.poll() is None else set()


if __name__ == "__main__":
    serve()

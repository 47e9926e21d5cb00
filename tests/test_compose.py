"""The container image and docker/docker-compose.yml, for real: build the image, bring up a
private swarm (coordinator + 2 nodes holding a join token) under a unique project name, wait for
both nodes to be listed with roles on the coordinator's published /status, restart the
coordinator and check it comes back with the same peer id and members, then tear everything down
and check nothing of the project is left.

Uses whichever of `docker compose`, `docker-compose`, `podman-compose` is installed and whose
engine answers; skips, saying why, when there is none. The machine is prepared outside the test
(CI's .ci/run runs ../shared/tools/container-host.sh where it exists). pip's certificate bundle
and find-links (env or `pip config`) are passed to the build, mounted read-only, as the
Dockerfile's PIP_CERT / PIP_FIND_LINKS build args.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.swarm import wait_for

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker" / "docker-compose.yml"
IMAGE = "swarmtrain:compose-test"  # kept after the test: the layer cache makes the next build seconds
NODES = 2
BUILD_TIMEOUT_S = 600  # cold: ~1-2 min on an idle machine (torch is the bulk); cached: seconds
UP_TIMEOUT_S = 180  # podman-compose can wait forever on a container that failed to start
MEMBERS_TIMEOUT_S = 300  # coordinator start (imports torch) + node start + registration
# Once training runs by default in the image, set this: the test then also requires the swarm's
# progress to advance (it already checks that whenever the status shows training has started).
REQUIRE_TRAINING = True
PROGRESS_TIMEOUT_S = 240
# a short run: both replicas start together, outer steps come quickly
TRAINING_ARGS = "--model tiny --inner-steps 5 --min-replicas 2 --warmup-steps 5 --checkpoint-every 2"


@dataclass(frozen=True)
class Compose:
    cmd: tuple[str, ...]  # e.g. ("podman-compose",) or ("docker", "compose")
    engine: str  # "podman" or "docker": builds the image and lists leftovers


def _run(args, timeout: float, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-3000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-3000:]
        raise AssertionError(f"`{shlex.join(args)}` still running after {timeout:.0f} s:\n{out}") from None
    if check and r.returncode != 0:
        raise AssertionError(f"`{shlex.join(args)}` exited {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}")
    return r


def _first_line(r: subprocess.CompletedProcess) -> str:
    """What a failed command said, in one line (its first: the last is often a hint to run --help)."""
    lines = [x.strip() for x in (r.stderr or r.stdout or "").splitlines() if x.strip()]
    return lines[0] if lines else f"exit status {r.returncode}"


def find_compose() -> Compose | str:
    """The first compose tool that is installed and whose engine answers, or what is missing
    for each, in one line."""
    candidates = [Compose(("docker", "compose"), "docker"), Compose(("docker-compose",), "docker"), Compose(("podman-compose",), "podman")]
    reasons = []
    for c in candidates:
        name = " ".join(c.cmd)
        if not shutil.which(c.cmd[0]):
            reasons.append(f"{name}: not found")
            continue
        if not shutil.which(c.engine):
            reasons.append(f"{name}: no `{c.engine}` engine binary")
            continue
        try:
            version = subprocess.run([*c.cmd, "version"], capture_output=True, text=True, timeout=60)
            info = subprocess.run([c.engine, "info"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            reasons.append(f"{name}: {e}")
            continue
        problems = []
        if version.returncode != 0:
            problems.append(f"`{name} version` fails ({_first_line(version)})")
        if info.returncode != 0:
            problems.append(f"the {c.engine} engine does not answer ({_first_line(info)})")
        if not problems:
            return c
        reasons.append(f"{name}: {' and '.join(problems)}")
    return "; ".join(reasons)


def pip_settings() -> dict[str, str]:
    """PIP_CERT and PIP_FIND_LINKS as pip would see them: env first, then `pip config`."""
    found = {}
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if sep and name in ("cert", "find-links"):
            found.setdefault("PIP_" + name.upper().replace("-", "_"), value.strip().strip("'\""))
    for var in ("PIP_CERT", "PIP_FIND_LINKS"):
        if os.environ.get(var):
            found[var] = os.environ[var]
    return found


def build_args(engine: str) -> list[str]:
    """--build-arg for pip's settings; podman also mounts the local paths they name (docker build
    cannot mount, so there only settings that are not local paths are passed on)."""
    args = []
    for var, value in pip_settings().items():
        paths = [p for p in value.split() if "://" not in p and os.path.exists(p)]
        if paths and engine != "podman":
            continue
        for p in paths:
            args += ["-v", f"{p}:{p}:ro"]
        args += ["--build-arg", f"{var}={value}"]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))  # published ports listen on all interfaces
        return s.getsockname()[1]


def get_status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
        return json.loads(r.read())


def members_with_roles(status: dict) -> list[dict]:
    return [m for m in status["members"] if m.get("role")]


def swarm_step(status: dict) -> int:
    """The highest outer step the swarm reports (members' heartbeats and the progress history)."""
    steps = [m.get("step") or 0 for m in status["members"]] + [p.get("step") or 0 for p in status.get("progress") or []]
    return max(steps, default=0)


def training_started(status: dict) -> bool:
    """Replicas report a loss (a progress point) from their first evaluation on."""
    return swarm_step(status) > 0 or bool(status.get("progress"))


def wait_for_progress(port: int, since: dict, timeout: float) -> dict:
    """Wait until the swarm's step passes the one in `since` (progress points alone do not count:
    every heartbeat that carries a loss adds one, even at the same step)."""
    step = swarm_step(since)

    def advanced():
        s = get_status(port)
        return s if swarm_step(s) > step else None

    return wait_for(advanced, timeout, f"the swarm's step to pass {step}", interval=2)


def leftovers(engine: str, project: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    left = {}
    for kind, cmd in (
        ("containers", [engine, "ps", "-a", "-q", "--filter", label]),
        ("volumes", [engine, "volume", "ls", "-q", "--filter", label]),
        ("networks", [engine, "network", "ls", "-q", "--filter", label]),
    ):
        out = _run(cmd, 60, check=False).stdout.split()
        if out:
            left[kind] = out
    return left


def remove_leftovers(engine: str, left: dict[str, list[str]]) -> None:
    if left.get("containers"):
        _run([engine, "rm", "-f", *left["containers"]], 120, check=False)
    if left.get("volumes"):
        _run([engine, "volume", "rm", "-f", *left["volumes"]], 60, check=False)
    if left.get("networks"):
        _run([engine, "network", "rm", *left["networks"]], 60, check=False)


def check_coordinator_restart(base, env, status, members, swarm_id, status_now, logs, timings) -> None:
    """The coordinator restarts with the same identity and registry (its volume), the nodes stay."""
    t0 = time.monotonic()
    _run([*base, "restart", "coordinator"], 120, env=env)
    try:
        again = wait_for(lambda: (s := status_now()) and s["started_at"] != status["started_at"] and s, 180, "the restarted coordinator's /status", interval=2)
    except TimeoutError as e:
        raise AssertionError(f"{e}\n--- logs ---\n{logs()}") from None
    timings["coordinator restart"] = time.monotonic() - t0
    assert again["peer_id"] == status["peer_id"] == swarm_id.split("@")[1]  # the owner's key, from init, in the volume
    assert {m["peer_id"] for m in again["members"]} >= {m["peer_id"] for m in members}
    # checkpoints survive too (the newest one, or a newer one if the swarm stored another since)
    newest = lambda st: max((c["step"] for c in st["checkpoints"]), default=-1)  # noqa: E731
    assert newest(again) >= newest(status), (again["checkpoints"], status["checkpoints"])


def compose_down(compose, base, env, project, timings) -> tuple[str, dict]:
    """`down -v`, then whatever the project's label still finds removed: (what down said if it
    failed, what was left behind)."""
    t0 = time.monotonic()
    try:
        down = subprocess.run([*base, "down", "-v", "-t", "20"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        down_error = "" if down.returncode == 0 else (down.stdout + down.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        down_error = "`down -v` still running after 300 s"
    timings["down"] = time.monotonic() - t0
    left = leftovers(compose.engine, project)
    remove_leftovers(compose.engine, left)
    return down_error, left


def test_compose_private_swarm():
    compose = find_compose()
    if isinstance(compose, str):
        pytest.skip(
            "needs a container engine with compose (podman and podman-compose: run ../shared/tools/container-host.sh "
            f"as root, as .ci/run does; or docker with its compose plugin) for the compose swarm: {compose}"
        )
    timings = {}

    t0 = time.monotonic()
    _run([compose.engine, "build", "--network", "host", *build_args(compose.engine), "-f", "docker/Dockerfile", "-t", IMAGE, "."], BUILD_TIMEOUT_S)
    timings["build"] = time.monotonic() - t0

    project = f"swarmtrain-test-{os.getpid()}-{secrets.token_hex(3)}"
    http_port = free_port()
    env = {**os.environ, "SWARMTRAIN_IMAGE": IMAGE, "COORDINATOR_HTTP_PORT": str(http_port), "NODE_ARGS": ""}
    base = [*compose.cmd, "-f", str(COMPOSE_FILE), "-p", project]
    # as docker/README.md says: the owner key in the coordinator's volume, a token, from the CLI
    tool = [*base, "run", "--rm", "--no-deps", "--entrypoint", "swarmtrain-coordinator", "coordinator"]
    init = _run([*tool, "init", "--data-dir", "/data", "--name", "compose"], 300, env=env).stdout
    swarm_id = next(line.split(": ", 1)[1].strip() for line in init.splitlines() if line.startswith("swarm id: "))
    token = _run([*tool, "token", "--data-dir", "/data", "--swarm-id", swarm_id, "--expires-in", "1h"], 300, env=env).stdout.strip().splitlines()[-1]
    env.update(SWARMTRAIN_SWARM_ID=swarm_id, SWARMTRAIN_TOKEN=token, COORDINATOR_ARGS=f"{TRAINING_ARGS} --private")

    def logs() -> str:
        try:
            r = subprocess.run([*base, "logs"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"(no logs: {e})"
        lines = [x for x in (r.stdout + r.stderr).splitlines() if "systemd" not in x]  # podman's healthcheck-timer noise
        return "\n".join(lines[-80:])

    def status_now():
        try:
            return get_status(http_port)
        except (urllib.error.URLError, ConnectionError, OSError, ValueError):
            return None

    try:
        t0 = time.monotonic()
        _run([*base, "up", "-d", "--no-build", "--scale", f"node={NODES}"], UP_TIMEOUT_S, env=env)
        timings["up"] = time.monotonic() - t0
        assert leftovers(compose.engine, project).get("containers"), "the project's label does not find its containers"

        def members_ready():
            s = status_now()
            return s if s and len(members_with_roles(s)) == NODES else None

        try:
            status = wait_for(members_ready, MEMBERS_TIMEOUT_S, f"{NODES} nodes listed with roles", interval=2)
        except TimeoutError as e:
            raise AssertionError(f"{e}\nlast status: {status_now()}\n--- logs ---\n{logs()}") from None
        timings["2 members (since up)"] = time.monotonic() - t0
        members = members_with_roles(status)
        assert len({m["peer_id"] for m in members}) == NODES
        for m in members:
            # each node announced its container address, not loopback: peers can dial it
            assert m["maddrs"] and all(a.startswith("/ip4/") and not a.startswith("/ip4/127.") for a in m["maddrs"]), m
        assert any(a.startswith("/dns4/") for a in status["maddrs"]), status["maddrs"]

        if REQUIRE_TRAINING or training_started(status):
            try:
                if not training_started(status):
                    status = wait_for(lambda: (s := status_now()) and training_started(s) and s, PROGRESS_TIMEOUT_S, "training to start", interval=2)
                status = wait_for_progress(http_port, status, PROGRESS_TIMEOUT_S)
            except TimeoutError as e:
                raise AssertionError(f"{e}\n--- logs ---\n{logs()}") from None
            timings["progress advanced (since up)"] = time.monotonic() - t0
            print(f"compose swarm at step {swarm_step(status)}; last progress: {(status.get('progress') or [None])[-1]}")

        check_coordinator_restart(base, env, status, members, swarm_id, status_now, logs, timings)
    finally:
        down_error, left = compose_down(compose, base, env, project, timings)
        print("compose timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    assert not down_error, down_error
    assert not left, f"`down -v` left these behind (removed now): {left}"

"""Test-wide fixtures: no test may leave a process behind; the slow modules run first."""

import os

import psutil
import pytest

from tests.forkserver import server_pids
from tests.swarm import Swarm

# daemons forked from one process that imported torch and hivemind once (tests/forkserver.py);
# STB_FORK_DAEMONS=0 starts each as a new interpreter, as its console script would
os.environ.setdefault("STB_FORK_DAEMONS", "1")


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _slow(item: pytest.Item) -> bool:
    """Modules that start real processes (swarms, benchmarks, compose) take most of the suite."""
    return bool(item.get_closest_marker("swarm") or item.get_closest_marker("compose")) or item.module.__name__.startswith("tests.test_bench_")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow modules first (in file order; the rest after them, in file order): on several
    workers (the Makefile's TEST_WORKERS: pytest-xdist, --dist loadfile, no reordering) each
    takes the next module when it is free, so the last to finish is a short one."""
    items.sort(key=lambda item: not _slow(item))


@pytest.fixture(autouse=True)
def no_orphan_processes():
    """Fail a test that leaves child processes running, and kill them so later tests are clean."""
    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children(recursive=True)}
    yield
    # torch_shm_manager is torch's own helper for sharing tensors between processes; torch
    # starts it once per process and it lives as long as the process that uses it.
    spared = before | server_pids()
    leftover = [p for p in me.children(recursive=True) if p.pid not in spared and _name(p) != "torch_shm_manager"]
    if not leftover:
        return
    _, alive = psutil.wait_procs(leftover, timeout=5)  # processes being shut down get a moment
    names = []
    for p in alive:
        try:
            names.append(f"{p.pid}:{p.name()}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    if names:
        pytest.fail(f"test left processes running: {', '.join(names)}")


@pytest.fixture
def swarm(tmp_path):
    """Daemons started from their console scripts (see tests/swarm.py); whatever is left of
    them is killed afterwards, and a daemon whose children outlived it fails the test."""
    s = Swarm(tmp_path)
    yield s
    orphans = s.close()
    assert not orphans, orphans


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models in this process: a second torch thread only waits on a busy 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

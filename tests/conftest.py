"""Test-wide fixtures: no test may leave a process behind."""

import os

import psutil
import pytest


@pytest.fixture(autouse=True)
def no_orphan_processes():
    """Fail a test that leaves child processes running, and kill them so later tests are clean."""
    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children(recursive=True)}
    yield
    leftover = [p for p in me.children(recursive=True) if p.pid not in before]
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

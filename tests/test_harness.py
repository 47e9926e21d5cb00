"""The swarm harness itself, and what a crash leaves: a daemon that crashes ends a wait at once,
naming it, its log holding every thread's stack."""

import os
import signal
import sys

import pytest

from tests.swarm import ProcessExited, wait_for

pytestmark = pytest.mark.timeout(60)  # far under the first test's wait: the crash must end it

CRASH = "import faulthandler, os, signal, time; faulthandler.enable(); time.sleep(0.2); os.kill(os.getpid(), signal.SIGSEGV)"


def test_a_crashed_daemon_ends_a_wait_at_once_with_its_log(swarm):
    swarm.start("crasher", sys.executable, "-c", CRASH)
    with pytest.raises(ProcessExited, match=r"crasher crashed \(SIGSEGV\)[\s\S]*Fatal Python error: Segmentation fault"):
        wait_for(lambda: False, 600, "something that never comes")


def test_a_daemon_a_test_killed_does_not_end_a_wait(swarm):
    p = swarm.start("sleeper", sys.executable, "-c", "import time; time.sleep(60)")
    p.kill()
    assert wait_for(lambda: "ok", 5, "a value") == "ok"


def test_a_daemon_that_crashes_leaves_every_threads_stack_in_its_log(swarm):
    coord = swarm.coordinator()
    coord.wait_ready()
    os.kill(coord.proc.popen.pid, signal.SIGSEGV)  # as a fault in native code would
    with pytest.raises(ProcessExited, match=r"coordinator crashed \(SIGSEGV\)[\s\S]*Fatal Python error: Segmentation fault[\s\S]*in run_daemon"):
        wait_for(lambda: False, 600, "something that never comes")

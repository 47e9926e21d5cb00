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


def test_a_forked_daemon_runs_its_script_in_a_session_of_its_own_and_its_exit_code_comes_back(swarm):
    """tests/forkserver.py: the daemon the fork server starts has the script's argv, the test's
    environment with the extra variables, a session and a log of its own; its exit code and a
    signal that ended it come back as a Popen's would."""
    from tests.forkserver import Forked, forks_daemons

    assert forks_daemons()  # (tests/conftest.py)
    bad = swarm.start("bad-flag", "swarmtrain-node", "--no-such-flag")
    assert isinstance(bad.popen, Forked) and bad.wait(30) == 2
    assert "swarmtrain-node: error: unrecognized arguments: --no-such-flag" in bad.log()
    bad_env = swarm.start("bad-env", "swarmtrain-node", "--initial-peers", "/ip4/127.0.0.1/tcp/1", env={"SWARMTRAIN_THREADS": "-3"})
    assert bad_env.wait(30) == 2 and "SWARMTRAIN_THREADS" in bad_env.log(), bad_env.log()
    coord = swarm.coordinator()
    coord.wait_ready()
    pid = coord.proc.popen.pid
    assert os.getsid(pid) == pid != os.getsid(0)
    assert f"--data-dir\0{swarm.tmp / 'coordinator'}".encode() not in open(f"/proc/{pid}/cmdline", "rb").read()  # a fork, not an exec
    coord.proc.terminate()
    assert coord.proc.wait(30) == 0 and "stopping" in coord.proc.log()
    killed = swarm.coordinator("killed")
    killed.wait_ready()
    killed.proc.kill()
    assert killed.proc.popen.returncode == -signal.SIGKILL

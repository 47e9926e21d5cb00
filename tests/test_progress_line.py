"""The progress line (node/progress_line.py) against a real pseudo-terminal and a real pipe: on a
terminal one line redrawn in place (carriage returns), log records written above it whole; on a
pipe, no carriage return, and a plain log line every PLAIN_EVERY_S of a replica's inner phase.
Time is moved by hand."""

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios

import pytest

from node.activity import Activity
from node.progress_line import describe
from tests.swarm import ROOT

pytestmark = pytest.mark.timeout(60)

# a replica's inner phase of 50 steps, one step per second of its clock; a log record at step 16
CHILD = """
import logging
from node.activity import Activity
from node.cli import setup_logging
from node.progress_line import ProgressLine

setup_logging("INFO")
now = [0.0]
activity = Activity(clock=lambda: now[0])
line = ProgressLine(activity)
activity.begin("replica")
activity.inner_phase(4, 50)
with line.logging():
    for i in range(30):
        now[0] += 1.0
        activity.trained(8, 8 * 64, 1.0, 4.0 - i / 100)
        line.tick()
        if i == 15:
            logging.getLogger("swarmtrain").info("a log record")
line.close()
"""


def _child(stderr) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT, env=env)


def test_on_a_terminal_the_line_is_redrawn_in_place_and_log_records_go_above_it():
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal 120 columns wide
    child = _child(slave)
    os.close(slave)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 30)
            assert ready, "the child stopped writing without exiting"
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # (EIO: the child closed the terminal)
                break
            if not data:
                break
            out += data
    finally:
        os.close(master)
        assert child.wait(30) == 0, out.decode(errors="replace")
    text = out.decode()
    assert text.count("\r") >= 30, text  # redrawn in place, once per tick
    assert "replica | outer step 4: inner 30/50 | loss 3.7100 | 8.0 samples/s | 512 tok/s | outer step in 20 s" in text, text
    assert "swarmtrain.progress" not in text  # no plain progress lines on a terminal
    records = [seg for seg in text.replace("\r", "\n").split("\n") if "a log record" in seg]
    assert len(records) == 1 and records[0].rstrip().endswith("INFO swarmtrain: a log record"), records


def test_on_a_pipe_there_are_plain_log_lines_every_ten_seconds_of_an_inner_phase():
    child = _child(subprocess.PIPE)
    _, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    text = err.decode()
    assert "\r" not in text
    lines = [line for line in text.splitlines() if "swarmtrain.progress" in line]
    assert [line.split("swarmtrain.progress: ", 1)[1] for line in lines] == [
        "replica | outer step 4: inner 10/50 | loss 3.9100 | 8.0 samples/s | 512 tok/s | outer step in 40 s",
        "replica | outer step 4: inner 20/50 | loss 3.8100 | 8.0 samples/s | 512 tok/s | outer step in 30 s",
        "replica | outer step 4: inner 30/50 | loss 3.7100 | 8.0 samples/s | 512 tok/s | outer step in 20 s",
    ], text
    assert sum("INFO swarmtrain: a log record" in line for line in text.splitlines()) == 1


def test_the_line_names_each_role_by_its_work_and_says_nothing_before_a_role_works():
    now = [0.0]
    a = Activity(clock=lambda: now[0])
    assert describe(a, 0.0) is None
    a.begin("trainer")
    assert describe(a, 0.0) is None  # a role, no work yet
    in_flight = [3]
    a.queues["micro_batches_in_flight"] = lambda: in_flight[0]
    for _ in range(3):
        now[0] += 0.5
        a.trained(4, 4 * 32, 0.5, 2.5)
    assert describe(a, now[0]) == "trainer | 3 micro-batches | loss 2.5000 | 8.0 samples/s | 256 tok/s | 3 micro batches in flight"
    a.begin("stage:1")  # a new role: its own work only
    a.trained(16, seconds=0.1)
    assert describe(a, now[0]) == "stage:1 | 4 batches"

"""A command's children end with it: the demo's `reinforge ...` children, killed or stopped.

Real processes: a parent runs `reinforge log show FIFO` through the demo's own helper (the
child blocks opening a FIFO nobody writes, like an evaluation that would run for minutes),
then the parent is killed.
"""

import os
import signal
import subprocess
import sys
import time

import psutil

PARENT = """
import sys
from pathlib import Path
from reinforge.cli.demo import reinforge
from reinforge.core.children import exit_on_sigterm

exit_on_sigterm()
try:
    reinforge("log", "show", sys.argv[1], capture=True)
finally:
    Path(sys.argv[2]).write_text("cleaned up")
"""


def start_parent(tmp_path):
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    parent = subprocess.Popen([sys.executable, "-P", "-c", PARENT, str(fifo),
                               str(tmp_path / "marker")])
    deadline = time.monotonic() + 60  # the child's start: an import of reinforge
    while time.monotonic() < deadline:
        kids = psutil.Process(parent.pid).children()
        if kids and "show" in kids[0].cmdline():
            return parent, kids[0]
        assert parent.poll() is None, "the parent ended before its child started"
        time.sleep(0.1)
    raise AssertionError("the child `reinforge log show` did not start")


def test_a_child_of_the_demo_ends_when_the_demo_is_killed(tmp_path):
    parent, child = start_parent(tmp_path)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    gone, alive = psutil.wait_procs([child], timeout=20)
    assert alive == [], "the child outlived its killed parent"
    assert not (tmp_path / "marker").exists()  # kill -9: no clean-up ran, yet the child ended


def test_sigterm_runs_the_demos_clean_up_and_stops_its_child(tmp_path):
    parent, child = start_parent(tmp_path)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=20) == 128 + signal.SIGTERM
    assert (tmp_path / "marker").read_text() == "cleaned up"
    gone, alive = psutil.wait_procs([child], timeout=20)
    assert alive == []

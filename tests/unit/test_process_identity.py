"""A registration's process identity tells a process that ended (or whose PID was reused) from one that
runs, and never claims to know about a process it cannot see."""

import os
import subprocess
import sys
import time
from pathlib import Path

from tidal.broker.process_identity import checkable, is_gone, this_process


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat from field 3, the state, on."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _identity_of(proc: subprocess.Popen) -> dict:
    return {**this_process(), "pid": proc.pid, "start": int(_stat(proc.pid)[19])}


def test_this_process_is_described_and_not_gone():
    me = this_process()
    assert me["pid"] == os.getpid() and me["pid_ns"].startswith("pid:[")
    assert checkable(me) and not is_gone(me)


def test_a_process_that_ended_is_gone_whether_reaped_or_a_zombie():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    identity = _identity_of(proc)
    assert not is_gone(identity)
    proc.stdin.close()
    deadline = time.monotonic() + 10
    while _stat(proc.pid)[0] != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)  # exited, not yet reaped: a zombie
    assert is_gone(identity)
    proc.wait()
    assert is_gone(identity)


def test_a_pid_reused_by_a_process_started_at_another_time_is_gone():
    assert is_gone({**this_process(), "start": this_process()["start"] + 1})


def test_a_process_on_another_host_or_pid_namespace_is_never_called_gone():
    ended = {**this_process(), "pid": 2**22 + 12345}  # above the kernel's pid_max: no such process
    assert is_gone(ended)
    assert not is_gone({**ended, "host": "elsewhere"})
    assert not is_gone({**ended, "pid_ns": "pid:[1]"})
    for garbage in (None, "trainer", {}, {**ended, "pid": "12"}):
        assert not checkable(garbage) and not is_gone(garbage)

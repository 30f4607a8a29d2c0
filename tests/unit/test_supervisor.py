"""`tidal run`'s supervisor. Restarts: a process allowed them is started again, except after exit code 2
(a configuration error: the same command fails again) or another of its spec's final exit codes. Stop:
SIGTERM to each process in order, its own wait before SIGKILL (the trainer saves a checkpoint first), and
an interrupt while waiting (a second Ctrl-C) kills it and the rest at once."""

import signal
import subprocess
import sys
import threading
import time

import pytest

from tidal.supervisor import ProcessDied, ProcessSpec, Supervisor

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"


def _started(tmp_path, names):
    events = []
    sup = Supervisor(on_event=events.append)
    for name in names:
        state = sup.start(ProcessSpec(name, [sys.executable, "-c", STUBBORN], tmp_path / f"{name}.log"))
        while "up" not in (tmp_path / f"{name}.log").read_text():  # its SIGTERM handler is set
            assert state.proc.poll() is None
            time.sleep(0.02)
    return sup, events


def test_each_process_gets_its_own_wait_before_sigkill(tmp_path):
    sup, events = _started(tmp_path, ["trainer", "broker"])
    t0 = time.monotonic()
    sup.stop_all(timeout_s=0.2, order=["trainer", "broker"], timeouts={"trainer": 1.5})
    assert 1.6 <= time.monotonic() - t0 < 10
    assert [sup.states[n].exit_code for n in ("trainer", "broker")] == [-signal.SIGKILL] * 2
    assert [e for e in events if e.startswith("stopping")] == [
        "stopping trainer (SIGKILL after 1.5 s)",
        "stopping broker (SIGKILL after 0.2 s)",
    ]


def test_an_interrupt_while_waiting_kills_that_process_and_the_rest_at_once(tmp_path):
    sup, events = _started(tmp_path, ["trainer", "rollout0", "broker"])
    main = threading.main_thread().ident
    # Ctrl-C as `tidal run` gets it: Python's own handler (an event loop of an earlier test may have set one)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT)).start()
        t0 = time.monotonic()
        sup.stop_all(timeout_s=60, order=["trainer", "rollout0", "broker"])
        assert time.monotonic() - t0 < 10
    finally:
        signal.signal(signal.SIGINT, before)
    assert all(not s.alive for s in sup.states.values())
    assert events[-2:] == ["stopping rollout0", "stopping broker"]


def _exits(tmp_path, sup, name, code, **spec_fields):
    spec = ProcessSpec(
        name,
        [sys.executable, "-c", f"raise SystemExit({code})"],
        tmp_path / f"{name}.log",
        restart=True,
        **spec_fields,
    )
    state = sup.start(spec)
    state.proc.wait()
    return state


def test_a_crash_is_restarted_and_a_configuration_error_is_not(tmp_path):
    events = []
    sup = Supervisor(on_event=events.append)
    crashed = _exits(tmp_path, sup, "node", 1)
    sup.poll()
    assert crashed.restarts == 1 and "node died with exit code 1; restarting (1/3)" in events
    crashed.proc.wait()
    sup.states.pop("node")
    _exits(tmp_path, sup, "broker", 2)
    with pytest.raises(ProcessDied, match=r"broker died with exit code 2\. Last lines of"):
        sup.poll()
    assert sup.states["broker"].restarts == 0


def test_a_process_that_names_its_final_exit_codes_is_not_restarted_after_them(tmp_path):
    """The trainer's exit 3 (no batch within trainer.batch_timeout_s) used to be restarted three times, each
    restart waiting the whole timeout again before the job failed."""
    sup = Supervisor()
    final = (2, 3)
    _exits(tmp_path, sup, "trainer", 3, final_exit_codes=final)
    with pytest.raises(ProcessDied, match=r"trainer died with exit code 3\. Last lines of"):
        sup.poll()
    assert sup.states["trainer"].restarts == 0
    crashed = _exits(tmp_path, sup, "trainer", 1, final_exit_codes=final)
    sup.poll()
    assert crashed.restarts == 1
    sup.stop_all(timeout_s=5)


def test_a_process_that_finishes_on_its_own_is_not_restarted_and_its_crash_is(tmp_path):
    """A rollout node exits 0 once the broker has no more prompts: done, not dead (it used to be restarted,
    spending a restart, only to find nothing to do)."""
    events = []
    sup = Supervisor(on_event=events.append)
    for name, code in (("rollout0", 0), ("rollout1", 1)):
        spec = ProcessSpec(
            name,
            [sys.executable, "-c", f"raise SystemExit({code})"],
            tmp_path / f"{name}.log",
            restart=True,
            expect_exit=True,
        )
        sup.start(spec).proc.wait()
    assert sup.poll() == ["rollout0"]
    assert sup.states["rollout0"].restarts == 0 and "rollout0 finished" in events
    assert sup.states["rollout1"].restarts == 1
    assert "rollout1 died with exit code 1; restarting (1/3)" in events
    sup.stop_all(timeout_s=5)


CHILD = """
import pathlib, signal, sys, time
def on_term(*_):
    pathlib.Path(sys.argv[1]).write_text("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("up", flush=True)
time.sleep(120)
"""

LAUNCHER = """
import sys, time
from pathlib import Path
from tidal.supervisor import ProcessSpec, Supervisor
tmp = Path(sys.argv[1])
Supervisor().start(ProcessSpec("node", [sys.executable, "-c", sys.argv[2], str(tmp / "got")], tmp / "node.log"))
print("started", flush=True)
time.sleep(120)
"""


def test_a_killed_launcher_leaves_no_process_behind(tmp_path):
    """`tidal run` SIGKILLed (or its terminal closed) used to leave its broker, nodes and trainer running
    unwatched, the broker holding its port; each now gets SIGTERM and stops as when stopped."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), CHILD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stdout.readline() == "started\n"
        deadline = time.monotonic() + 30
        while "up" not in (tmp_path / "node.log").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        launcher.kill()
        launcher.wait(10)
        while not (tmp_path / "got").exists():
            assert time.monotonic() < deadline, "the child outlived its launcher"
            time.sleep(0.05)
        assert (tmp_path / "got").read_text() == "SIGTERM"
    finally:
        launcher.kill()

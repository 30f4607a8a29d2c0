"""benchmarks/proc_stats.py's scheduler shares: a thread that spins shows as running for about its share of
the window, under its own name, and a process's threads sum as the benchmark reports them."""

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from proc_stats import SchedWindow, main_thread_name, sched_totals, thread_sched_seconds  # noqa: E402

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").exists(), reason="reads Linux's /proc (the benchmarks run on Linux only)"
)


def _spin(seconds: float, done: threading.Event) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    done.wait()  # a thread that ended is gone from /proc: it stays until the window is read


def test_a_spinning_thread_runs_for_most_of_the_window_under_its_own_name():
    if not thread_sched_seconds():
        pytest.skip("this kernel keeps no /proc/<pid>/task/<tid>/schedstat (CONFIG_SCHED_INFO off)")
    window = SchedWindow()
    done = threading.Event()
    spinner = threading.Thread(target=_spin, args=(0.3, done), name="spinner")
    spinner.start()
    # Linux names threads after the process until told otherwise; the benchmark's threads (ZeroMQ's,
    # the journal's) name themselves, as this one does through /proc
    Path(f"/proc/self/task/{spinner.native_id}/comm").write_text("spinner")
    time.sleep(0.4)
    shares = window.result()
    elapsed = time.perf_counter() - window.t0  # (a hair longer than the window result() measured)
    done.set()
    spinner.join()
    assert "spinner" in shares
    spun = shares["spinner"]
    # it was runnable for the 0.3 s it spun, running or (on a busy host) waiting for a CPU
    runnable_s = (spun["running"] + spun["waiting_for_cpu"]) * elapsed
    assert runnable_s >= 0.25 and spun["running"] + spun["waiting_for_cpu"] <= 1.05
    assert spun["running"] > 0 and spun["waiting_for_cpu"] >= 0.0
    totals = sched_totals(shares)
    assert totals["running"] >= spun["running"]
    assert set(totals) == {"running", "waiting_for_cpu"}


def test_threads_that_did_not_run_in_the_window_are_left_out():
    window = SchedWindow()
    shares = window.result()  # nothing ran but this thread, briefly
    assert all(v["running"] > 0 for v in shares.values())


def test_the_main_thread_is_named_as_the_process_whatever_its_interpreter_is_called():
    # the broker benchmark finds the event loop this way: by name it is "python" in a venv and "python3"
    # on a host running the system's interpreter, where looking for "python" found nothing
    name = main_thread_name()
    assert name == Path("/proc/self/comm").read_text().strip()
    worker = threading.Thread(target=time.sleep, args=(0.2,))
    worker.start()
    Path(f"/proc/self/task/{worker.native_id}/comm").write_text("worker")
    try:
        assert main_thread_name() == name != "worker"
    finally:
        worker.join()

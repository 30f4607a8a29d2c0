"""What the benchmarks read from /proc (Linux): a process's CPU seconds, per thread, and memory; how long
its threads ran and waited for a CPU (:class:`SchedWindow`); the whole host's busy cores and a block
device's bytes read and written over a run (:class:`HostWindow`)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _cpu_of_stat(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads."""
    return _cpu_of_stat(Path(f"/proc/{pid}/stat").read_text())


def main_thread_name(pid: int | str = "self") -> str:
    """The name of a process's main thread (its task whose id is the process's): the interpreter's file
    name, e.g. "python" in a venv and "python3" where the system's interpreter runs, unless renamed."""
    if pid == "self":
        pid = os.getpid()
    return Path(f"/proc/{pid}/task/{pid}/comm").read_text().strip()


def thread_cpu_seconds(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds of each thread of a running process, summed by thread name."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            seconds = _cpu_of_stat((task / "stat").read_text())
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + seconds
    return out


def thread_sched_seconds(pid: int | str = "self") -> dict[str, tuple[float, float]]:
    """Of each thread of a running process, summed by thread name: (seconds it ran on a CPU, seconds it
    waited runnable in a run queue) so far (``/proc/<pid>/task/<tid>/schedstat``, the scheduler's own
    nanosecond clocks; empty where the kernel keeps none)."""
    out: dict[str, tuple[float, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ran_ns, waited_ns = (task / "schedstat").read_text().split()[:2]
        except (OSError, ValueError):  # the thread ended meanwhile; or no schedstat in this kernel
            continue
        ran, waited = out.get(name, (0.0, 0.0))
        out[name] = (ran + int(ran_ns) / 1e9, waited + int(waited_ns) / 1e9)
    return out


class SchedWindow:
    """How a process's threads spent one run: the share of its wall time each ran and each waited runnable
    for a CPU. Waits with cores left idle mean the processes were runnable in bursts (all at once, then
    all waiting on one of them), not that there were too few cores throughout."""

    def __init__(self, pid: int | str = "self"):
        self.pid = pid
        self.start, self.t0 = thread_sched_seconds(pid), time.perf_counter()

    def result(self) -> dict[str, dict[str, float]]:
        """{thread name: {"running": share, "waiting_for_cpu": share}} since this window opened, for the
        threads that ran at all; call it while the process is still running (a thread that ended is gone
        from /proc, and its time with it)."""
        end, elapsed = thread_sched_seconds(self.pid), time.perf_counter() - self.t0
        out = {}
        for name, (ran, waited) in end.items():
            ran0, waited0 = self.start.get(name, (0.0, 0.0))
            if ran > ran0:
                out[name] = {
                    "running": round((ran - ran0) / elapsed, 3),
                    "waiting_for_cpu": round((waited - waited0) / elapsed, 3),
                }
        return out


SCHED_KEYS = ("running", "waiting_for_cpu")


def sched_totals(threads: dict[str, dict[str, float]]) -> dict[str, float]:
    """A :meth:`SchedWindow.result` summed over all the threads (shares of one thread's wall time)."""
    return {key: round(sum(t[key] for t in threads.values()), 3) for key in SCHED_KEYS}


def sched_mean(totals: list[dict[str, float]]) -> dict[str, float]:
    """The mean of several processes' :func:`sched_totals` (the benchmarks' producers)."""
    return {key: round(sum(t[key] for t in totals) / len(totals), 3) for key in SCHED_KEYS}


def sched_line(processes: dict[str, dict[str, float]]) -> str:
    """The benchmarks' stderr line for each process's shares."""
    shown = ", ".join(f"{k} {v['running']:.0%} / {v['waiting_for_cpu']:.0%}" for k, v in processes.items())
    return f"    share of the run's wall time running / waiting for a CPU while runnable: {shown}"


def status_kib(key: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` field in KiB (``VmHWM``: peak resident memory; ``VmRSS``), 0 if absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def host_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole host so far, all cores (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    tick = os.sysconf("SC_CLK_TCK")
    return (total - idle) / tick, total / tick


def disk_bytes(path: Path) -> tuple[int, int]:
    """(read, written) bytes so far of the block device holding ``path`` (/proc/diskstats; 0 where the
    device is not listed, e.g. tmpfs)."""
    dev = os.stat(path).st_dev
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if (int(f[0]), int(f[1])) == (os.major(dev), os.minor(dev)):
            return int(f[5]) * 512, int(f[9]) * 512
    return 0, 0


class HostWindow:
    """What the host did during one run: cores busy (everything, not only this run's processes), and the
    journal device's read and write rates. With both cores busy a run is CPU-bound; otherwise its
    processes wait (for each other, or for the device)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.cpu0, self.disk0, self.t0 = host_cpu(), disk_bytes(workdir), time.perf_counter()

    def stop(self) -> None:
        self.cpu1, self.disk1, self.t1 = host_cpu(), disk_bytes(self.workdir), time.perf_counter()

    def result(self, own_cpu_s: float) -> dict[str, float]:
        """Cores busy on the host and used by this run's processes (``own_cpu_s``), disk MB/s."""
        elapsed = self.t1 - self.t0
        return {
            "host_busy_cores": round((self.cpu1[0] - self.cpu0[0]) / elapsed, 2),
            "run_cores": round(own_cpu_s / elapsed, 2),
            "host_cores": round((self.cpu1[1] - self.cpu0[1]) / elapsed, 2),
            "disk_read_mb_s": round((self.disk1[0] - self.disk0[0]) / elapsed / 1e6, 1),
            "disk_write_mb_s": round((self.disk1[1] - self.disk0[1]) / elapsed / 1e6, 1),
        }

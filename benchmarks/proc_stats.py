"""What the benchmarks read from /proc (Linux): a process's CPU seconds, per thread, and memory; the whole
host's busy cores and a block device's bytes read and written over a run (:class:`HostWindow`)."""

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

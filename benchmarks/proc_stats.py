"""What the benchmarks read about a process from /proc (Linux): CPU seconds, per thread, and memory."""

from __future__ import annotations

import os
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

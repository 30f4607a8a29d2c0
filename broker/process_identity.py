"""Which process a member registered from, and whether that process is provably gone.

A trainer restarted after a crash finds its dead predecessor still registered (it never left) and would
wait ``node_timeout_s`` for the broker to forget it. When the predecessor ran on the same host and in the
same PID namespace, the new trainer can check: no process with that PID, a zombie, or a PID reused by a
process started at another time all mean it is gone, and the new trainer may take its place at once.
Anything it cannot check (another host, another namespace, no /proc) counts as alive: it waits, as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tidal.broker.local_journal import host_id


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` from field 3 (the state) on; None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split()  # the command name (field 2) may hold spaces


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_process() -> dict[str, Any] | None:
    """Host (the kernel's boot id, as ``register``'s ``host``), PID namespace, PID and start time (clock
    ticks since boot) of this process; None where /proc cannot tell them."""
    host, namespace, fields = host_id(), _pid_namespace(), _stat_fields(os.getpid())
    if host is None or namespace is None or fields is None:
        return None
    return {"host": host, "pid_ns": namespace, "pid": os.getpid(), "start": int(fields[19])}


def same_place(a: Any, b: Any) -> bool:
    """Whether identities ``a`` and ``b`` name one host and PID namespace (so one can see the other's PID)."""
    return (
        isinstance(a, dict)
        and isinstance(b, dict)
        and a.get("host") is not None
        and all(a.get(k) == b.get(k) for k in ("host", "pid_ns"))
    )


def checkable(identity: Any) -> bool:
    """Whether this process can see the process ``identity`` names: same host, same PID namespace."""
    return (
        same_place(identity, this_process())
        and isinstance(identity.get("pid"), int)
        and isinstance(identity.get("start"), int)
    )


def is_gone(identity: Any) -> bool:
    """Whether the process ``identity`` (from ``this_process``) has provably ended."""
    if not checkable(identity):
        return False
    fields = _stat_fields(identity["pid"])
    return fields is None or fields[0] in ("Z", "X") or int(fields[19]) != identity["start"]

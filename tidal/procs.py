"""Small process and port utilities shared by the launcher and the multi-process tests."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> str | None:
    """The OS's reason when something listens on host:port now, else None. A port held only by
    connections closing (TIME_WAIT) counts as free, as it does for ZeroMQ's bind; an address this host
    cannot bind for another reason (not one of its own, another address family) is left to the program
    that binds it to report."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.strerror if exc.errno == errno.EADDRINUSE else None
    return None


def wait_for_tcp(host: str, port: int, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Wait until something accepts connections on host:port; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"process {proc.args!r} exited with {proc.returncode} before listening on {host}:{port}"
            )
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listened on {host}:{port} within {timeout_s}s")


def python_cmd(*args: str) -> list[str]:
    """Run the ``tidal`` CLI with this interpreter, so tests and the launcher use the same environment."""
    return [sys.executable, "-m", "tidal.cli", *args]


def spawn(
    cmd: Sequence[str],
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    parent_death_signal: int | None = None,
) -> subprocess.Popen:
    """Start a process in its own session (so a kill reaches its children), output to ``log_path``.

    With ``parent_death_signal`` (Linux), the process gets that signal when the thread that started it
    dies, even by SIGKILL: a launcher that is killed leaves no process behind. Start such processes from
    a thread that lives as long as they should (the main thread)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    else:
        out = subprocess.DEVNULL
    preexec = None if parent_death_signal is None else die_with_parent(os.getpid(), parent_death_signal)
    return subprocess.Popen(
        list(cmd),
        stdout=out,
        stderr=subprocess.STDOUT,
        env=full_env,
        start_new_session=True,
        preexec_fn=preexec,
    )


def die_with_parent(parent: int, sig: int):
    """For a child, before exec: get ``sig`` when its parent dies (PR_SET_PDEATHSIG), and exit at once if
    the parent already died between fork and this call."""

    def preexec() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


PR_SET_PDEATHSIG = 1


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group of ``proc`` (it was started with a new session)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
    if proc.poll() is None:
        kill_tree(proc, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def tail(path: str | Path, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "<no log>"

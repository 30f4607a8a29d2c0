"""``python -m tidal.torchrun``, real torchrun launches of a one-rank worker: it exits with the worker's code
(plain torchrun exits 1 for every failure, so `tidal run` restarted a trainer that had waited out its batch
timeout), and a SIGTERM ends it with 143 and one line, not torchrun's traceback."""

import signal
import subprocess
import sys
import time
from pathlib import Path

from tidal.procs import free_port

WORKER = """
import os, signal, sys, time
mode = sys.argv[1]
if mode == "sleep":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as the trainer's stop at a batch boundary
    print("worker up", flush=True)
    time.sleep(120)
elif mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(mode))
"""


def _launch(tmp_path: Path, mode: str) -> subprocess.Popen:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    cmd = [
        sys.executable,
        "-m",
        "tidal.torchrun",
        "--nproc-per-node=1",
        "--nnodes=1",
        f"--master-port={free_port()}",
        str(worker),
        mode,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_exit_code_is_the_workers_and_a_failure_has_no_traceback(tmp_path: Path):
    for mode, code in (("0", 0), ("3", 3), ("kill", 128 + signal.SIGKILL)):
        proc = _launch(tmp_path, mode)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == code, out
        assert "Traceback" not in out, out
        if code:
            assert "rank 0 (pid " in out and f"exited with code {code}" in out, out


def test_a_sigterm_stops_it_with_143_and_one_line(tmp_path: Path):
    proc = _launch(tmp_path, "sleep")
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while not any("worker up" in line for line in lines):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        lines.append(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.communicate(timeout=60)[0]
    assert proc.returncode == 143, out
    assert "tidal.torchrun: stopped by SIGTERM" in out, out
    assert "Traceback" not in out and "SignalException" not in out, out

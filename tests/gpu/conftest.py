"""The GPU suite (marker ``gpu``): every test here needs CUDA and is skipped, with the reason, without it.

It runs on the accelerator through ``scripts/gpu/run_suite.sh`` (docs/gpu.md). Work that needs
process-wide state (megatron-core's parallel state, collective groups) runs in child scripts beside the
tests (``child_*.py``, not collected), each bounded by a timeout and killed with its process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def cuda_skip_reason() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    return (
        f"needs a CUDA device; torch {torch.__version__} sees none on this host "
        "(run scripts/gpu/run_suite.sh on the GPU machine, see docs/gpu.md)"
    )


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    if not mine:
        return
    reason = cuda_skip_reason()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def run_child(script: str, *args: str, timeout_s: float = 300, log: Path | None = None) -> dict:
    """Run ``tests/gpu/<script>`` with this interpreter; its last stdout line is a JSON object."""
    cmd = [sys.executable, str(HERE / script), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{script} {' '.join(args)} ran past {timeout_s} s\n{err[-4000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if log is not None:
        log.write_text(out + "\n--- stderr ---\n" + err)
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}\n{err[-6000:]}"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"{script} printed no JSON result\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="session")
def child():
    return run_child

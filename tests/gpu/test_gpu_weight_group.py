"""An NCCL weight-update group between two processes on the one GPU: sender (trainer side) and receiver
(the embedded engine's WeightReceiver), flattened buckets, received tensors bitwise equal.

NCCL refuses two ranks of one communicator on the same device ("Duplicate GPU detected"); colocated
training and rollout therefore pass weights by CUDA IPC handles instead (SGLang's
``/update_weights_from_tensor``). If this NCCL build refuses, the test is skipped with NCCL's message.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

CHILD = Path(__file__).with_name("child_broadcast.py")
NCCL_REFUSALS = ("Duplicate GPU detected", "ncclInvalidUsage")


def _run_pair(port: int, timeout_s: float = 180) -> tuple[list[int], list[str], list[str]]:
    # NCCL_DEBUG=WARN makes NCCL print why it refuses (e.g. "Duplicate GPU detected : rank 0 and rank 1 ...")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "WARN"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), role, str(port), "nccl", "cuda"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for role in ("send", "receive")
    ]
    outs, errs = [], []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s)
            outs.append(out)
            errs.append(err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [p.returncode for p in procs], outs, errs


def test_nccl_bucket_broadcast_between_two_processes_on_one_gpu():
    from tidal.procs import free_port

    codes, outs, errs = _run_pair(free_port())
    if any(codes):
        lines = [line.strip() for err in errs for line in err.splitlines()]
        refusal = next((line for r in NCCL_REFUSALS for line in lines if r in line), None)
        if refusal is not None:
            pytest.skip(
                f"NCCL refuses two ranks on one GPU (colocated sync needs CUDA IPC instead): {refusal.strip()[:300]}"
            )
        raise AssertionError(f"exit codes {codes}\nsender:\n{errs[0][-3000:]}\nreceiver:\n{errs[1][-3000:]}")
    sent, received = (json.loads(out.strip().splitlines()[-1]) for out in outs)
    assert received["devices"] == ["cuda"]
    assert received["names_equal"] and received["differ"] == []
    assert sent["buckets"] == received["buckets"] > 1
    print(
        f"NCCL same-GPU broadcast: {sent['bytes'] / sent['seconds'] / 1e9:.2f} GB/s over {sent['buckets']} buckets"
    )

"""Parallel equivalence on CPU under torchrun: every mesh trains the same model as world size 1.

Each launch trains the tiny dense (qwen3) and MoE (qwen3_moe) models from the same seed on the same fixed
synthetic GRPO batch for 5 optimizer steps; the losses and grad norms of every mesh must equal the world
size 1 run's. Tolerance: relative 1e-4 in float32 -- the meshes sum the same terms in different orders
(all-reduces, split matmuls), which moves the last few bits, and 5 Adam steps carry that forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.procs import free_port

WORKER = Path(__file__).with_name("trainer_parallel_worker.py")
STEPS = 5
RTOL = 1e-4

TWO_PROCESS_CASES = {
    "tp2": ("qwen3", "tp=2"),
    "pp2": ("qwen3", "pp=2"),
    "pp2_vpp2": ("qwen3", "pp=2,vpp=2"),
    "cp2": ("qwen3", "cp=2"),
    "dp2": ("qwen3", ""),
    "ep2_alltoall": ("qwen3_moe", "ep=2,dispatcher=alltoall"),
    "ep2_allgather": ("qwen3_moe", "ep=2,dispatcher=allgather"),
    "tp2_sequence_parallel_moe": ("qwen3_moe", "tp=2"),
}
FOUR_PROCESS_CASES = {
    "pp2_ep2": ("qwen3_moe", "pp=2,ep=2"),
}
BASELINES = {"baseline_qwen3": ("qwen3", ""), "baseline_qwen3_moe": ("qwen3_moe", "")}


def _launch(nproc: int, cases: dict[str, tuple[str, str]], tmp: Path, timeout_s: float = 400) -> dict:
    out = tmp / f"world{nproc}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        str(WORKER),
        str(out),
        str(STEPS),
        *[f"{name}:{family}:{spec}" for name, (family, spec) in cases.items()],
    ]
    log = tmp / f"world{nproc}.log"
    with open(log, "w") as f:
        # a new session, so that a timeout kills torchrun's workers too
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise
    assert rc == 0, log.read_text()[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("trainer_parallel")
    results = {}
    results.update(_launch(1, BASELINES, tmp))
    results.update(_launch(2, TWO_PROCESS_CASES, tmp))
    results.update(_launch(4, FOUR_PROCESS_CASES, tmp))
    return results


def _assert_close(name: str, got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=RTOL), f"{name}: {got} != {want}"


@pytest.mark.slow
@pytest.mark.parametrize("case", [*TWO_PROCESS_CASES, *FOUR_PROCESS_CASES])
def test_mesh_trains_like_world_size_one(runs, case):
    family = {**TWO_PROCESS_CASES, **FOUR_PROCESS_CASES}[case][0]
    baseline = runs[f"baseline_{family}"]
    _assert_close(f"{case} losses", runs[case]["losses"], baseline["losses"])
    _assert_close(f"{case} grad norms", runs[case]["grad_norms"], baseline["grad_norms"])


@pytest.mark.slow
def test_baselines_learn(runs):
    # the equivalence above would hold trivially if nothing trained
    for name in BASELINES:
        losses = runs[name]["losses"]
        assert losses[-1] < losses[0], f"{name}: loss did not go down over {STEPS} steps: {losses}"
        assert all(n > 0 for n in runs[name]["grad_norms"])

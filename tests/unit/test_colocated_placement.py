"""``tidal run``'s placement of processes on GPUs (``device``, ``gpus.*``), decided before anything starts.

The GPU counts are given to ``plan_placement`` (this host has none); tests/gpu/test_gpu_colocated_job.py
runs the default job on a real GPU.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tidal.config import RunConfig
from tidal.configio import build
from tidal.errors import ConfigError
from tidal.launcher import MULTICAST_OFF, plan_placement


def config(**overrides) -> RunConfig:
    data: dict = {}
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return build(RunConfig, data)


def gpus(n: int, ids: list[str] | None = None) -> tuple[int, list[str]]:
    return n, ids or [str(i) for i in range(n)]


def test_one_gpu_is_colocated_with_cuda_ipc_and_multicast_off():
    p = plan_placement(config(device="cuda"), gpus(1))
    assert p.colocated
    assert p.overrides == {"weights_sync.transport": "cuda_ipc", "rollout.engine.device": "cuda"}
    assert p.trainer_env == {**MULTICAST_OFF, "CUDA_VISIBLE_DEVICES": "0"}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in p.node_envs] == ["0", "0"]


def test_several_gpus_put_the_engines_beside_the_trainer_over_nccl():
    p = plan_placement(config(device="cuda", rollout__nodes=2), gpus(3, ["4", "5", "7"]))
    assert not p.colocated and p.overrides["weights_sync.transport"] == "collective"
    assert p.trainer_env["CUDA_VISIBLE_DEVICES"] == "4"  # indices are among the visible GPUs
    assert [e["CUDA_VISIBLE_DEVICES"] for e in p.node_envs] == ["5", "7"]
    p = plan_placement(
        config(device="cuda", trainer__nproc=2, gpus__engines=[3], trainer__bf16=True, rollout__nodes=1),
        gpus(4),
    )
    assert (
        p.trainer_env["CUDA_VISIBLE_DEVICES"] == "0,1" and p.overrides["rollout.engine.dtype"] == "bfloat16"
    )
    assert [e["CUDA_VISIBLE_DEVICES"] for e in p.node_envs] == ["3"]


def test_cpu_hides_the_gpus_from_every_process():
    p = plan_placement(config(), gpus(8))
    assert p.overrides == {} and not p.colocated
    assert p.trainer_env == {"CUDA_VISIBLE_DEVICES": ""} and all(e == p.trainer_env for e in p.node_envs)


@pytest.mark.parametrize(
    ("cfg", "count", "message"),
    [
        (dict(device="cuda"), 0, "device='cuda' needs a CUDA device"),
        (
            dict(rollout__engine__type="embedded", rollout__engine__device="cuda"),
            1,
            "rollout.engine.device='cuda' with device='cpu'",
        ),
        (dict(device="cuda", gpus__trainer=[0, 1]), 2, "lists 2 GPU(s) for trainer.nproc=1"),
        (dict(device="cuda", gpus__engines=[5]), 2, "in [0, 2)"),
        (dict(device="cuda", gpus__engines=[0, 1]), 2, "mix the trainer's first GPU"),
        (dict(device="cuda", weights_sync__transport="collective"), 1, "NCCL refuses two ranks on one GPU"),
        (dict(device="cuda", weights_sync__transport="cuda_ipc"), 2, "CUDA IPC needs the engines"),
        # two nodes on the one GPU left over: both would be ranks of the NCCL weight group on one GPU
        (dict(device="cuda"), 2, "give each engine its own GPU"),
        (dict(device="cuda", rollout__engines_per_node=2, rollout__nodes=1), 3, "engines_per_node=2"),
    ],
)
def test_combinations_that_cannot_run_name_key_value_and_rule(cfg, count, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_placement(config(**cfg), gpus(count))


def test_tidal_run_on_cuda_without_a_gpu_stops_before_starting_anything(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "run", "configs/tiny.yaml", "device=cuda", f"run_dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "device='cuda' needs a CUDA device" in proc.stderr
    assert not run_dir.exists()

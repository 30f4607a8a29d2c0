"""Step statistics (accumulate, reduce over real gloo ranks) and the JSONL + TensorBoard writer."""

import json
import math
import sys
import time

import pytest
import torch

from tidal.procs import free_port, spawn, stop, tail
from tidal.trainer.metrics import MetricsWriter, StepStats, read_metrics


def test_stats_merge_over_micro_batches():
    a, b = StepStats(), StepStats()
    a.add_mean("clip", 1.0, 4)
    b.add_mean("clip", torch.tensor(2.0), torch.tensor(8.0))
    a.add_sum("loss", 0.25)
    b.add_sum("loss", 0.5)
    a.add_max("w_max", 3.0)
    b.add_max("w_max", 5.0)
    a.add_min("w_min", 0.5)
    b.add_min("w_min", 0.7)
    b.add_mean("empty", 0.0, 0)
    summary = a.merge(b).summary()
    assert summary["clip"] == pytest.approx(3 / 12)  # (1 + 2) / (4 + 8), not the mean of 1/4 and 2/8
    assert summary["loss"] == pytest.approx(0.75)
    assert summary["w_max"] == 5.0 and summary["w_min"] == 0.5
    assert math.isnan(summary["empty"])


def test_one_name_one_kind():
    stats = StepStats()
    stats.add_sum("x", 1.0)
    with pytest.raises(ValueError, match="'x' is already recorded as 'sum', not 'max'"):
        stats.add_max("x", 1.0)


def test_writer_jsonl_and_tensorboard(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(1, {"loss/total": 0.5, "reward/mean": 0.25})
        writer.write(2, {"loss/total": 0.25, "reward/mean": float("nan")})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss/total"] == 0.5 and math.isnan(records[1]["reward/mean"])
    assert records[0]["time"] <= records[1]["time"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("loss/total")
    assert [(e.step, e.value) for e in scalars] == [(1, 0.5), (2, 0.25)]


def test_writer_rejects_reserved_names(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer, pytest.raises(ValueError, match="reserved"):
        writer.write(1, {"step": 3})


RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from tidal.trainer.metrics import StepStats
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
stats = StepStats()
stats.add_mean("clip", 1.0 + rank, 4 * (rank + 1))
stats.add_sum("loss", 0.25 * (rank + 1))
stats.add_max("w_max", 3.0 + 2 * rank)
stats.add_min("w_min", 0.5 + 0.2 * rank)
stats.all_reduce()
json.dump(stats.summary(), open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_all_reduce_over_two_gloo_ranks(tmp_path):
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = {"RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            cmd = [sys.executable, "-c", RANK_SCRIPT, str(tmp_path / f"rank{rank}.json")]
            procs.append(spawn(cmd, tmp_path / f"rank{rank}.log", env=env))
        deadline = time.monotonic() + 100
        for rank, proc in enumerate(procs):
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, tail(tmp_path / f"rank{rank}.log")
    finally:
        for proc in procs:
            stop(proc)
    expected = {"clip": 3 / 12, "loss": 0.75, "w_max": 5.0, "w_min": 0.5}
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == pytest.approx(expected)

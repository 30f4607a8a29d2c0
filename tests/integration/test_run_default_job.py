"""A shortened default job end to end: `tidal run` starts the broker, two rollout nodes and the trainer as
real processes (warm-up SFT and GRPO under torchrun, embedded engines over HTTP, weight sync over gloo)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.live_view import LiveView
from tidal.procs import free_port


@pytest.mark.slow
def test_shortened_default_job_runs_end_to_end_and_continues(tmp_path: Path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "tidal.cli",
        "run",
        "configs/tiny.yaml",
        f"run_dir={run_dir}",
        f"broker.bind=tcp://127.0.0.1:{free_port()}",
        "warmup.steps=4",
        "trainer.steps=3",
        "broker.batch_groups=8",
        "task.num_train=2000",
        "task.num_eval=50",
        "--plain",
        "--no-control",
    ]
    cmd_dir = Path(__file__).parents[2]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cmd_dir)
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log"))
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs

    report = json.loads((run_dir / "report.json").read_text())
    assert report["eval_problems"] == 50
    for key in ("sft", "grpo"):
        assert 0.0 <= report[key]["accuracy"] <= 1.0 and report[key]["n"] == 50
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all("reward/mean" in m and "loss" in m for m in steps)
    view = LiveView(3, "tidal tiny", interactive=False)  # what `tidal run` in a terminal shows
    view.update(steps, None, {})
    assert [label for label, value in view.rows() if "-" in value.split()] == []
    # every trained batch is a distinct broker batch; versions follow optimizer steps
    assert len({m["batch_id"] for m in steps}) == 3
    assert (run_dir / "final_hf" / "config.json").exists()
    assert (run_dir / "sft" / "hf" / "config.json").exists()
    assert {p.name for p in (run_dir / "plots").glob("*.png")} == {
        "reward.png",
        "staleness.png",
        "throughput.png",
    }
    assert {"broker.log", "rollout0.log", "rollout1.log", "trainer.log", "sft.log"} <= {
        p.name for p in (run_dir / "logs").glob("*.log")
    }
    assert "held-out greedy accuracy" in proc.stdout

    # Started again on its run directory: another model is refused before anything is written, and
    # `--resume RUN_DIR trainer.steps=5` continues the saved run for two more steps, on new broker batches.
    saved = (run_dir / "config.yaml").read_text()
    refused = subprocess.run(
        [*cmd, "model.hidden_size=64"], capture_output=True, text=True, timeout=120, cwd=cmd_dir
    )
    assert refused.returncode == 2 and "model.hidden_size: 128 there, 64 given" in refused.stderr
    assert (run_dir / "config.yaml").read_text() == saved
    resume = [
        sys.executable,
        "-m",
        "tidal.cli",
        "run",
        "--resume",
        str(run_dir),
        "trainer.steps=5",
        "--plain",
        "--no-control",
    ]
    proc = subprocess.run(resume, capture_output=True, text=True, timeout=600, cwd=cmd_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
    assert len({m["batch_id"] for m in steps}) == 5
    journal = json.loads((run_dir / "report.json").read_text())["journal"]
    assert journal["problems"] == [] and journal["batched"] >= 5 * 8

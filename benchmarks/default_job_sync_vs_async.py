"""The real default job, synchronous (``tidal run --sync``: eta = 0) against asynchronous (the config's
``max_staleness``), compared by GRPO wall time to the same step.

Both runs are the whole ``tidal run`` (warm-up SFT, broker, rollout nodes with embedded engines, the
trainer under torchrun with weight sync), without the SFT control. The GRPO phase's clock starts when the
trainer starts (the warm-up is shared and not counted); the time to step k is read from the trainer's
metrics (``time`` of step k minus that of step 1, so the trainer's start-up is not counted either).

``--concurrent`` starts both jobs at once so that they share whatever else loads the machine (a fair
ratio on a busy machine; both run slower). Each run writes its run directory under ``--work``.

    .venv/bin/python benchmarks/default_job_sync_vs_async.py --steps 40 --out runs/bench/job_sync_vs_async.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tidal.procs import free_port

REPO = Path(__file__).resolve().parents[1]


def job_cmd(config: str, run_dir: Path, steps: int, sync: bool, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tidal.cli",
        "run",
        config,
        f"run_dir={run_dir}",
        f"broker.bind=tcp://127.0.0.1:{free_port()}",
        f"trainer.steps={steps}",
        *overrides,
        "--plain",
        "--no-control",
        *(["--sync"] if sync else []),
    ]


def summarise(run_dir: Path, mode: str, wall_s: float) -> dict:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lineage = {m["step"]: m for m in metrics}
    steps = sorted(lineage)
    first, last = lineage[steps[0]], lineage[steps[-1]]
    step_s = [lineage[b]["time"] - lineage[a]["time"] for a, b in zip(steps, steps[1:], strict=False)]
    report = json.loads((run_dir / "report.json").read_text())
    return {
        "mode": mode,
        "steps": len(steps),
        "steps_1_to_last_s": last["time"] - first["time"],
        "median_step_s": statistics.median(step_s) if step_s else None,
        "grpo_wall_s": report["grpo_wall_s"],
        "job_wall_s": wall_s,
        "staleness_mean": statistics.mean(m.get("offpolicy/staleness_mean", 0.0) for m in lineage.values()),
        "grpo_accuracy": report["grpo"]["accuracy"],
        "sft_accuracy": report["sft"]["accuracy"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--work", default="runs/bench/job_sync_vs_async")
    p.add_argument("--concurrent", action="store_true", help="run both jobs at the same time")
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")
    args = p.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runs = {"sync": (work / "sync", True), "async": (work / "async", False)}
    procs: dict[str, tuple[subprocess.Popen, float]] = {}
    results = {}
    for mode, (run_dir, sync) in runs.items():
        shutil.rmtree(run_dir, ignore_errors=True)
        log = open(work / f"{mode}.log", "w")  # noqa: SIM115 - the child writes to it until it exits
        cmd = job_cmd(args.config, run_dir, args.steps, sync, args.overrides)
        procs[mode] = (subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), time.time())
        if not args.concurrent:
            proc, started = procs[mode]
            if proc.wait() != 0:
                raise SystemExit(f"{mode} run failed: see {work / (mode + '.log')}")
            results[mode] = summarise(run_dir, mode, time.time() - started)
    if args.concurrent:
        for mode, (proc, started) in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"{mode} run failed: see {work / (mode + '.log')}")
            results[mode] = summarise(runs[mode][0], mode, time.time() - started)

    sync_s, async_s = results["sync"]["steps_1_to_last_s"], results["async"]["steps_1_to_last_s"]
    print(
        f"default job, {args.steps} GRPO steps, {'concurrent' if args.concurrent else 'one after the other'}"
    )
    print(f"{'mode':<6} {'steps 1..N s':>13} {'median step s':>14} {'staleness':>10} {'GRPO acc':>9}")
    for r in results.values():
        print(
            f"{r['mode']:<6} {r['steps_1_to_last_s']:>13.1f} {r['median_step_s']:>14.2f} "
            f"{r['staleness_mean']:>10.2f} {100 * r['grpo_accuracy']:>8.1f}%"
        )
    print(f"async speed-up (sync time / async time to step {args.steps}): {sync_s / async_s:.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        payload = {"steps": args.steps, "concurrent": args.concurrent, "runs": results}
        payload["speedup"] = sync_s / async_s
        Path(args.out).write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

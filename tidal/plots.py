"""PNG plots of a run's metrics: reward and accuracy over steps, staleness, throughput."""

from __future__ import annotations

import json
from pathlib import Path


def load_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        if key in r and "step" in r:
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys


def write_plots(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load_metrics(metrics_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("reward/mean", "reward"), ("reward/solved", "solved (reward > 0)")):
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_title("reward and accuracy of trained samples")
    ax.legend()
    fig.tight_layout()
    written.append(out / "reward.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    _, ys = _series(records, "staleness/batch")
    ax.hist(ys, bins=10)
    ax.set_xlabel("staleness of a step's oldest sample (trainer version - sample version)")
    ax.set_ylabel("optimizer steps")
    ax.set_title("staleness of trained samples")
    fig.tight_layout()
    written.append(out / "staleness.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs, ys = _series(records, "throughput/wall_samples_per_s")
    if xs:
        ax.plot(xs, ys)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("trained samples/s")
    ax.set_title("throughput")
    fig.tight_layout()
    written.append(out / "throughput.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written

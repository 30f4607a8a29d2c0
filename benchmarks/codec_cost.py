"""The group codec's cost per frame and per sample, in one process: what frames of several groups could save.

For frames of ``--group-sizes`` samples of ``--tokens`` tokens (the broker benchmark's samples), times
building the Sample objects, ``encode_group`` (a rollout node), ``inspect_group`` (the broker) and
``decode_group`` (the trainer), medians of ``--repeats`` rounds of ``--number`` calls each, and fits each to
``per_frame + per_sample * n`` by least squares. The fixed part is what a frame holding several groups
would pay once instead of once per group; the broker benchmark's figures (benchmarks/broker_throughput.py)
are 1.5-2x these in a run, where four processes share two cores and their caches.

``--codecs`` picks the paths timed, side by side: ``native`` (the C hot paths of ``native_codec.c``, what
tidal runs where they build) and ``python`` (codec.py alone, the reference and the fallback).

    .venv/bin/python benchmarks/codec_cost.py --out runs/bench/codec_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
from pathlib import Path

import numpy as np

from tidal.broker import native_codec
from tidal.broker.codec import decode_group, encode_group, inspect_group

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker_baselines import sample_arrays  # noqa: E402
from broker_method import _group  # noqa: E402  (the broker benchmark's groups, built the same way)

STAGES = ("build", "encode", "inspect", "decode")
CODECS = ("native", "python")


def time_stages(tokens: int, n: int, number: int, repeats: int, codec: str = "native") -> dict[str, float]:
    """Microseconds per frame of each stage (median of ``repeats``) through ``codec``'s path."""
    arrays = sample_arrays(tokens)
    group = _group("0:1", arrays, n)
    native = codec == "native"
    frame = bytes(encode_group(group, native=native))
    calls = {
        "build": lambda: _group("0:1", arrays, n),
        "encode": lambda: encode_group(group, native=native),
        "inspect": lambda: inspect_group(frame, native=native),
        "decode": lambda: decode_group(frame, native=native),
    }
    return {
        stage: statistics.median(timeit.repeat(call, number=number, repeat=repeats)) / number * 1e6
        for stage, call in calls.items()
    }


def fit(sizes: list[int], costs: list[float]) -> tuple[float, float]:
    """(per frame, per sample) of ``cost = per_frame + per_sample * n``."""
    per_sample, per_frame = np.polyfit(np.array(sizes, float), np.array(costs, float), 1)
    return float(per_frame), float(per_sample)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="response tokens per sample")
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[8, 16, 32], help="samples per frame")
    ap.add_argument("--number", type=int, default=500, help="calls per timed round")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (the median is kept)")
    ap.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS), help="codec paths timed")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if len(args.group_sizes) < 2:
        ap.error("--group-sizes needs at least two sizes to separate the per-frame cost")
    if "native" in args.codecs and native_codec.load()[0] is None:
        ap.error(f"no native codec here ({native_codec.load()[1]}); pass --codecs python")

    results = {}
    for codec in args.codecs:
        rows = {n: time_stages(args.tokens, n, args.number, args.repeats, codec) for n in args.group_sizes}
        fits = {s: fit(args.group_sizes, [rows[n][s] for n in args.group_sizes]) for s in STAGES}
        results[codec] = {"rows": rows, "fits": fits}
        print_table(codec, args, rows, fits)
    if len(results) == 2:
        n = args.group_sizes[0]
        native, python = results["native"]["rows"][n], results["python"]["rows"][n]
        print(
            f"python / native at {n} samples a frame: "
            + ", ".join(f"{s} {python[s] / native[s]:.2f}x" for s in STAGES if s != "build")
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "args": vars(args) | {"out": str(args.out)},
            "codecs": {
                codec: {
                    "us_per_frame": {str(n): r for n, r in got["rows"].items()},
                    "fit": {s: {"per_frame_us": f[0], "per_sample_us": f[1]} for s, f in got["fits"].items()},
                }
                for codec, got in results.items()
            },
        }
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


def print_table(codec: str, args: argparse.Namespace, rows: dict, fits: dict) -> None:
    print(
        f"{codec} codec, {args.tokens}-token samples, us per frame (median of {args.repeats} x {args.number} calls)"
    )
    print(f"{'samples/frame':>13} | " + " | ".join(f"{s:>8}" for s in STAGES) + " |    total")
    for n, r in rows.items():
        print(f"{n:>13} | " + " | ".join(f"{r[s]:8.1f}" for s in STAGES) + f" | {sum(r.values()):8.1f}")
    print(
        f"{'per frame':>13} | "
        + " | ".join(f"{fits[s][0]:8.1f}" for s in STAGES)
        + f" | {sum(f[0] for f in fits.values()):8.1f}"
    )
    print(
        f"{'per sample':>13} | "
        + " | ".join(f"{fits[s][1]:8.2f}" for s in STAGES)
        + f" | {sum(f[1] for f in fits.values()):8.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())

"""What Python's garbage collector costs the trainer's batch decoding, with its start-up heap frozen or not.

The trainer decodes each batch from the broker (``decode_group``: Sample objects, their arrays and metas),
and the next version it publishes waits for that: while it decodes, the staleness window can be closed and
the rollout side idle. Every full collection walks every object the process holds; a trainer holds what
torch, megatron-core and transformers built at import and set-up. ``gc.freeze()`` after set-up
(``tidal.heap.freeze_start_up_heap``, what the trainer does before its first step) leaves those objects out.

Each variant runs in a fresh process, ``--repeats`` times, interleaved: the broker benchmark's consumer
heap (``bench``: the broker client's imports) or the trainer's (``trainer``: also torch, megatron.core
and transformers), with the collector as Python sets it (``default``) or the start-up heap frozen
(``frozen``). A process decodes ``--batches`` batches of ``--batch-groups`` groups of 8 samples of
``--tokens`` tokens, holding the last 3 (the trainer's feed holds the batch training, the one fetched
ahead and the one asked ahead), and reports CPU microseconds per sample and the batch time's median, p99
and maximum (a full collection shows as the maximum).

    .venv/bin/python benchmarks/feed_gc.py --out runs/bench/feed_gc.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAPS = ("bench", "trainer")
MODES = ("default", "frozen")
HELD_BATCHES = 3


def child(heap: str, mode: str, tokens: int, batches: int, batch_groups: int) -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from broker_baselines import sample_arrays
    from broker_method import _group

    from tidal.broker.client import BrokerClient  # noqa: F401  (the feed's imports)
    from tidal.broker.codec import decode_group, encode_group
    from tidal.heap import freeze_start_up_heap

    if heap == "trainer":
        import megatron.core  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers import AutoConfig  # noqa: F401  (transformers imports lazily)

    arrays = sample_arrays(tokens)
    frames = [bytes(encode_group(_group(f"g-{i}", arrays, 8))) for i in range(2 * batch_groups)]
    if mode == "frozen":
        freeze_start_up_heap()
    objects = len(gc.get_objects()) + gc.get_freeze_count()  # frozen ones are no longer listed
    held: list[list] = []
    times = []
    full0 = gc.get_stats()[2]["collections"]
    c0 = time.process_time()
    for b in range(batches):
        t = time.perf_counter()
        held.append([decode_group(frames[(b * batch_groups + i) % len(frames)]) for i in range(batch_groups)])
        if len(held) > HELD_BATCHES:
            held.pop(0)
        times.append(time.perf_counter() - t)
    cpu = time.process_time() - c0
    times.sort()
    return {
        "objects_tracked": objects,
        "objects_frozen": gc.get_freeze_count(),
        "cpu_us_per_sample": cpu / (batches * batch_groups * 8) * 1e6,
        "batch_ms_median": statistics.median(times) * 1e3,
        "batch_ms_p99": times[int(0.99 * (len(times) - 1))] * 1e3,
        "batch_ms_max": times[-1] * 1e3,
        "full_collections": gc.get_stats()[2]["collections"] - full0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=1500)
    ap.add_argument("--batch-groups", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heaps", nargs="+", choices=HEAPS, default=list(HEAPS))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--child", nargs=2, metavar=("HEAP", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child, a.tokens, a.batches, a.batch_groups)))
        return
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    sizes = ["--tokens", str(a.tokens), "--batches", str(a.batches), "--batch-groups", str(a.batch_groups)]
    for r in range(a.repeats):
        for heap in a.heaps:
            for mode in MODES:
                cmd = [sys.executable, __file__, "--child", heap, mode, *sizes]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                runs.setdefault((heap, mode), []).append(result)
                print(f"  round {r} {heap:8s} {mode:8s} {result}", file=sys.stderr)
    keys = ("cpu_us_per_sample", "batch_ms_median", "batch_ms_p99", "batch_ms_max", "full_collections")
    medians = {
        f"{heap}/{mode}": {
            k: statistics.median(x[k] for x in rs) for k in ("objects_tracked", "objects_frozen", *keys)
        }
        for (heap, mode), rs in runs.items()
    }
    print(
        f"\n{a.tokens} tokens, {a.batch_groups}-group batches of 8-sample groups, {a.batches} batches a run;"
        f" medians of {a.repeats} run(s)"
    )
    print(
        f"{'heap/gc':18s} {'objects':>9s} {'CPU us/sample':>14s} {'median ms':>10s} {'p99 ms':>8s} {'max ms':>8s} {'full GCs':>9s}"
    )
    for name, m in medians.items():
        print(
            f"{name:18s} {m['objects_tracked']:9.0f} {m['cpu_us_per_sample']:14.2f} {m['batch_ms_median']:10.2f}"
            f" {m['batch_ms_p99']:8.2f} {m['batch_ms_max']:8.2f} {m['full_collections']:9.0f}"
        )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(
            json.dumps(
                {
                    "args": vars(a),
                    "medians": medians,
                    "runs": {f"{h}/{m}": rs for (h, m), rs in runs.items()},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

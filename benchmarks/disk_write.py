"""GB/s of O_DIRECT writes on the journal's disk: what the broker's journal can reach at best.

Writes ``--total-mib`` in blocks of each ``--block-mib`` with 1, 2 and 4 writes in flight (threads, each
``pwrite`` at its own offset), then ``fdatasync``: first appending to a new file, then over the blocks of
that file again (a journal's spare file is written over; docs/protocol.md). Medians of ``--repeats``.

    .venv/bin/python benchmarks/disk_write.py --dir runs/tmp --out runs/bench/disk_write.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import threading
import time
from pathlib import Path


def write_rate(path: Path, total: int, block: int, in_flight: int, append: bool) -> float:
    if append and path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    buffers = [mmap.mmap(-1, block) for _ in range(in_flight)]  # page-aligned, as O_DIRECT needs
    for buf in buffers:
        buf.write(os.urandom(block))
    blocks, taken, lock = total // block, [0], threading.Lock()

    def writer(buf: mmap.mmap) -> None:
        while True:
            with lock:
                k = taken[0]
                taken[0] += 1
            if k >= blocks:
                return
            os.pwrite(fd, buf, k * block)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=writer, args=(buf,)) for buf in buffers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.fdatasync(fd)
    elapsed = time.perf_counter() - t0
    os.close(fd)
    return blocks * block / elapsed / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("runs/tmp"), help="a folder on the journal's disk")
    ap.add_argument("--total-mib", type=int, default=2048)
    ap.add_argument("--block-mib", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "disk_write.bin"
    results = []
    print(f"{'mode':>9} {'block MiB':>9} {'in flight':>9} {'GB/s (median)':>14}  runs")
    try:
        for mode in ("append", "overwrite"):
            for block in args.block_mib:
                for depth in args.in_flight:
                    rates = [
                        write_rate(path, args.total_mib << 20, block << 20, depth, mode == "append")
                        for _ in range(args.repeats)
                    ]
                    med = statistics.median(rates)
                    results.append({"mode": mode, "block_mib": block, "in_flight": depth, "gbps": rates})
                    print(
                        f"{mode:>9} {block:>9} {depth:>9} {med:>14.2f}  {', '.join(f'{r:.2f}' for r in rates)}"
                    )
    finally:
        path.unlink(missing_ok=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"total_mib": args.total_mib, "results": results}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

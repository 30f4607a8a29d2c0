"""The broker's work per group without sockets: tidal's BrokerState next to the floor's least work, in one process.

At 1K-token samples the broker path is bound by per-group CPU spread over many small steps
(docs/BENCHMARKS.md), and the end-to-end benchmarks (``broker_throughput.py``, ``broker_floor.py``) run
four processes on two cores, whose noise (+-10% between rounds) hides a step worth a few percent. This
script times the broker's own per-group work alone, on the main thread, as its event loop does it:

- ``tidal``: a ``BrokerState`` on a real journal (the broker's default journal settings: O_DIRECT, the
  writer thread taking commits over ``inline_bytes``; ``--journal-writer loop`` for every commit on the
  committing thread) serving one
  rollout node and a trainer: lease a window of groups (``lease`` and the pushed lease's wire form, as
  ``BrokerServer._push_leases`` sends it), submit them ``--per-lease`` groups at a time with a commit after each (one event-loop wake-up each),
  then cut the window's batches with the refs a local trainer copies them by (``memory_refs``), publish a
  version and report them consumed (``report_consumed`` forgets them);
- ``floor``: what ``broker_floor.py``'s broker does per group: check the frame (``inspect_group``), sum
  its CRC-32 and write it with a header through the same O_DIRECT writer, once per submit.

Frames are encoded before each window, outside the timed parts (a rollout node's work), into a ring many
times the size of the CPU's caches, as a node's submit ring is, and with the node's non-temporal stores:
the broker reads frames from memory, not from a cache. Each variant runs ``--repeats`` rounds,
interleaved; the table shows the median microseconds per group, all threads, and of each step on the main
thread (CPU time; the journal's threads are shown apart), and tidal's ratio to the floor.

    .venv/bin/python benchmarks/broker_state_cost.py --out runs/bench/broker_state_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from isal.isal_zlib import crc32

from tidal.broker import protocol as proto
from tidal.broker.batch_refs import memory_refs
from tidal.broker.codec import encode_group, inspect_group, lease_to_wire
from tidal.broker.config import BrokerConfig, JournalConfig
from tidal.broker.journal import Journal
from tidal.broker.journal_writers import DirectWriter
from tidal.broker.source import PromptSource, load_rows
from tidal.broker.state import BrokerState
from tidal.broker.testing import write_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker_baselines import sample_arrays  # noqa: E402
from broker_method import _group  # noqa: E402  (the broker benchmark's groups, built the same way)
from interpreter_build import describe, interpreter_build  # noqa: E402

STEPS = {
    "tidal": ("lease", "submit", "commit", "batch", "consumed"),
    "floor": ("inspect", "crc", "write"),
}


class FrameRing:
    """Encodes frames one after the other into a large buffer, wrapping around (a node's submit ring)."""

    def __init__(self, nbytes: int):
        self.buf = np.zeros(nbytes, np.uint8)  # its pages are faulted in by the first encodes (untimed)
        self.head = 0

    def alloc(self, nbytes: int) -> np.ndarray:
        if self.head + nbytes > len(self.buf):
            self.head = 0
        start, self.head = self.head, self.head + -(-nbytes // 64) * 64
        return self.buf[start : start + nbytes]

    def encode(
        self, group_ids: list[str], arrays: dict[str, np.ndarray], group_size: int
    ) -> list[np.ndarray]:
        # streaming: as a node encodes into its submit ring (non-temporal stores: the lines go to memory)
        return [encode_group(_group(g, arrays, group_size), self.alloc, streaming=True) for g in group_ids]


class Clock:
    """Main-thread CPU seconds per step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._at = 0.0

    def start(self) -> None:
        self._at = time.thread_time()

    def lap(self, step: str) -> None:
        now = time.thread_time()
        self.seconds[step] += now - self._at
        self._at = now


def run_tidal(
    workdir: Path, groups: int, tokens: int, group_size: int, per_lease: int, ring: FrameRing, writer: str
) -> dict:
    cfg = BrokerConfig.model_validate(
        {
            "group_size": group_size,
            "batch_groups": 32,
            "max_staleness": 2,
            "staleness_policy": "keep",
            "journal": {"writer": writer},
        }
    )
    data = workdir / "data.jsonl"
    write_rows(data, groups)
    source = PromptSource(load_rows([data]), seed=0, shuffle=True, epochs=1)
    journal = Journal.from_config(workdir / "journal", cfg.journal)
    state = BrokerState(cfg, source, journal)
    state.replay(journal.open(), journal.replayed_locs)
    node = state.register(b"node", "rollout", "bench", {}, time.time())
    trainer = state.register(b"trainer", "trainer", "bench", {}, time.time())
    arrays = sample_arrays(tokens)
    window = cfg.batch_groups * (cfg.max_staleness + 1)
    clock, done, after, encoding, batched = Clock(), 0, -1, 0.0, 0
    process0 = time.process_time()
    while done < groups:
        now = time.time()
        clock.start()
        leases = []
        while sum(len(lease.groups) for lease in leases) < min(window, groups - done):
            lease = state.lease(node, per_lease, now)
            if lease is None:
                break
            proto.encode_envelope("lease", 1, {"node_id": node.node_id, "lease": lease_to_wire(lease)})
            leases.append(lease)
        clock.lap("lease")
        if not leases:
            raise RuntimeError(f"no lease after {done} groups: admission closed (version {state.version})")
        encode_at = time.thread_time()
        frames = [ring.encode([pg.group_id for pg in lease.groups], arrays, group_size) for lease in leases]
        encoding += time.thread_time() - encode_at
        clock.start()
        for lease, lease_frames in zip(leases, frames, strict=True):
            state.submit(node, lease.lease_id, lease_frames, now)
            clock.lap("submit")
            journal.commit()
            clock.lap("commit")
            done += len(lease_frames)
        while (batch := state.get_batch(after, None)) is not None:
            memory_refs(state, batch)
            clock.lap("batch")
            state.seen(trainer.peer, now)
            state.publish_version(batch.batch_id + 1)
            state.report_consumed(batch.batch_id)
            after, batched = batch.batch_id, batched + len(batch.group_ids)
            clock.lap("consumed")
    journal.flush()
    # the journal's writer and fsync threads (the main thread's encoding is a node's work, not counted)
    other = time.process_time() - process0 - sum(clock.seconds.values()) - encoding
    journal.close()
    return {
        "seconds": dict(clock.seconds),
        "groups": done,
        "batched": batched,
        "other_threads_s": max(0.0, other),
    }


def run_floor(
    workdir: Path, groups: int, tokens: int, group_size: int, per_lease: int, ring: FrameRing, _: str
) -> dict:
    """(The journal writer setting is tidal's; the floor always writes on its one thread.)"""
    out = DirectWriter(workdir / "floor.log", 0)
    arrays = sample_arrays(tokens)
    clock, done, pack = Clock(), 0, msgpack.packb
    while done < groups:
        ids = [f"0:{i}" for i in range(done, min(done + per_lease, groups))]
        lease_frames = ring.encode(ids, arrays, group_size)
        clock.start()
        staged: list[Any] = []
        for frame in lease_frames:
            inspect_group(frame)
            clock.lap("inspect")
            payload = memoryview(frame)
            staged += [len(payload).to_bytes(4, "little") + crc32(payload).to_bytes(4, "little"), payload]
            clock.lap("crc")
        staged.append(pack(["ack", done]))
        out.write(staged)
        clock.lap("write")
        done += len(lease_frames)
    out.close()
    return {"seconds": dict(clock.seconds), "groups": done, "other_threads_s": 0.0}


RUNNERS = {"tidal": run_tidal, "floor": run_floor}


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    out = {}
    for variant, rounds in runs.items():
        per = {
            step: statistics.median(r["seconds"].get(step, 0.0) / r["groups"] * 1e6 for r in rounds)
            for step in STEPS[variant]
        }
        per["total"] = statistics.median(sum(r["seconds"].values()) / r["groups"] * 1e6 for r in rounds)
        per["other_threads"] = statistics.median(r["other_threads_s"] / r["groups"] * 1e6 for r in rounds)
        per["all_threads"] = statistics.median(
            (sum(r["seconds"].values()) + r["other_threads_s"]) / r["groups"] * 1e6 for r in rounds
        )
        out[variant] = {k: round(v, 2) for k, v in per.items()}
    return out


def print_table(summary: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.tokens} tokens, {args.group_size}-sample groups, {args.per_lease} a lease, "
        f"{args.groups} groups a round; CPU us per group (all threads | by step on the main thread), "
        f"medians of {args.repeats} round(s)"
    )
    for variant, per in summary.items():
        steps = " + ".join(f"{step} {per[step]:.1f}" for step in STEPS[variant])
        print(
            f"{variant:6s} | {per['all_threads']:7.1f} | main thread {per['total']:.1f} = {steps}; "
            f"other threads {per['other_threads']:.1f}"
        )
    if "tidal" in summary and "floor" in summary and summary["floor"]["all_threads"]:
        print(f"tidal / floor: {summary['tidal']['all_threads'] / summary['floor']['all_threads']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="response tokens per sample")
    ap.add_argument("--group-size", type=int, default=8, help="samples per group")
    ap.add_argument("--per-lease", type=int, default=4, help="groups per lease and per submit")
    ap.add_argument("--groups", type=int, default=4800, help="groups per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds per variant, interleaved")
    ap.add_argument("--variants", nargs="+", choices=list(RUNNERS), default=list(RUNNERS))
    ap.add_argument(
        "--journal-writer",
        choices=["thread", "loop"],
        default=JournalConfig().writer,
        help="tidal's journal.writer (default: the broker's): 'loop' writes every commit on the main thread; "
        "'thread' splits the writes between the main thread and the writer thread as each commit finds it "
        "busy or idle",
    )
    ap.add_argument(
        "--ring-mib", type=int, default=512, help="memory the frames cycle through (far more than any cache)"
    )
    ap.add_argument("--out", type=Path, default=None, help="write the rounds and the summary as JSON here")
    args = ap.parse_args(argv)
    interpreter = interpreter_build()
    for name in ("tokens", "group_size", "per_lease", "groups", "repeats", "ring_mib"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    ring = FrameRing(args.ring_mib << 20)
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.repeats):
        for variant in args.variants:
            with tempfile.TemporaryDirectory(prefix="broker-state-cost-") as tmp:
                result = RUNNERS[variant](
                    Path(tmp),
                    args.groups,
                    args.tokens,
                    args.group_size,
                    args.per_lease,
                    ring,
                    args.journal_writer,
                )
            runs[variant].append(result)
            main_s = sum(result["seconds"].values())
            total = (main_s + result["other_threads_s"]) / result["groups"] * 1e6
            print(f"  round {r} {variant:6s} {total:7.1f} us/group", file=sys.stderr)
    summary = summarise(runs)
    print_table(summary, args)
    print(f"interpreter: {describe(interpreter)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "interpreter": interpreter,
                    "runs": runs,
                    "summary": summary,
                },
                indent=1,
            )
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

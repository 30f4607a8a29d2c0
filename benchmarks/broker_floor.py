"""The floor of an asyncio broker path: what the least plumbing costs, next to tidal's broker and raw pyzmq.

Issue 2 asks the broker path for 0.8x raw pyzmq at every sample size; at 1K tokens and 8-sample groups
tidal's broker has stayed near 0.4-0.5x through many rounds of optimisation. This script asks how far the
*design* (an asyncio process on uvloop, a ROUTER socket, msgpack frames, a journal written before each
acknowledgement) could go, by measuring the least a broker path of that design must do:

- **producers** (2, uvloop, DEALER): a standing lease request; each pushed lease of ``--per-lease``
  groups is encoded into a ring of shared memory (or sent over the wire, ``floor_wire``) and submitted as
  one message naming where the frames lie; acknowledgements are cumulative.
- **broker** (uvloop, ROUTER, one wake-up drains up to 64 messages): pushes leases up to each producer's
  credit under AReaL's admission rule as tidal's broker applies it (``leased + accepted <= (eta + version
  + 1) * batch_groups``, accepted counted since the start),
  checks each group frame (tidal's ``inspect_group``), appends it to a journal with a CRC-32 through
  tidal's O_DIRECT writer once per wake-up, acknowledges only after that write, and cuts batches of
  ``--batch-groups`` groups for the consumer. No membership, lease expiry, records of leases, statistics
  or compaction: everything else tidal's broker does is left out.
- **consumer** (DEALER): asks for the next batch before it copies this one out of the rings (as tidal's
  local consumer copies from its mapping of the rings) and decodes it (tidal's ``decode_group``: the
  ``Sample`` objects the trainer packs), then publishes a version as the trainer does after a step.

Variants (``--variants``; each against raw pyzmq in the same round):

- ``tidal``: tidal's broker path as ``broker_throughput.py`` runs it (the real thing, for reference);
- ``floor``: the least plumbing above, with tidal's codec;
- ``floor_free_encode``: encoding is one copy of a template frame (a native encoder's least work);
- ``floor_free_codec``: that, and no decoding (the consumer counts samples): a codec costing nothing but
  the copies;
- ``floor_wire``: ``floor`` with frames over the wire both ways instead of shared memory.

The table shows medians over ``--repeats`` rounds, the ratio to raw pyzmq paired within each round, and
the CPU microseconds per sample of every process (producers, broker, consumer; ZeroMQ's I/O threads
included). Not a component of tidal: a measuring stick for the decision recorded in docs/decisions.md.

    .venv/bin/python benchmarks/broker_floor.py --repeats 3 --out runs/bench/broker_floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import uvloop
import zmq
from isal.isal_zlib import crc32

from tidal.broker.codec import decode_group, encode_group, inspect_group
from tidal.broker.config import BrokerConfig
from tidal.broker.journal_writers import DirectWriter
from tidal.procs import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker_baselines import PRODUCERS, run_zmq, sample_arrays  # noqa: E402
from broker_method import BrokerOptions, _group, run_broker  # noqa: E402
from interpreter_build import describe, interpreter_build  # noqa: E402

VARIANTS = ("tidal", "floor", "floor_free_encode", "floor_free_codec", "floor_wire")
DRAIN_BATCH = 64
pack, unpack = msgpack.packb, msgpack.unpackb


@dataclass
class Setup:
    tokens: int
    groups_per_producer: int
    group_size: int
    per_lease: int
    credit: int  # groups a producer may have leased and unacknowledged
    batch_groups: int
    max_staleness: int
    shared_memory: bool
    free_encode: bool
    decode: bool


def _map(path: str) -> np.ndarray:
    with open(path, "r+b") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0), np.uint8)


# ---------------------------------------------------------------------------------------------- broker
def _broker(port: int, journal_dir: str, s: Setup, ready, stopped, cpu) -> None:
    async def main() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        for opt in (zmq.RCVHWM, zmq.SNDHWM, zmq.LINGER):
            sock.setsockopt(opt, 0)
        sock.bind(f"tcp://127.0.0.1:{port}")
        loop = asyncio.get_running_loop()
        journal = DirectWriter(Path(journal_dir) / "journal.log", 0)
        rings: dict[str, np.ndarray] = {}
        buffered: deque[Any] = deque()  # accepted groups: where their frames lie, or the frames themselves
        staged: list[Any] = []  # journal parts of this wake-up
        acks: dict[bytes, int] = {}  # producer -> last submit handled in this wake-up
        credit: dict[bytes, int] = {}
        waiting: deque[tuple[bytes, int]] = deque()  # batch requests
        counts = {"version": 0, "leased": 0, "accepted": 0, "taken": 0, "batch": 0}
        done = asyncio.Event()
        scheduled = [False]

        def room() -> int:
            bound = (s.max_staleness + counts["version"] + 1) * s.batch_groups
            return bound - counts["leased"] - counts["accepted"]

        def push_leases() -> None:
            for peer, c in credit.items():
                while c >= s.per_lease and room() >= s.per_lease:
                    first = counts["taken"]
                    counts["taken"] += s.per_lease
                    counts["leased"] += s.per_lease
                    c -= s.per_lease
                    ids = [f"0:{i}" for i in range(first, first + s.per_lease)]
                    sock.send_multipart([peer, pack({"t": "lease", "ids": ids})], copy=False)
                credit[peer] = c

        def accept(peer: bytes, frame: Any, where: Any) -> None:
            inspect_group(frame)  # the broker's check of every frame
            payload = memoryview(frame.buffer if isinstance(frame, zmq.Frame) else frame)
            head = len(payload).to_bytes(4, "little") + crc32(payload).to_bytes(4, "little")
            staged.extend((head, payload))
            buffered.append(where)
            counts["leased"] -= 1
            counts["accepted"] += 1
            credit[peer] += 1

        def handle(peer: bytes, frames: list[zmq.Frame]) -> None:
            msg = unpack(frames[0].buffer)
            kind = msg["t"]
            if kind == "submit":
                if "spans" in msg:
                    ring = rings.get(msg["ring"])
                    if ring is None:
                        ring = rings[msg["ring"]] = _map(msg["ring"])
                    for at, size in msg["spans"]:
                        accept(peer, ring[at : at + size], (msg["ring"], at, size))
                else:
                    for f in frames[1:]:
                        accept(peer, f, f)
                acks[peer] = msg["id"]
            elif kind == "credit":
                credit[peer] = msg["credit"]
            elif kind == "get":
                waiting.append((peer, msg["id"]))
            elif kind == "version":
                counts["version"] = msg["version"]
            elif kind == "stop":
                done.set()

        def cut_batches() -> None:
            while waiting and len(buffered) >= s.batch_groups:
                peer, rid = waiting.popleft()
                groups = [buffered.popleft() for _ in range(s.batch_groups)]
                staged.append(pack(["batch", counts["batch"]]))
                head = {"t": "batch", "id": rid, "batch": counts["batch"]}
                if s.shared_memory:
                    sock.send_multipart([peer, pack({**head, "refs": groups})], copy=False)
                else:
                    sock.send_multipart([peer, pack(head), *groups], copy=False)
                counts["batch"] += 1

        def drain() -> None:
            scheduled[0] = False
            if sock.closed:
                return
            received = 0
            while received < DRAIN_BATCH:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                handle(frames[0].bytes, frames[1:])
                received += 1
            sent = counts["batch"] + counts["taken"]
            cut_batches()
            if staged:  # durable before any acknowledgement of what it holds
                journal.write(staged)
                staged.clear()
            for peer, through in acks.items():
                sock.send_multipart([peer, pack({"t": "ack", "through": through})], copy=False)
            push_leases()
            # more may be waiting, or a send may have consumed the edge of a message that arrived meanwhile
            if received == DRAIN_BATCH or acks or counts["batch"] + counts["taken"] != sent:
                kick()
            acks.clear()

        def kick() -> None:
            if not scheduled[0]:
                scheduled[0] = True
                loop.call_soon(drain)

        loop.add_reader(sock.getsockopt(zmq.FD), drain)
        ready.set()
        c0 = time.process_time()
        await done.wait()
        seconds = time.process_time() - c0
        loop.remove_reader(sock.getsockopt(zmq.FD))
        journal.close()
        cpu.put(("broker", seconds, journal.size))
        sock.close(0)
        ctx.term()
        stopped.set()

    uvloop.run(main())


# -------------------------------------------------------------------------------------------- producer
def _producer(port: int, ring_path: str, ring_bytes: int, s: Setup, go, cpu) -> None:
    async def main() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        for opt in (zmq.RCVHWM, zmq.SNDHWM):
            sock.setsockopt(opt, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        loop = asyncio.get_running_loop()
        arrays = sample_arrays(s.tokens)
        template = encode_group(_group("0:0", arrays, s.group_size))
        ring, head = _map(ring_path), 0
        leases: deque[list[str]] = deque()
        acked, news = [0], asyncio.Event()

        def alloc(nbytes: int) -> np.ndarray:
            nonlocal head
            if head + nbytes > ring_bytes:  # the ring holds many times what admission lets be in flight
                head = 0
            start, head = head, head + -(-nbytes // 64) * 64
            return ring[start : start + nbytes]

        def read() -> None:
            while True:
                try:
                    msg = unpack(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    return
                if msg["t"] == "lease":
                    leases.append(msg["ids"])
                else:
                    acked[0] = msg["through"]
                news.set()

        async def until(ready) -> None:
            while not ready():
                news.clear()
                read()
                if not ready():
                    await news.wait()

        def encode(gid: str, out=None) -> np.ndarray:
            if s.free_encode:
                frame = template if out is None else out(len(template))
                if out is not None:
                    frame[:] = template
                return frame
            return encode_group(_group(gid, arrays, s.group_size), out)

        loop.add_reader(sock.getsockopt(zmq.FD), read)
        go.wait()
        c0 = time.process_time()
        sock.send(pack({"t": "credit", "credit": s.credit}))
        sent = rid = 0
        while sent < s.groups_per_producer:
            await until(lambda: bool(leases))
            ids = leases.popleft()
            rid += 1
            if s.shared_memory:
                spans = []
                for gid in ids:
                    frame = encode(gid, alloc)
                    spans.append([frame.ctypes.data - ring.ctypes.data, len(frame)])
                sock.send(pack({"t": "submit", "id": rid, "ring": ring_path, "spans": spans}))
            else:
                frames = [encode(gid) for gid in ids]
                sock.send_multipart([pack({"t": "submit", "id": rid}), *frames], copy=False)
            sent += len(ids)
            read()
        await until(lambda: acked[0] >= rid)
        cpu.put(("producers", time.process_time() - c0, 0))
        loop.remove_reader(sock.getsockopt(zmq.FD))
        sock.close(0)
        ctx.term()

    uvloop.run(main())


# -------------------------------------------------------------------------------------------- consumer
def run_floor(s: Setup, workdir: Path) -> tuple[float, int, dict[str, float], int]:
    """One run of the least plumbing: seconds, samples received, CPU seconds by process, and the bytes
    its broker journaled."""
    port = free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="floor-", dir=workdir))
    frame_bytes = len(encode_group(_group("0:0", sample_arrays(s.tokens), s.group_size)))
    in_flight = (s.max_staleness + 2) * s.batch_groups + PRODUCERS * s.credit
    ring_bytes = 4 * in_flight * (frame_bytes + 64)
    rings = []
    for i in range(PRODUCERS):
        path = f"/dev/shm/tidal-floor-{os.getpid()}-{i}"
        with open(path, "wb") as f:
            f.truncate(ring_bytes)
        rings.append(path)
    spawn = mp.get_context("spawn")  # fresh interpreters: no fork of a process that runs threads
    ready, stopped, go, cpu = spawn.Event(), spawn.Event(), spawn.Event(), spawn.Queue()
    procs = [spawn.Process(target=_broker, args=(port, str(run_dir), s, ready, stopped, cpu))]
    procs[0].start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.RCVTIMEO, 120_000)  # a process died: zmq.Again, not a hang
    try:
        if not ready.wait(60):
            raise RuntimeError("the floor broker did not start within 60 s")
        for path in rings:
            procs.append(spawn.Process(target=_producer, args=(port, path, ring_bytes, s, go, cpu)))
            procs[-1].start()
        sock.connect(f"tcp://127.0.0.1:{port}")
        mapped: dict[str, np.ndarray] = {}
        batches = s.groups_per_producer * PRODUCERS // s.batch_groups
        time.sleep(0.5)
        go.set()
        t0, c0 = time.perf_counter(), time.process_time()
        received = 0
        sock.send(pack({"t": "get", "id": 0}))
        for i in range(batches):
            reply = sock.recv_multipart(copy=False)
            if i + 1 < batches:
                sock.send(pack({"t": "get", "id": i + 1}))
            head = unpack(reply[0].buffer)
            if "refs" in head:
                frames = []
                for path, at, size in head["refs"]:
                    ring = mapped.get(path)
                    if ring is None:
                        ring = mapped[path] = _map(path)
                    frames.append(ring[at : at + size].copy())
            else:
                frames = reply[1:]
            if s.decode:
                received += sum(len(decode_group(f).samples) for f in frames)
            else:
                received += s.group_size * len(frames)
            sock.send(pack({"t": "version", "version": i + 1}))
        elapsed, consumer = time.perf_counter() - t0, time.process_time() - c0
        sock.send(pack({"t": "stop"}))
        cpu_s = {"producers": 0.0, "broker": 0.0, "consumer": consumer}
        journaled = 0
        for _ in procs:
            role, seconds, nbytes = cpu.get(timeout=60)
            cpu_s[role] += seconds
            journaled += nbytes
        stopped.wait(60)
        return elapsed, received, cpu_s, journaled
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        sock.close(0)
        ctx.term()
        for path in rings:
            Path(path).unlink(missing_ok=True)
        shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- driver
def setup_for(variant: str, args: argparse.Namespace) -> Setup:
    groups = int(args.samples) // args.group_size // PRODUCERS
    return Setup(
        tokens=args.tokens,
        groups_per_producer=groups - groups % math.lcm(args.per_lease, args.batch_groups),
        group_size=args.group_size,
        per_lease=args.per_lease,
        credit=args.per_lease * args.in_flight,
        batch_groups=args.batch_groups,
        max_staleness=args.max_staleness,
        shared_memory=variant != "floor_wire",
        free_encode=variant in ("floor_free_encode", "floor_free_codec"),
        decode=variant != "floor_free_codec",
    )


def run_variant(variant: str, args: argparse.Namespace, workdir: Path) -> tuple[float, int, dict[str, float]]:
    """Seconds, samples received and CPU seconds by process of one run of ``variant``."""
    if variant == "tidal":
        opts = BrokerOptions(
            group_size=args.group_size,
            per_lease=args.per_lease,
            in_flight=args.in_flight,
            batch_groups=args.batch_groups,
            max_staleness=args.max_staleness,
        )
        elapsed, got, cpu, _ = run_broker(args.tokens, int(args.samples), workdir, opts)
        return elapsed, got, cpu
    elapsed, got, cpu, _ = run_floor(setup_for(variant, args), workdir)
    return elapsed, got, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--samples", type=float, default=4e5, help="samples per run (every method)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds: raw pyzmq, then every variant")
    ap.add_argument("--group-size", type=int, default=8, help="samples per group")
    ap.add_argument("--per-lease", type=int, default=4, help="groups per lease and per submit")
    ap.add_argument("--in-flight", type=int, default=4, help="leases a producer may hold unacknowledged")
    ap.add_argument("--batch-groups", type=int, default=BrokerConfig().batch_groups)
    ap.add_argument("--max-staleness", type=int, default=BrokerConfig().max_staleness)
    ap.add_argument("--out", type=Path, default=None, help="write the runs and the summary as JSON here")
    args = ap.parse_args(argv)
    interpreter = interpreter_build()

    workdir = Path(tempfile.mkdtemp(prefix="broker-floor-"))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in ("zmq", *args.variants)}
    try:
        for rnd in range(args.repeats):
            for method in runs:
                if method == "zmq":
                    elapsed, got, cpu, _ = run_zmq(args.tokens, int(args.samples), workdir)
                else:
                    elapsed, got, cpu = run_variant(method, args, workdir)
                cpu_us = {k: v / got * 1e6 for k, v in cpu.items()}
                runs[method].append({"samples_per_s": got / elapsed, "cpu_us_per_sample": cpu_us})
                shown = " ".join(f"{k} {v:.1f}" for k, v in cpu_us.items())
                print(
                    f"  round {rnd} {method:<18} {got / elapsed:>9.0f} samples/s   CPU us/sample: {shown}"
                    f" (total {sum(cpu_us.values()):.1f})",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarise(runs)
    print_summary(summary, args)
    print(f"interpreter: {describe(interpreter)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "interpreter": interpreter,
                    "runs": runs,
                    "summary": summary,
                },
                indent=2,
            )
        )
        print(f"wrote {args.out}")
    return 0


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for method, rs in runs.items():
        roles = rs[0]["cpu_us_per_sample"]
        row: dict[str, Any] = {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
            "cpu_us_per_sample": {k: statistics.median(r["cpu_us_per_sample"][k] for r in rs) for k in roles},
        }
        # within a round the runs ran back to back under about the same load: the steadier ratio
        ratios = [r["samples_per_s"] / z["samples_per_s"] for r, z in zip(rs, runs["zmq"], strict=True)]
        row["vs_zmq_paired"] = statistics.median(ratios)
        row["vs_zmq_range"] = [min(ratios), max(ratios)]
        out[method] = row
    return out


def print_summary(summary: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.tokens} tokens, {args.group_size}-sample groups, {args.per_lease} a lease, batches of"
        f" {args.batch_groups}, eta {args.max_staleness}; medians of {args.repeats} round(s)"
    )
    print(
        f"{'method':<18} | {'samples/s':>9} | {'/ raw (paired)':>14} | {'min-max':>11} | CPU us/sample by process"
    )
    for method, row in summary.items():
        cpu = row["cpu_us_per_sample"]
        parts = " + ".join(f"{k} {v:.1f}" for k, v in cpu.items())
        lo, hi = row["vs_zmq_range"]
        print(
            f"{method:<18} | {row['samples_per_s']:>9.0f} | {row['vs_zmq_paired']:>14.2f} | {lo:.2f}-{hi:.2f}"
            f" | {parts} = {sum(cpu.values()):.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())

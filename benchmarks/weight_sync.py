"""GB/s of a full weight sync (trainer -> engines) beside a raw broadcast of the same bytes, same transport.

For each model size a Qwen3-style model is sized to the target bytes; its full megatron-core tensors
(fused QKV, fused gate/up) are the trainer's state. A sync converts them to Hugging Face tensors
(``convert``), packs flattened buckets (``pack``) and broadcasts them to ``--engines`` receiver
processes while announcing each bucket over HTTP (``transfer``); the receivers report the time they
spend copying into their weights (``load``). ``gather`` is the TP all-gather: zero with ``--tp 1`` (one trainer
rank holding full tensors); ``--tp 2`` builds a real megatron-core model on a TP2 mesh under torchrun
and the sync all-gathers its shards.
The ceiling (``raw``) broadcasts buffers of the same sizes over the same group with no HTTP, packing
or conversion, twice after every sync: from one reused buffer into one (each side's largest bucket, kept
warm in cache: the figure of every session before 10) and from and into distinct memory, the model's size
on each side, as the sync's bytes go from the trainer's parameters into the engine's weights (the last
three columns). Each method runs ``--repeats`` times, interleaved; the table shows medians.

    .venv/bin/python benchmarks/weight_sync.py --out runs/bench/weight_sync.json
    .venv/bin/python benchmarks/weight_sync.py --sizes-mb 10 --repeats 1        # quick look
    .venv/bin/python benchmarks/weight_sync.py --tp 2 --sizes-mb 10 100 500     # with the TP all-gather

Engines are ``tidal.weights_sync.receiver_server`` (the routes without a model, ``load`` is a copy into
a dict of tensors) or, with ``--engine serve``, real ``tidal serve`` engines started per size with the
same Qwen3 architecture (``load`` is the engine's: checks, a hand-off to its scheduler thread, copies into
the model's parameters); ``--backend nccl --device cuda`` runs the same on GPUs. ``load`` counts only
what was not received in place (``in_place_bytes`` in the JSON: tensors sent on broadcasts of their own).

``--variants`` compares sender settings in one run, interleaved, each paired with its own raw broadcast:
``default`` (as configured), ``packed`` (no tensor on a broadcast of its own: every byte packed by the
sender and copied by the engine's load), ``serial`` (packed, one bucket at a time: what SGLang gets), or
``key=value`` settings (``own=MIB,bucket=MIB,first=MIB,inflight=N``). An engine keeps the last plan it
was announced, and each variant cuts its own buckets, so with two or more variants every sync is announced,
none replayed (replay.py): such a run compares the variants with each other; a run of the default alone
measures what a trainer's syncs cost.

    .venv/bin/python benchmarks/weight_sync.py --engine serve --sizes-mb 100 500 2000 --repeats 5 \
        --variants default packed serial --out runs/bench/weight_sync_serve.json

``--fixed-cost`` first syncs two models of hidden 64 whose bytes take next to no time to move: one layer
(what every sync costs: the control calls, an announcement, the replies; ``open`` and ``close`` split out
pause + begin and end + resume) and 36 layers (~400 tensors, what each tensor adds: convert, pack,
announcement, checks, load), and prints both figures; on GPUs that cost, not the bytes, bounds the ratio
below a few GB.

    .venv/bin/python benchmarks/weight_sync.py --engine serve --fixed-cost --sizes-mb 100 --repeats 7

``--sender-host`` measures, without engines, the sender's own host time per tensor for the 36-layer model:
the source's conversion alone, a sync planned afresh (what every sync cost before ``sync_plan.py``) and a
replayed one (cutting buckets, ordering broadcasts, packing), alternated; on GPUs this per-tensor time, not the
bytes, bounds syncs of many small tensors.

    .venv/bin/python benchmarks/weight_sync.py --sender-host --sizes-mb
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from tidal.model_config import ModelConfig
from tidal.procs import free_port, stop
from tidal.weights_sync import bucket
from tidal.weights_sync.config import WeightSyncConfig
from tidal.weights_sync.engine_api import EngineEndpoint
from tidal.weights_sync.gather import GatherTimes
from tidal.weights_sync.sender import WeightSender, raw_broadcast
from tidal.weights_sync.sync_plan import SyncPlan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync_setup import (  # noqa: E402
    FIXED_COST_LAYERS,
    local_source,
    megatron_source,
    model_bytes,
    model_for_bytes,
    start_receivers,
    tiny_model,
)

# The benchmark's own bookkeeping over HTTP (stats, CPU counters) goes through one client: a one-off
# ``httpx.get`` builds a client and an SSL context each time, cyclic garbage whose collection (freeing the
# contexts) took 10-16 ms, and fell inside half of the timed 10 MB syncs. ``_collect`` runs before every
# timed call, sync and raw alike, so that neither pays for the garbage of what ran before it.
_HTTP = httpx.Client(timeout=30)


def _collect() -> None:
    gc.collect()


# --variants: sender settings compared in one run, interleaved (each against its own raw broadcast)
VARIANTS = {
    "default": {},  # the configuration as given (pipelined, large tensors on their own broadcasts)
    "packed": {"own_broadcast_bytes": None},  # pipelined, every tensor packed and loaded by copy
    "serial": {"own_broadcast_bytes": None, "inflight_buckets": 1},  # one bucket at a time, as SGLang
}


_VARIANT_KEYS = {  # key=MIB settings of a variant, e.g. own=8,bucket=256
    "own": "own_broadcast_bytes",
    "bucket": "bucket_bytes",
    "first": "first_bucket_bytes",
    "max": "segmented_bucket_bytes",
}


def _variant(name: str) -> dict:
    """Comma-separated VARIANTS names and key=value settings: own=MIB (tensors of at least MIB on broadcasts of
    their own), bucket=MIB, first=MIB (first bucket), inflight=N."""
    update: dict = {}
    for part in name.split(","):
        key, _, value = part.partition("=")
        if part in VARIANTS:
            update |= VARIANTS[part]
        elif key == "inflight":
            update["inflight_buckets"] = int(value)
        else:
            update[_VARIANT_KEYS[key]] = int(float(value) * (1 << 20))
    return update


def _variant_name(name: str) -> str:
    try:
        _variant(name)
    except (KeyError, ValueError) as exc:
        raise argparse.ArgumentTypeError(
            f"{name!r}: choose one of {list(VARIANTS)} or key=value[,key=value] with keys "
            f"{[*_VARIANT_KEYS, 'inflight']} (e.g. own=8,bucket=256)"
        ) from exc
    return name


def run_size(sender: WeightSender, urls: list[str], target: int, model: ModelConfig, args) -> list[dict]:
    """Medians for one model size, one result per ``--variants`` entry; [] on the ranks that only help
    gather.

    One unmeasured sync per variant first (it builds the group on the first size and lets both sides
    allocate their buffers and the engine its weights, as a trainer's first sync does); then ``--repeats``
    rounds, each a full sync of every variant followed by a raw broadcast of the same buckets, back to
    back so that both see the same machine load.
    """
    make = megatron_source(model, args) if args.tp > 1 else local_source(model, args)
    tensors = sum(1 for _ in make(GatherTimes())) if args.tp == 1 else None  # Hugging Face tensors
    base = sender.config
    configs = {v: base.model_copy(update=_variant(v)) for v in args.variants}
    runs = {v: ([], [], [], []) for v in args.variants}  # full, raw, raw_cpu, raw from distinct memory
    version = 0
    for config in configs.values():
        sender.config = config
        warm = _checked(sender.sync(lambda: make(GatherTimes()), version=version))
    if sender.is_sender:  # both sides allocate the raw broadcasts' distinct memory outside the measurement
        raw_broadcast(sender, warm.bucket_sizes, distinct=True)
    order = list(configs.items())
    for repeat in range(args.repeats):
        # each round starts with another variant: the first sync of a round runs slower at small sizes
        for v, config in order[repeat % len(order) :] + order[: repeat % len(order)]:
            sender.config = config
            version += 1
            full, raw, raw_cpu, raw_distinct = runs[v]
            for url in urls if sender.is_sender else []:
                _HTTP.post(f"{url}/tidal/reset_stats", json={}).raise_for_status()
            times = GatherTimes()
            _synchronize(args.device)
            _collect()
            cpu0 = _cpu_s(urls) if sender.is_sender else 0.0
            report = _checked(sender.sync(lambda times=times: make(times), version=version))
            if not sender.is_sender:
                continue
            cpu1 = _cpu_s(urls)
            stats = [_HTTP.get(f"{u}/tidal/stats").json() for u in urls]
            full.append(
                dict(
                    wall_s=report.wall_s,
                    gather_s=times.gather_s,
                    convert_s=times.convert_s,
                    pack_s=report.pack_s,
                    transfer_s=report.transfer_s,
                    open_s=report.open_s,
                    close_s=report.close_s,
                    load_s=max(s["load_s"] for s in stats),
                    in_place_bytes=min(s["in_place_bytes"] for s in stats),
                    cpu_s=cpu1 - cpu0,
                    bytes=report.bytes,
                    buckets=report.buckets,
                    replayed=int(report.replayed),
                    tensors=tensors,
                )
            )
            # the same broadcasts, bare: from one reused buffer into one (cache-warm), then from and into
            # distinct memory as the sync's bytes go; the reused one first in every other round
            for distinct in (False, True) if repeat % 2 == 0 else (True, False):
                _collect()
                if distinct:
                    raw_distinct.append(raw_broadcast(sender, report.bucket_sizes, distinct=True))
                else:
                    cpu2 = _cpu_s(urls)
                    raw.append(raw_broadcast(sender, report.bucket_sizes))
                    raw_cpu.append(_cpu_s(urls) - cpu2)
    sender.config = base
    if not sender.is_sender:
        return []
    return [_summary(v, *runs[v], target, model, args) for v in args.variants]


def _summary(
    variant: str,
    full: list[dict],
    raw: list[float],
    raw_cpu: list[float],
    raw_distinct: list[float],
    target,
    model,
    args,
) -> dict:
    nbytes = full[0]["bytes"]
    med = {k: statistics.median(r[k] for r in full) for k in full[0]}
    raw_s = statistics.median(raw)
    distinct_s = statistics.median(raw_distinct)
    return dict(
        variant=variant,
        target_mb=target / (1 << 20),
        bytes=nbytes,
        layers=model.num_hidden_layers,
        tensors=full[0]["tensors"],
        hidden=model.hidden_size,
        tp=args.tp,
        trainer_layout=args.trainer_layout,
        engine_set=args.engine_set,
        sync=med,
        sync_gbps=nbytes / med["wall_s"] / 1e9,
        raw_s=raw_s,
        raw_gbps=nbytes / raw_s / 1e9,
        ratio=raw_s / med["wall_s"],
        # each sync against the raw broadcast right after it (less exposed to load that changes)
        paired_ratio=statistics.median(r / f["wall_s"] for f, r in zip(full, raw, strict=True)),
        # against raw broadcasts from and into distinct memory, as the sync's bytes go (the reused buffer
        # stays partly in cache: at 500 MB on the 2-core CPU host it ran ~13% faster)
        raw_distinct_s=distinct_s,
        raw_distinct_gbps=nbytes / distinct_s / 1e9,
        ratio_distinct=distinct_s / med["wall_s"],
        paired_ratio_distinct=statistics.median(
            r / f["wall_s"] for f, r in zip(full, raw_distinct, strict=True)
        ),
        # CPU seconds (this process and the receivers, all threads) per GB moved: what the sync adds
        # to the bare transfer, which on a small shared CPU is what slows it
        sync_cpu_s_per_gb=med["cpu_s"] / (nbytes / 1e9),
        raw_cpu_s_per_gb=statistics.median(raw_cpu) / (nbytes / 1e9),
        runs=dict(sync=full, raw=raw, raw_cpu_s=raw_cpu, raw_distinct=raw_distinct),
    )


def _cpu_s(urls: list[str]) -> float:
    """CPU seconds used so far by this process and the receivers (tp=1: the sender is all of the trainer)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    engines = sum(_HTTP.get(f"{u}/tidal/stats").json()["cpu_s"] for u in urls)
    return usage.ru_utime + usage.ru_stime + engines


def _checked(report):
    if not report.ok or report.dropped:
        raise RuntimeError(f"sync failed: {report}")
    return report


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes-mb",
        type=float,
        nargs="*",
        default=[10, 100, 500, 2000],
        help="model sizes (none: only --fixed-cost)",
    )
    p.add_argument(
        "--fixed-cost",
        action="store_true",
        help="first a model of ~0.3 MB: its sync time is the protocol's fixed cost per sync (pause, begin, "
        "announcements, end, resume; the open and close columns split out the control calls), beside a "
        "raw broadcast of its bytes",
    )
    p.add_argument(
        "--sender-host",
        action="store_true",
        help="first the sender's own host time per tensor (no engine): planned afresh against replayed",
    )
    p.add_argument("--engines", type=int, default=1)
    p.add_argument(
        "--engine",
        default="standin",
        choices=["standin", "serve"],
        help="standin: receiver_server (no model); serve: tidal serve engines holding the model",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of the sender and receivers (memcpy-bound; more threads oversubscribe "
        "a small shared CPU)",
    )
    p.add_argument("--tp", type=int, default=1, help="> 1: a megatron-core model on a TP mesh (torchrun)")
    p.add_argument("--bucket-mb", type=int, default=None, help="WeightSyncConfig.bucket_bytes (default: its)")
    p.add_argument(
        "--first-bucket-mb", type=int, default=None, help="WeightSyncConfig.first_bucket_bytes (default: its)"
    )
    p.add_argument(
        "--inflight",
        type=int,
        default=None,
        help="WeightSyncConfig.inflight_buckets (1: one announcement at a time)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--variants",
        nargs="+",
        default=["default"],
        type=_variant_name,
        help="sender settings to compare in one run, interleaved: default (as configured), packed (no "
        "tensor on its own broadcast: every byte packed and copied at load), serial (packed, one bucket "
        "at a time), or key=value[,key=value]: own=MIB (tensors of at least MIB on broadcasts of their own), "
        "bucket=MIB, first=MIB, inflight=N",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument(
        "--no-replay",
        action="store_true",
        help="announce every sync (WeightSyncConfig.replay_updates=false), as before session 9",
    )
    p.add_argument(
        "--engine-set",
        nargs="+",
        metavar="KEY=VALUE",
        default=[],
        help="rollout.engine settings of the --engine serve engines, e.g. relayout_weights=true",
    )
    p.add_argument(
        "--trainer-layout",
        default="ddp",
        choices=["ddp", "separate"],
        help="the one-rank trainer's tensors: views into one buffer as megatron's DDP with the distributed "
        "optimizer keeps them (last parameter first), or one allocation each (before session 9)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="skip the remaining sizes once the next one (estimated from the last, scaled by size) would "
        "end past this many seconds from the start",
    )
    args = p.parse_args()
    _check_devices(p, args)
    if not args.sizes_mb and not args.fixed_cost and not args.sender_host:
        p.error("nothing to measure: give --sizes-mb MB [MB ...], --fixed-cost or --sender-host")
    if args.sender_host and args.tp > 1:
        p.error("--sender-host measures one sender rank holding full tensors: drop --tp or --sender-host")

    if args.tp > 1 and "RANK" not in os.environ:  # run this script under torchrun, one rank per TP shard
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.tp}"]
        cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__, *sys.argv[1:]]
        os.execv(sys.executable, cmd)
    torch.set_num_threads(args.threads)
    rank = 0
    if args.tp > 1:
        from tidal.trainer import parallel

        rank, _ = parallel.init_distributed()
    logdir = Path(args.out.parent if args.out else "runs/bench") / "weight_sync_logs"
    # with NCCL the sender's ranks hold GPUs 0..tp-1 and the engines the next ones (_check_devices)
    first_gpu = max(args.tp, 1) if args.backend == "nccl" else None
    config = WeightSyncConfig(
        bucket_bytes=args.bucket_mb << 20 if args.bucket_mb else None,
        first_bucket_bytes=args.first_bucket_mb << 20 if args.first_bucket_mb else None,
        timeout_s=600,
        replay_updates=not args.no_replay,
        **({"inflight_buckets": args.inflight} if args.inflight else {}),
    )

    def connect(model: ModelConfig | None):
        """Engines (on rank 0) and a sender to them (every rank)."""
        procs, urls = start_receivers(args.engines, logdir, args, model, first_gpu) if rank == 0 else ([], [])
        if args.tp > 1:
            shared = [urls]
            torch.distributed.broadcast_object_list(shared, src=0)
            urls = shared[0]
        sender = WeightSender(
            config,
            [EngineEndpoint(u) for u in urls],
            is_sender=rank == 0,
            backend=args.backend,
            device=args.device,
        )
        return procs, urls, sender

    def disconnect(procs, sender) -> None:
        sender.close()
        for proc in procs:
            stop(proc, timeout_s=5)

    host = sender_host_cost(args) if args.sender_host else None
    # stand-ins take any tensors: one set for all sizes; a serve engine holds one model: a set per size
    engines_needed = bool(args.sizes_mb or args.fixed_cost)
    procs, urls, sender = connect(None) if args.engine == "standin" and engines_needed else ([], [], None)
    results, skipped = [], []
    start, last = time.perf_counter(), None  # last: (MB, seconds) of the previous size
    try:
        dtype_bytes = getattr(torch, args.dtype).itemsize
        models = [(model_bytes(m, dtype_bytes), m) for m in map(tiny_model, FIXED_COST_LAYERS)]
        models = models if args.fixed_cost else []
        models += [
            (int(mb * (1 << 20)), model_for_bytes(int(mb * (1 << 20)), dtype_bytes)) for mb in args.sizes_mb
        ]
        for i, (target, model) in enumerate(models):
            mb = target / (1 << 20)
            if _out_of_time(args, start, last, mb):
                skipped = [round(t / (1 << 20), 3) for t, _ in models[i:]]
                if rank == 0:
                    print(f"--max-seconds {args.max_seconds:g}: skipped sizes {skipped} MB", flush=True)
                break
            t0 = time.perf_counter()
            if args.engine == "serve":
                procs, urls, sender = connect(model)
            try:
                sized = run_size(sender, urls, target, model, args)
            finally:
                if args.engine == "serve":
                    disconnect(procs, sender)
                    procs, sender = [], None
            if target >= 1 << 20:  # the --fixed-cost models' time does not scale with their bytes
                last = (mb, time.perf_counter() - t0)
            _print(sized, header=not results)
            results.extend(sized)
    finally:
        if sender is not None:
            disconnect(procs, sender)
    if rank != 0:
        return 0
    if args.fixed_cost:
        _print_fixed_cost(results)
    meta = dict(
        engine=args.engine,
        engines=args.engines,
        first_bucket_bytes=config.bucket_sizes(args.backend)[0],
        bucket_bytes=config.bucket_sizes(args.backend)[1],
        inflight_buckets=config.inflight_buckets,
        repeats=args.repeats,
        dtype=args.dtype,
        tp=args.tp,
        trainer_layout=args.trainer_layout,
        threads=args.threads,
        backend=args.backend,
        device=args.device,
        torch=torch.__version__,
        skipped_sizes_mb=skipped,
        gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if args.device.startswith("cuda")
        else [],
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(meta=meta, sender_host=host, results=results), indent=1))
        print(f"wrote {args.out}")
    return 0


def _check_devices(parser: argparse.ArgumentParser, args) -> None:
    """NCCL refuses two ranks of one group on one GPU: the sender's ranks and each engine need their own."""
    if args.backend == "nccl" and not args.device.startswith("cuda"):
        parser.error(
            f"--backend nccl moves CUDA tensors only: add --device cuda (got --device {args.device})"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device on this host; use --device cpu --backend gloo")
    if args.backend == "nccl":
        need = max(args.tp, 1) + args.engines
        have = torch.cuda.device_count()
        if have < need:
            parser.error(
                f"--backend nccl needs one GPU per rank: {max(args.tp, 1)} sender rank(s) + {args.engines} "
                f"engine(s) = {need} GPUs, this host has {have}; use --backend gloo (CPU tensors) on fewer GPUs"
            )


def sender_host_cost(args, rounds: int = 40) -> dict:
    """Host (thread CPU) seconds per sync of the sender's own work for the 36-layer model, no engine: the
    source's conversion alone; converting, cutting buckets, planning and packing with a fresh plan (every sync
    before the plan was recorded); the same replaying the recorded plan. Medians of alternated rounds."""
    model = tiny_model(FIXED_COST_LAYERS[-1])
    make = local_source(model, args)
    config = WeightSyncConfig()
    first, size = config.bucket_sizes(args.backend)
    own, most = config.own_bytes(args.backend), config.segmented_bytes(args.backend)

    def stream(items):
        return bucket.stream_buckets(
            items,
            size,
            first,
            packed=lambda t: not (isinstance(t, torch.Tensor) and t.is_contiguous() and t.nbytes >= own),
            max_bytes=most,
        )

    staging = torch.empty(size, dtype=torch.uint8, device=args.device)
    recorded = SyncPlan()

    def send(plan: SyncPlan) -> None:
        for items, recipe, spans in plan.buckets(make(GatherTimes()), ("bench",), stream, own):
            recipe.payload(items, spans, staging)

    def convert() -> None:
        for _ in make(GatherTimes()):
            pass

    ways = {"convert": convert, "planned": lambda: send(SyncPlan()), "replayed": lambda: send(recorded)}
    send(recorded)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            _synchronize(args.device)
            t0 = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t0)
            _synchronize(args.device)
    tensors = sum(1 for _ in make(GatherTimes()))
    out = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"sender host time per tensor ({tensors} tensors, medians of {rounds}): convert "
        f"{out['convert'] / tensors * 1e6:.1f} us, planned {out['planned'] / tensors * 1e6:.1f} us, replayed "
        f"{out['replayed'] / tensors * 1e6:.1f} us (each including the conversion); per sync "
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in out.items()),
        flush=True,
    )
    return dict(tensors=tensors, rounds=rounds, seconds=out)


def _print_fixed_cost(results: list[dict]) -> None:
    """What a sync costs besides moving bytes, from the --fixed-cost models (medians, per variant)."""
    for variant in dict.fromkeys(r["variant"] for r in results):
        one, many = [r for r in results if r["variant"] == variant][:2]
        per_tensor = (many["sync"]["wall_s"] - one["sync"]["wall_s"]) / (many["tensors"] - one["tensors"])
        print(
            f"{variant}: fixed cost per sync {one['sync']['wall_s'] * 1e3:.2f} ms (raw broadcast of its bytes "
            f"{one['raw_s'] * 1e3:.2f} ms; open {one['sync']['open_s'] * 1e3:.2f}, close "
            f"{one['sync']['close_s'] * 1e3:.2f}), per tensor {per_tensor * 1e6:.1f} us "
            f"({one['tensors']} and {many['tensors']} tensors)",
            flush=True,
        )


def _out_of_time(args, start: float, last: tuple[int, float] | None, mb: int) -> bool:
    """Whether size ``mb`` would end past ``--max-seconds`` (the same decision on every TP rank)."""
    skip = False
    if args.max_seconds is not None and last is not None:
        estimate = last[1] * max(1.0, mb / last[0])
        skip = time.perf_counter() - start + estimate > args.max_seconds
    if args.tp > 1:
        decision = [skip]
        torch.distributed.broadcast_object_list(decision, src=0)
        skip = decision[0]
    return skip


def _print(results: list[dict], header: bool) -> None:
    if header:
        print(
            f"{'variant':>8} {'size':>7} {'bytes':>12} {'sync GB/s':>9} {'raw GB/s':>8} {'ratio':>6} {'paired':>6} | "
            f"{'gather':>7} {'convert':>7} {'pack':>7} {'transfer':>8} {'load':>7} {'wall':>7} {'raw':>7} (s, medians) | "
            f"{'open':>5} {'close':>5} (ms) | CPU s/GB sync raw | raw GB/s, ratio, paired: distinct memory"
        )
    for r in results:
        s = r["sync"]
        print(
            f"{r['variant']:>8} {r['target_mb']:>5.4g}MB {r['bytes']:>12} {r['sync_gbps']:>9.2f} {r['raw_gbps']:>8.2f} {r['ratio']:>6.2f} {r['paired_ratio']:>6.2f} | "
            f"{s['gather_s']:>7.3f} {s['convert_s']:>7.3f} {s['pack_s']:>7.3f} {s['transfer_s']:>8.3f} "
            f"{s['load_s']:>7.3f} {s['wall_s']:>7.4f} {r['raw_s']:>7.4f}              | "
            f"{s['open_s'] * 1e3:>5.1f} {s['close_s'] * 1e3:>5.1f}      | "
            f"{r['sync_cpu_s_per_gb']:>8.2f} {r['raw_cpu_s_per_gb']:>4.2f} | "
            f"{r['raw_distinct_gbps']:>8.2f} {r['ratio_distinct']:>6.2f} {r['paired_ratio_distinct']:>6.2f}",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())

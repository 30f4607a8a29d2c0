"""Seconds per colocated weight sync (trainer and engine on one GPU, CUDA IPC), split by phase.

The trainer side is this process: full megatron-core tensors of a Qwen3-8B-shaped model (8.2 B parameters,
16.4 GB in bf16; ``--layers`` shrinks it) on the GPU, sent by ``weights_sync.colocated.ColocatedSender``
exactly as a colocated trainer sends them. The engine side is a second process on the same GPU holding
the model's Hugging Face tensors, serving ``/update_weights_from_tensor`` with the embedded engine's own
decoding (``rollout/embedded/ipc_receive.py``) and loader (``NamedTensorLoader``). It is not ``tidal serve``:
a random 8B transformers model initialises on the host for minutes; the weights, the route and the copy
are what a sync touches.

Phases on the trainer's timeline (they add up to the wall time, with begin/end): ``gather`` (TP all-gather:
none, one trainer rank holds full tensors), ``convert`` (megatron -> Hugging Face views), ``pack`` (copies
into the staging bucket, until done), ``transfer`` (pickling the IPC handle, and waiting for the replies
that packing did not hide: HTTP, the engine opening the handle and loading). On the engine's: ``open``
(decoding the request, opening the handle) and ``load`` (its copies into its weights), which overlap the
next bucket's pack. The floor in the same run: one device copy of every byte (what packing alone
costs, with no IPC, HTTP or second copy). Medians over ``--repeats``.

    python benchmarks/colocated_sync.py --device cuda --out runs/bench/colocated_sync.json
    python benchmarks/colocated_sync.py --device cuda --layers 4 --repeats 2       # quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from tidal.model_config import ModelConfig
from tidal.procs import free_port, spawn, stop, tail, wait_for_tcp
from tidal.rollout.embedded.ipc_receive import IpcPayloadError, UpdateFromTensorBody, parse_request
from tidal.rollout.embedded.model import NamedTensorLoader
from tidal.weights_sync.colocated import ColocatedSender
from tidal.weights_sync.config import WeightSyncConfig
from tidal.weights_sync.engine_api import EngineEndpoint
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.gather import GatherTimes
from tidal.weights_sync.tiny_models import megatron_shapes

GOAL_S = 0.5  # issue 8: a ~8B bf16 colocated sync in at most half a second


def qwen3_8b(layers: int) -> ModelConfig:
    return ModelConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
    )


def hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors the engine holds (the mapping run on meta tensors)."""
    mapping = mapping_for(model)
    out = {}
    for name, shape in megatron_shapes(model).items():
        for hf_name, t in mapping.to_hf(name, torch.empty(shape, device="meta")):
            out[hf_name] = tuple(t.shape)
    return out


# ---- the engine side ------------------------------------------------------------------------------
def engine_app(loader: NamedTensorLoader, stats: dict):
    """The engine stand-in's routes: ``/update_weights_from_tensor`` through the engine's own decoding and
    loader, the weight-update and pause routes as no-ops, ``/tidal/stats`` (and reset) of its timings."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    lock = threading.Lock()
    app = FastAPI()

    # the body's type is imported at module level: FastAPI resolves this module's postponed annotations in
    # its globals, and a name it cannot resolve makes ``body`` a query parameter (every request a 422)
    @app.post("/update_weights_from_tensor")
    def update(body: UpdateFromTensorBody):  # plain def: runs in the thread pool, like a blocking load
        with lock:
            t0 = time.perf_counter()
            try:
                named = parse_request(body)
                torch.cuda.current_stream().synchronize()  # the sender's pack (the IPC event) is done
                t1 = time.perf_counter()
                loader.load(named)
            except Exception as exc:  # the trainer side only sees a failed engine: say why here
                traceback.print_exc()
                status = 400 if isinstance(exc, IpcPayloadError) else 500
                return JSONResponse({"success": False, "message": str(exc)}, status_code=status)
            torch.cuda.current_stream().synchronize()
            stats["load_s"] += time.perf_counter() - t1
            stats["decode_s"] += t1 - t0
            stats["bytes"] += sum(t.numel() * t.element_size() for _, t in named)
            stats["requests"] += 1
            named.clear()
        return {"success": True, "message": "ok"}

    @app.get("/health")
    def health():
        return {}

    @app.get("/server_info")
    def server_info():
        return {"gpu_uuid": str(torch.cuda.get_device_properties(0).uuid)}

    @app.post("/tidal/stats")
    def take_stats():
        with lock:
            out = dict(stats)
            stats.update(decode_s=0.0, load_s=0.0, bytes=0, requests=0)
        return out

    for route in ("/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update"):
        app.add_api_route(route, lambda: {"success": True, "message": "ok"}, methods=["POST"])
    return app


def serve_engine(args) -> int:
    """A process holding the model's HF weights on the GPU, serving the colocated route."""
    import uvicorn

    dtype = getattr(torch, args.dtype)
    loader = NamedTensorLoader(torch.nn.Module())  # its name resolution and checks over these weights:
    loader.targets = {
        name: torch.empty(shape, dtype=dtype, device="cuda")
        for name, shape in hf_shapes(qwen3_8b(args.layers)).items()
    }
    stats = {"decode_s": 0.0, "load_s": 0.0, "bytes": 0, "requests": 0}
    uvicorn.run(
        engine_app(loader, stats), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )
    return 0


# ---- the trainer side -----------------------------------------------------------------------------
def run(args) -> dict:
    import httpx

    dtype = getattr(torch, args.dtype)
    model = qwen3_8b(args.layers)
    mapping = mapping_for(model)
    state = {n: torch.full(s, 0.5, dtype=dtype, device="cuda") for n, s in megatron_shapes(model).items()}
    total = sum(t.numel() * t.element_size() for t in state.values())
    params = sum(t.numel() for t in state.values())
    port = free_port()
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--layers", str(args.layers)]
    cmd += ["--dtype", args.dtype]
    engine = spawn(cmd, logdir / "colocated_engine.log")
    rows = []
    try:
        wait_for_tcp("127.0.0.1", port, timeout_s=300, proc=engine)
        url = f"http://127.0.0.1:{port}"
        config = WeightSyncConfig(bucket_bytes=args.bucket_mb << 20, pause_mode=None, timeout_s=600)
        sender = ColocatedSender(config, [EngineEndpoint(url)], device="cuda")
        http = httpx.Client(base_url=url, timeout=600)
        floor_buf = torch.empty(
            max(t.numel() * t.element_size() for t in state.values()), dtype=torch.uint8, device="cuda"
        )
        try:
            for repeat in range(args.repeats + 1):  # the first is a warm-up (allocations, first IPC opens)
                times = GatherTimes()

                def source(times=times):
                    for name, tensor in state.items():
                        t0 = time.perf_counter()
                        converted = mapping.to_hf(name, tensor, packable=True)
                        times.convert_s += time.perf_counter() - t0
                        yield from converted

                torch.cuda.synchronize()
                report = sender.sync(source, version=repeat)
                engine_stats = http.post("/tidal/stats").json()
                if not report.ok or engine_stats["bytes"] != report.bytes:
                    log_tail = tail(logdir / "colocated_engine.log", 60)
                    raise RuntimeError(
                        f"sync failed: {report} engine {engine_stats}\nengine log:\n{log_tail}"
                    )
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for t in state.values():
                    n = t.numel() * t.element_size()
                    floor_buf[:n].copy_(t.view(-1).view(torch.uint8))
                torch.cuda.synchronize()
                floor_s = time.perf_counter() - t0
                if repeat == 0:
                    continue
                rows.append(
                    dict(
                        wall_s=report.wall_s,
                        gather_s=0.0,
                        convert_s=times.convert_s,
                        pack_s=report.pack_s,
                        transfer_s=report.transfer_s,
                        load_s=engine_stats["load_s"],
                        engine_open_s=engine_stats["decode_s"],
                        buckets=report.buckets,
                        floor_copy_s=floor_s,
                    )
                )
        finally:
            http.close()
            sender.close()
    finally:
        stop(engine, timeout_s=10)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return dict(
        model=dict(layers=args.layers, params=params, bytes=total, dtype=args.dtype),
        bucket_mb=args.bucket_mb,
        repeats=args.repeats,
        median=med,
        runs=rows,
        gbps=total / med["wall_s"] / 1e9,
        floor_gbps=total / med["floor_copy_s"] / 1e9,
        vs_floor=med["wall_s"] / med["floor_copy_s"],
        goal_s=GOAL_S,
        meets_goal=med["wall_s"] <= GOAL_S,
        gpu=torch.cuda.get_device_name(0),
        torch=torch.__version__,
    )


def print_table(result: dict) -> None:
    m = result["median"]
    model = result["model"]
    print(
        f"colocated sync, {model['params'] / 1e9:.2f} B params, {model['bytes'] / 1e9:.1f} GB {model['dtype']}, "
        f"{result['bucket_mb']} MiB buckets x {m['buckets']:.0f}, median of {result['repeats']}"
    )
    print(f"{'phase':<22}{'seconds':>10}")
    for key in ("gather_s", "convert_s", "pack_s", "transfer_s", "wall_s"):
        print(f"{key.removesuffix('_s'):<22}{m[key]:>10.3f}")
    print(f"{'engine: open':<22}{m['engine_open_s']:>10.3f}")
    print(f"{'engine: load':<22}{m['load_s']:>10.3f}")
    print(f"{'floor: one copy':<22}{m['floor_copy_s']:>10.3f}")
    print(
        f"sync {result['gbps']:.1f} GB/s, floor {result['floor_gbps']:.1f} GB/s, sync/floor "
        f"{result['vs_floor']:.1f}x; goal <= {GOAL_S} s: {'met' if result['meets_goal'] else 'NOT met'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda"], help="CUDA IPC needs CUDA")
    parser.add_argument("--layers", type=int, default=36, help="36: Qwen3-8B's 8.2 B parameters")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--logdir", default="runs/bench/colocated_sync")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("colocated_sync: needs a CUDA device (CUDA IPC); torch sees none here", file=sys.stderr)
        return 2
    if args.serve:
        return serve_engine(args)
    result = run(args)
    print_table(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

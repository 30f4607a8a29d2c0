"""A model-less engine stand-in that serves only SGLang's weight-update routes (tests, benchmarks).

    python -m tidal.weights_sync.receiver_server --host 127.0.0.1 --port 30000

It receives buckets with ``WeightReceiver`` exactly as an engine does and keeps the tensors in a
dict; ``POST /tidal/save_weights {"path": DIR}`` writes them as a Hugging Face directory (fused QKVs
taken apart into q/k/v). Like ``tidal serve`` it declares tidal's extensions, replays a recorded update
(``POST /tidal/replay_weight_update``, replay.py) and, after an update announced in full, keeps each
broadcast's tensors back to back so later ones are received in place. The real engines are ``tidal
serve`` and SGLang; this serves the sender's tests and the benchmark without a model.

``receiver_routes`` are the benchmark's routes, served by this stand-in and by ``tidal serve``:
``GET /tidal/stats`` (bytes and seconds spent receiving and loading, the process's CPU seconds),
``POST /tidal/reset_stats`` and ``POST /tidal/raw_receive`` (plain broadcasts: the transport's ceiling).
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

from tidal.weights_sync import grouped_qkv, hf_io, replay
from tidal.weights_sync.receiver import DECLARED_EXTENSIONS, WeightReceiver


def _fail(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


def receiver_routes(receiver: WeightReceiver, extra_stats: Callable[[], dict[str, Any]] | None = None):
    """tidal's benchmark routes over ``receiver`` (``extra_stats``: more fields for ``/tidal/stats``)."""
    router = APIRouter()

    # plain ``def`` handlers run in the thread pool: they block in collectives without stalling the loop
    @router.post("/tidal/raw_receive")
    def raw_receive(body: dict[str, Any]):
        """Receive plain broadcasts of the given byte sizes (the benchmark's transport ceiling)."""
        sizes = [int(n) for n in body["sizes"]]
        try:
            receiver.receive_raw(
                sizes, body.get("group_name", "weight_update_group"), bool(body.get("distinct", False))
            )
        except Exception as exc:
            return _fail(f"raw receive failed: {type(exc).__name__}: {exc}")
        return {"success": True, "message": "ok"}

    @router.get("/tidal/stats")
    def stats():
        usage = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
        return {
            **receiver.stats.as_dict(),
            **(extra_stats() if extra_stats is not None else {}),
            "groups": receiver.group_names,
            "waiting": receiver.waiting,
            "cpu_s": usage.ru_utime + usage.ru_stime,
        }

    @router.post("/tidal/reset_stats")
    def reset_stats(body: dict[str, Any]):
        receiver.reset_stats()
        return {"success": True, "message": "ok"}

    return router


def _lay_out(weights: dict[str, torch.Tensor], entries: list[replay.Entry]) -> None:
    """Keep the tensors of each broadcast segment back to back, in the segment's order, in one arena (as
    ``tidal serve`` re-lays its weights): later updates receive every segment in place, with no copy."""
    runs = []
    for entry in entries:
        if not entry.segments:
            continue  # one packed broadcast: received into the buffer and copied whatever the layout
        first = 0
        for count in entry.segments:
            names = entry.names[first : first + count]
            first += count
            tensors = [weights.get(n) for n in names]
            if all(t is not None and t.dtype == tensors[0].dtype for t in tensors):
                runs.append(list(zip(names, tensors, strict=True)))
    total = sum(-(-sum(t.nbytes for _, t in run) // 64) * 64 for run in runs)
    arena = torch.empty(total, dtype=torch.uint8)
    at = 0
    for run in runs:
        start = at
        for name, t in run:
            view = arena[at : at + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            weights[name] = view
            at += t.nbytes
        at = start + -(-(at - start) // 64) * 64


def _hf_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The kept tensors under Hugging Face names: fused QKVs (``grouped_qkv``) taken apart into q, k, v."""
    out = {}
    for name, t in weights.items():
        names = grouped_qkv.parts(name)
        if names is None or t.dim() != 4:
            out[name] = t
            continue
        for part, view in zip(names, grouped_qkv.split(t), strict=True):
            out[part] = view.reshape(-1, t.shape[-1])
    return out


def build_app(timeout_s: float = 60.0) -> FastAPI:
    app = FastAPI()
    receiver = WeightReceiver("cpu", timeout_s)
    weights: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {"version": None, "open": False, "replays": 0}
    lock = threading.Lock()
    recorder = replay.Recorder()  # the last announced update per group, for replay_updates
    replaying = threading.Lock()  # one replayed update at a time
    replay_pool = replay.workers()
    app.include_router(
        receiver_routes(
            receiver,
            lambda: {
                "version": state["version"],
                "tensors": len(weights),
                "replays": state["replays"],
                "recorded_plans": len(recorder),
            },
        )
    )

    def ok(message: str = "ok") -> dict[str, Any]:
        return {"success": True, "message": message}

    def load(tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy into the kept weights (an engine's load): buckets hold distinct names, so no lock."""
        for name, t in tensors:
            old = weights.get(name)
            if old is not None and old.shape == t.shape and old.dtype == t.dtype:
                old.copy_(t)
            else:
                weights[name] = t.clone()
        if receiver.device == "cuda":
            # answer once the copies are done, as an engine's load does (only this stream: the next
            # bucket's receive runs on another)
            torch.cuda.current_stream().synchronize()

    @app.post("/init_weights_update_group")
    def init_group(body: dict[str, Any]):
        if body.get("backend", "gloo") == "nccl":
            receiver.device = "cuda"  # NCCL moves CUDA tensors only
        try:
            receiver.init_group(
                master_address=body["master_address"],
                master_port=int(body["master_port"]),
                rank_offset=int(body["rank_offset"]),
                world_size=int(body["world_size"]),
                group_name=body.get("group_name", "weight_update_group"),
                backend=body.get("backend", "gloo"),
            )
        except Exception as exc:
            return _fail(f"init_weights_update_group failed: {exc}")
        return {**ok(), **DECLARED_EXTENSIONS}

    @app.post("/destroy_weights_update_group")
    def destroy_group(body: dict[str, Any]):
        name = body.get("group_name", "weight_update_group")
        recorder.forget(name)
        return ok() if receiver.destroy_group(name) else _fail(f"no group {name!r}")

    @app.post("/begin_weight_update")
    def begin(body: dict[str, Any]):
        # no generation to pause (``pause_mode``, tidal's pause_in_update, is accepted as a no-op)
        state["open"] = True
        recorder.begin()
        return ok()

    @app.post("/end_weight_update")
    def end(body: dict[str, Any]):
        if not state["open"]:
            return _fail("end_weight_update without begin_weight_update")
        state["open"] = False  # nothing to continue (``continue_generation``)
        recorder.end()
        for group_name in receiver.group_names:
            entries = recorder.last(group_name)
            if entries is not None and state.get("laid") != entries:
                _lay_out(weights, entries)  # the next update's segments are received in place
                state["laid"] = entries
        return ok()

    @app.post("/pause_generation")
    def pause(body: dict[str, Any]):
        return ok()

    @app.post("/continue_generation")
    def resume(body: dict[str, Any]):
        return ok()

    def receive_and_load(entry: replay.Entry, group_name: str, seq: int | None, checksum: int | None = None):
        with receiver.receive(
            names=entry.names,
            dtypes=entry.dtypes,
            shapes=entry.shapes,
            group_name=group_name,
            checksum=checksum,
            seq=seq,
            segments=entry.segments,
            # the kept tensor, as an engine's weight
            target=lambda name, shape, dtype: weights.get(name),
        ) as tensors:
            load(tensors)  # the next bucket is received into the other buffer meanwhile

    @app.post("/update_weights_from_distributed")
    def update(body: dict[str, Any]):
        if body.get("load_format") != "flattened_bucket":
            return _fail(f"load_format={body.get('load_format')!r}: this receiver takes flattened_bucket")
        if not state["open"]:
            return _fail("update_weights_from_distributed outside begin_weight_update ... end_weight_update")
        group_name = body.get("group_name", "weight_update_group")
        entry = replay.Entry(body["names"], body["dtypes"], body["shapes"], body.get("segments"))
        seq, checksum = body.get("bucket_seq"), body.get("checksum")
        recorder.add(group_name, seq, entry if checksum is None else None)
        try:
            receive_and_load(entry, group_name, seq, checksum)
        except Exception as exc:
            recorder.fail(group_name)
            return _fail(f"receive failed: {type(exc).__name__}: {exc}")
        if body.get("weight_version") is not None:
            state["version"] = body["weight_version"]
        return ok()

    @app.post(replay.ROUTE)
    def replay_update(body: dict[str, Any]):
        """tidal's replay_updates: repeat the last announced update of ``group_name`` (replay.py)."""
        group_name = body.get("group_name", "weight_update_group")
        entries = recorder.plan(group_name, str(body.get("plan")))
        if entries is None or group_name not in receiver.group_names:
            return _fail(
                f"no recorded plan {body.get('plan')!r} for group {group_name!r}: announce this update"
            )
        if not replaying.acquire(timeout=receiver.timeout_s):
            return _fail("a replayed update is still running")
        version = body.get("weight_version")

        def finish() -> None:
            state["replays"] += 1
            if version is not None:
                state["version"] = version

        session = replay.ReplaySession(
            receiver.group(group_name),
            entries,
            lambda entry, seq: receive_and_load(entry, group_name, seq),
            finish,
            lambda seq: receiver.continue_at(group_name, seq),
            replay_pool,
        )

        def run() -> None:
            try:
                if not session.run():
                    recorder.fail(group_name)
                    print(
                        f"replayed update of {group_name} failed: {session.error!r}",
                        file=sys.stderr,
                        flush=True,
                    )
            finally:
                replaying.release()

        replay_pool.submit(run)
        return ok("replaying")

    @app.post("/tidal/save_weights")
    def save_weights(body: dict[str, Any]):
        with lock:
            hf_io.save(body["path"], _hf_names(weights))
        return ok()

    @app.get("/health")
    def health():
        return {"ok": True}

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout-s", type=float, default=60.0)
    args = p.parse_args(argv)
    # a handler can be stuck in a receive whose broadcast never came (a failed sync; gloo cannot abort it):
    # do not wait for it on shutdown
    uvicorn.run(
        build_app(args.timeout_s),
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=1,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

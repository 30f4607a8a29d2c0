"""A model-less engine stand-in that serves only SGLang's weight-update routes (tests, benchmarks).

    python -m tidal.weights_sync.receiver_server --host 127.0.0.1 --port 30000

It receives buckets with ``WeightReceiver`` exactly as an engine does and keeps the tensors in a
dict; ``POST /tidal/save_weights {"path": DIR}`` writes them as a Hugging Face directory. The real
engines are ``tidal serve`` and SGLang; this serves the sender's tests and the benchmark without a model.

``receiver_routes`` are the benchmark's routes, served by this stand-in and by ``tidal serve``:
``GET /tidal/stats`` (bytes and seconds spent receiving and loading, the process's CPU seconds),
``POST /tidal/reset_stats`` and ``POST /tidal/raw_receive`` (plain broadcasts: the transport's ceiling).
"""

from __future__ import annotations

import argparse
import resource
import threading
from collections.abc import Callable
from typing import Any

import torch
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

from tidal.weights_sync import hf_io
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
            receiver.receive_raw(sizes, body.get("group_name", "weight_update_group"))
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


def build_app(timeout_s: float = 60.0) -> FastAPI:
    app = FastAPI()
    receiver = WeightReceiver("cpu", timeout_s)
    weights: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {"version": None, "open": False}
    lock = threading.Lock()
    app.include_router(
        receiver_routes(receiver, lambda: {"version": state["version"], "tensors": len(weights)})
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
        return ok() if receiver.destroy_group(name) else _fail(f"no group {name!r}")

    @app.post("/begin_weight_update")
    def begin(body: dict[str, Any]):
        # no generation to pause (``pause_mode``, tidal's pause_in_update, is accepted as a no-op)
        state["open"] = True
        return ok()

    @app.post("/end_weight_update")
    def end(body: dict[str, Any]):
        if not state["open"]:
            return _fail("end_weight_update without begin_weight_update")
        state["open"] = False  # nothing to continue (``continue_generation``)
        return ok()

    @app.post("/pause_generation")
    def pause(body: dict[str, Any]):
        return ok()

    @app.post("/continue_generation")
    def resume(body: dict[str, Any]):
        return ok()

    @app.post("/update_weights_from_distributed")
    def update(body: dict[str, Any]):
        if body.get("load_format") != "flattened_bucket":
            return _fail(f"load_format={body.get('load_format')!r}: this receiver takes flattened_bucket")
        if not state["open"]:
            return _fail("update_weights_from_distributed outside begin_weight_update ... end_weight_update")
        try:
            with receiver.receive(
                names=body["names"],
                dtypes=body["dtypes"],
                shapes=body["shapes"],
                group_name=body.get("group_name", "weight_update_group"),
                checksum=body.get("checksum"),
                seq=body.get("bucket_seq"),
                segments=body.get("segments"),
                # the kept tensor, as an engine's weight (as tidal serve: only for segmented buckets)
                target=(lambda name, shape, dtype: weights.get(name)) if body.get("segments") else None,
            ) as tensors:
                load(tensors)  # the next bucket is received into the other buffer meanwhile
        except Exception as exc:
            return _fail(f"receive failed: {type(exc).__name__}: {exc}")
        if body.get("weight_version") is not None:
            state["version"] = body["weight_version"]
        return ok()

    @app.post("/tidal/save_weights")
    def save_weights(body: dict[str, Any]):
        with lock:
            hf_io.save(body["path"], dict(weights))
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

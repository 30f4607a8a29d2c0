"""The colocated routes of the embedded engine, with SGLang's shapes and status codes.

``/update_weights_from_tensor`` (CUDA IPC weight updates, see ``ipc_receive.py``) answers
``{"success": ..., "message": ...}`` with 200 or 400; ``/release_memory_occupation`` and
``/resume_memory_occupation`` (sleep / wake, see ``memory.py``) answer 200 with an empty body, or 400
with ``{"error": {"message": ...}}``, as SGLang's do.
"""

from __future__ import annotations

from typing import Any

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from tidal.rollout.embedded.ipc_receive import (
    IpcPayloadError,
    UpdateFromTensorBody,
    check_engine_device,
    parse_request,
)
from tidal.rollout.embedded.memory import EngineMemory, MemoryStateError
from tidal.rollout.embedded.model import WeightLoadError


class MemoryBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rid: str | None = None
    tags: list[str] | None = None


def engine_memory(engine) -> EngineMemory:
    memory = getattr(engine, "memory", None)
    if memory is None:
        memory = engine.memory = EngineMemory(engine.lm, engine.scheduler)
    return memory


def engine_gpu_uuid(engine) -> str | None:
    """The UUID of the engine's GPU (tidal's /server_info extension: colocated senders compare it with theirs)."""
    device = engine.scheduler.device
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


def memory_released(engine) -> str | None:
    """Why generation cannot continue now (memory released), or None."""
    memory = getattr(engine, "memory", None)
    if memory is None or not memory.released:
        return None
    return (
        f"the engine's memory is released ({sorted(memory.released)}): call /resume_memory_occupation "
        "before /continue_generation"
    )


async def release_memory(engine, tags: list[str] | None) -> dict[str, int]:
    memory = engine_memory(engine)
    # drain: waits for running requests to finish (none is admitted meanwhile), or runs at once while paused
    return await engine._call(lambda: memory.release(tags), drain=True)


async def resume_memory(engine, tags: list[str] | None) -> None:
    memory = engine_memory(engine)
    await engine._call(lambda: memory.resume(tags))


async def update_weights_from_tensor(engine, body: UpdateFromTensorBody) -> None:
    """Map the sender's bucket, copy it into the weights between steps, and drop the mapping before replying."""
    check_engine_device(engine.scheduler.device)
    memory = getattr(engine, "memory", None)
    if memory is not None and "weights" in memory.released:
        raise IpcPayloadError(
            "the engine's weights are released: /resume_memory_occupation with tags ['weights'] first"
        )
    async with engine._update_lock:
        if body.abort_all_requests:
            await engine.abort(None, True)

        def load() -> None:
            named = parse_request(body)  # waits (on this stream) for the sender's pack to finish
            try:
                engine.loader.load(named)
                # the reply lets the sender overwrite its buffer: the copies must be done by then
                torch.cuda.current_stream(engine.scheduler.device).synchronize()
            finally:
                named.clear()  # the last references to the sender's memory: the IPC mapping closes
            if body.weight_version is not None:
                engine.scheduler.set_version(body.weight_version)
            if body.torch_empty_cache:
                torch.cuda.empty_cache()

        await engine._call(load, drain=True)


def add_colocated_routes(app: FastAPI, engine) -> None:
    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(body: UpdateFromTensorBody) -> JSONResponse:
        try:
            await update_weights_from_tensor(engine, body)
        except (IpcPayloadError, WeightLoadError) as exc:
            return _result(False, f"Failed to update weights from tensor: {exc}")
        message = "Succeeded to update model weights."
        if body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return _result(True, message)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(body: MemoryBody | None = None) -> Response:
        try:
            await release_memory(engine, body.tags if body else None)
        except MemoryStateError as exc:
            return _error(str(exc))
        return Response(status_code=200)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(body: MemoryBody | None = None) -> Response:
        try:
            await resume_memory(engine, body.tags if body else None)
        except MemoryStateError as exc:
            return _error(str(exc))
        return Response(status_code=200)


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=200 if success else 400
    )


def _error(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=400)

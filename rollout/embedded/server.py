"""SGLang's native HTTP routes over the embedded engine, with SGLang's JSON shapes and status codes.

Shapes follow ``sglang/srt/entrypoints/http_server.py`` and ``sglang/api/v1/api_types.py`` (0.5.23).
Refusals are HTTP 400: ``{"error": {"message": ...}}`` for generation and general routes,
``{"success": false, "message": ...}`` for weight-update routes, as SGLang answers them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from tidal.rollout.embedded.memory_routes import add_colocated_routes, engine_gpu_uuid, memory_released
from tidal.rollout.embedded.sampling import SamplingError, SamplingParams
from tidal.rollout.embedded.service import ENGINE_ERRORS, BadRequest, EmbeddedEngine, GenerateInput
from tidal.rollout.embedded.weights import ORDERED_BUCKETS
from tidal.weights_sync import replay
from tidal.weights_sync.receiver_server import receiver_routes

# The SGLang release whose HTTP protocol this server speaks (reported as /server_info's version).
SGLANG_PROTOCOL_VERSION = "0.5.23"

# how long /health_generate waits for its one-token generation (SGLang's HEALTH_CHECK_TIMEOUT)
HEALTH_GENERATE_TIMEOUT_S = 20.0

# how often a running /generate checks whether its client is still connected
DISCONNECT_POLL_S = 0.5

# /generate keys the engine honours; other SGLang keys are accepted only when null/false/empty.
_GENERATE_KEYS = {
    "rid",
    "text",
    "input_ids",
    "stream",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
}


class _Body(BaseModel):
    # SGLang's request structs carry rid / http_worker_ipc; unknown keys are ignored as FastAPI does there
    model_config = ConfigDict(extra="ignore")
    rid: str | None = None


class AbortBody(_Body):
    rid: str | None = ""
    abort_all: bool = False


class PauseBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(_Body):
    torch_empty_cache: bool = True


class InitGroupBody(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class BeginUpdateBody(_Body):
    # tidal's pause_in_update extension: pause generation first, as /pause_generation would
    pause_mode: Literal["abort", "retract", "in_place"] | None = None


class EndUpdateBody(_Body):
    # tidal's pause_in_update extension: continue generation after, as /continue_generation would
    continue_generation: bool = False


class DestroyGroupBody(_Body):
    group_name: str = "weight_update_group"


class UpdateDistributedBody(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False
    checksum: int | None = None  # tidal's extension: CRC32 of a flattened bucket (SGLang ignores it)
    bucket_seq: int | None = Field(None, ge=0)  # tidal's extension: the bucket's place in the sender's order
    segments: list[int] | None = None  # tidal's extension: tensors per broadcast of the bucket


class ReplayBody(_Body):
    group_name: str = "weight_update_group"
    plan: str
    weight_version: str
    pause_mode: Literal["abort", "retract", "in_place"] | None = None


class UpdateVersionBody(_Body):
    new_version: str
    abort_all_requests: bool = True


class WeightsByNameBody(_Body):
    name: str
    truncate_size: int = 100


def error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def result(success: bool, message: str, **extra: Any) -> JSONResponse:
    if not success and message not in _refusals_logged:
        # the caller gets the message, but the engine's own log is where its node's operator looks (a
        # node whose model does not match the trainer's has every update refused, and otherwise only idles)
        _refusals_logged.add(message)
        print(f"tidal serve: refused: {message} (logged once)", file=sys.stderr, flush=True)
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=200 if success else 400
    )


_refusals_logged: set[str] = set()


def create_app(engine: EmbeddedEngine, *, host: str = "", port: int = 0) -> FastAPI:
    app = FastAPI(title="tidal embedded engine")
    # tidal's weight-receive counters and the raw-broadcast ceiling (benchmarks/weight_sync.py --engine serve)
    app.include_router(receiver_routes(engine.receiver.shared))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return error(f"invalid request to {request.url.path}: {'; '.join(parts)}")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.scheduler.alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Generate one token when idle (a busy or paused engine counts as healthy, as in SGLang)."""
        sched = engine.scheduler
        if not sched.alive:
            return Response(status_code=503)
        if sched.running or sched.waiting or sched.paused is not None:
            return Response(status_code=200)
        probe = GenerateInput(
            input_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0), return_logprob=False
        )
        try:
            await asyncio.wait_for(engine.generate([probe]), HEALTH_GENERATE_TIMEOUT_S)
        except (TimeoutError, RuntimeError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path,
            "served_model_name": engine.served_model_name,
            "tokenizer_path": engine.model_path if engine.tokenizer is not None else "",
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "load_format": None,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": engine.lm.config.model_type,
            "architectures": [type(engine.lm).__name__],
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        cfg = engine.config
        return {
            "model_path": engine.model_path,
            "served_model_name": engine.served_model_name,
            "tokenizer_path": engine.model_path if engine.tokenizer is not None else "",
            "max_context_length": cfg.max_seq_len,
            "max_total_num_tokens": cfg.max_batch_size * cfg.max_seq_len,
            "version": SGLANG_PROTOCOL_VERSION,
            "engine": "tidal-embedded",
            "device": cfg.device,
            "gpu_uuid": engine_gpu_uuid(engine),  # tidal's: colocated senders look for their own GPU
            "internal_states": [engine.scheduler.stats()],
            "host": host,
            "port": port,
            "incremental_streaming_output": False,
            "disaggregation_mode": "null",
        }

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError as exc:
            return error(f"request body is not valid JSON: {exc}")
        try:
            inputs, batched = parse_generate(engine, body)
            started = time.perf_counter()
            reqs = await _generate_until_disconnect(engine, inputs, request)
        except (BadRequest, SamplingError) as exc:
            return error(str(exc))
        except RuntimeError as exc:
            return error(str(exc), status=503)
        latency = time.perf_counter() - started
        outs = [generate_response(engine, inp, req, latency) for inp, req in zip(inputs, reqs, strict=True)]
        failed = [r for r in reqs if (r.finish_reason or {}).get("status_code") == 500]
        if failed:
            return error(failed[0].finish_reason["message"], status=500)
        return JSONResponse(outs if batched else outs[0])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await engine.flush_cache():
            return Response(
                "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                "waiting requests, the operation will not be performed.)\n",
                status_code=200,
            )
        return Response("Cache not flushed: there are running or waiting requests.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(body: AbortBody) -> Response:
        await engine.abort(body.rid or None, body.abort_all)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(body: PauseBody) -> JSONResponse:
        await engine.pause(body.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(body: ContinueBody | None = None) -> JSONResponse:
        if (released := memory_released(engine)) is not None:
            return error(released)
        await engine.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitGroupBody) -> JSONResponse:
        try:
            await engine.init_weights_update_group(
                master_address=body.master_address,
                master_port=body.master_port,
                rank_offset=body.rank_offset,
                world_size=body.world_size,
                group_name=body.group_name,
                backend=body.backend,
            )
        except (*ENGINE_ERRORS, RuntimeError, ValueError) as exc:
            return result(False, f"Failed to init group: {exc}.")
        # tidal's extension: buckets announced with bucket_seq are received in that order, double-buffered
        return result(True, "Succeeded to initialize custom process group.", **ORDERED_BUCKETS)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyGroupBody) -> JSONResponse:
        try:
            await engine.destroy_weights_update_group(body.group_name)
        except ENGINE_ERRORS as exc:
            return result(False, str(exc))
        return result(True, f"Succeeded to destroy group {body.group_name}.")

    @app.post("/begin_weight_update")
    async def begin_weight_update(body: BeginUpdateBody | None = None) -> JSONResponse:
        if body is not None and body.pause_mode is not None:
            await engine.pause(body.pause_mode)
        engine.begin_update()
        return result(True, "Weight update session opened.")

    @app.post("/end_weight_update")
    async def end_weight_update(body: EndUpdateBody | None = None) -> JSONResponse:
        await engine.end_update()
        if body is not None and body.continue_generation:
            if (released := memory_released(engine)) is not None:
                return result(False, released)
            await engine.resume()
        return result(True, "Weight update session closed.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateDistributedBody) -> JSONResponse:
        if body.selector == "draft":
            return result(False, "selector='draft': the embedded engine has no draft model")
        try:
            await engine.update_weights_from_distributed(
                names=body.names,
                dtypes=body.dtypes,
                shapes=body.shapes,
                group_name=body.group_name,
                load_format=body.load_format,
                weight_version=body.weight_version,
                abort_all_requests=body.abort_all_requests,
                checksum=body.checksum,
                bucket_seq=body.bucket_seq,
                segments=body.segments,
            )
        except (*ENGINE_ERRORS, RuntimeError) as exc:
            return result(False, f"Failed to update parameter online: {exc}")
        message = "Succeeded to update parameter online."
        if body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return result(True, message)

    @app.post(replay.ROUTE)
    async def replay_weight_update(body: ReplayBody) -> JSONResponse:
        """tidal's replay_updates: repeat the last announced update (weights_sync/replay.py)."""
        try:
            await engine.replay_weight_update(
                group_name=body.group_name,
                plan=body.plan,
                weight_version=body.weight_version,
                pause_mode=body.pause_mode,
            )
        except ENGINE_ERRORS as exc:
            return result(False, str(exc))
        return result(True, "Replaying the recorded update.")

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateVersionBody) -> JSONResponse:
        await engine.set_weight_version(body.new_version, body.abort_all_requests)
        return result(True, f"Weight version updated to {body.new_version}", new_version=body.new_version)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(body: WeightsByNameBody) -> Response:
        try:
            return JSONResponse(engine.get_weights_by_name(body.name, body.truncate_size))
        except BadRequest as exc:
            return error(str(exc))

    add_colocated_routes(app, engine)  # /update_weights_from_tensor, /release_ and /resume_memory_occupation
    return app


async def _generate_until_disconnect(engine: EmbeddedEngine, inputs: list[GenerateInput], request: Request):
    """Generate; if the client goes away first, abort its requests (as SGLang does) so they stop using slots."""
    task = asyncio.ensure_future(engine.generate(inputs))
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            for inp in inputs:
                await engine.abort(inp.rid, False)
            break
    return await task


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries but the batch has {n} prompts")
        return value
    return [value] * n


def _token_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{name} must be a list of integer token ids")
    return value


def parse_generate(engine: EmbeddedEngine, body: Any) -> tuple[list[GenerateInput], bool]:
    """The requests of one /generate body (a batch when input_ids/text is a list of prompts, or n > 1)."""
    if not isinstance(body, dict):
        raise BadRequest("the /generate body must be a JSON object")
    for key, value in body.items():
        if key not in _GENERATE_KEYS and value not in (None, False, [], {}, ""):
            raise BadRequest(f"/generate: {key!r} is not supported by the embedded engine")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the embedded engine; send stream=false")
    if body.get("top_logprobs_num"):
        raise BadRequest("top_logprobs_num is not supported by the embedded engine")
    start = body.get("logprob_start_len")
    if start not in (None, -1) and not (isinstance(start, list) and all(s in (None, -1) for s in start)):
        raise BadRequest(
            "logprob_start_len >= 0 (input token logprobs) is not supported by the embedded engine"
        )
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise BadRequest("Either text or input_ids should be provided (exactly one of them).")
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            prompts, batched = [_token_list(p, "input_ids[i]") for p in ids], True
        else:
            prompts, batched = [_token_list(ids, "input_ids")], False
    else:
        text = body["text"]
        if isinstance(text, list):
            prompts, batched = [engine.encode(t) for t in text], True
        elif isinstance(text, str):
            prompts, batched = [engine.encode(text)], False
        else:
            raise BadRequest("text must be a string or a list of strings")
    n = len(prompts)
    sampling = _per_item(body.get("sampling_params"), n, "sampling_params")
    logprob = _per_item(body.get("return_logprob") or False, n, "return_logprob")
    rids = _per_item(body.get("rid"), n, "rid")
    if not batched and isinstance(body.get("rid"), list):
        raise BadRequest("rid is a list but input_ids/text holds one prompt")
    inputs = []
    for prompt, sp, lp, rid in zip(prompts, sampling, logprob, rids, strict=True):
        if sp is not None and not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object (or a list of objects for a batch)")
        engine.check_input(prompt)
        params = SamplingParams.from_json(sp, engine.vocab_size)
        for j in range(params.n):
            if rid is None:
                sub_rid = uuid.uuid4().hex
            else:
                sub_rid = rid if params.n == 1 else f"{rid}_{j}"
            inputs.append(
                GenerateInput(input_ids=prompt, params=params, return_logprob=bool(lp), rid=sub_rid)
            )
    return inputs, batched or len(inputs) > 1


def generate_response(engine: EmbeddedEngine, inp: GenerateInput, req, latency: float) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(inp.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "weight_version": req.weight_version,
        "weight_versions": req.version_spans,
        "e2e_latency": latency,
    }
    if inp.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids, strict=True)
        ]
    return {"text": engine.decode(req.output_ids), "output_ids": list(req.output_ids), "meta_info": meta}

"""The embedded engine as one object: model, scheduler, weight receiver, tokenizer and weight version.

Its async methods are what the HTTP routes call; they never run a forward pass or a collective on the
event loop (the scheduler thread and worker threads do).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tidal.model_config import ModelConfig
from tidal.rollout.config import EmbeddedEngineConfig
from tidal.rollout.embedded.model import NamedTensorLoader, WeightLoadError, build_model
from tidal.rollout.embedded.sampling import SamplingParams
from tidal.rollout.embedded.scheduler import Request, Scheduler
from tidal.rollout.embedded.weights import WeightReceiver, WeightUpdateError, load_all

PAUSE_MODES = ("abort", "retract", "in_place")


class BadRequest(ValueError):
    """A request the engine refuses with HTTP 400 and this message."""


@dataclass
class GenerateInput:
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    rid: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class EmbeddedEngine:
    def __init__(self, model: ModelConfig, engine: EmbeddedEngineConfig, *, seed: int):
        self.model_config = model.resolved()
        self.config = engine
        self.lm = build_model(
            model, seed=seed, device=engine.device, dtype=engine.dtype, fuse=engine.fuse_projections
        )
        self.vocab_size = self.lm.config.vocab_size
        eos = self.lm.config.eos_token_id
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.tokenizer = _load_tokenizer(model.path)
        self.loader = NamedTensorLoader(self.lm)
        self.receiver = WeightReceiver(engine.device, engine.weight_update_timeout_s)
        self.scheduler = Scheduler(
            self.lm,
            max_batch_size=engine.max_batch_size,
            max_seq_len=engine.max_seq_len,
            max_prefill_tokens=engine.max_prefill_tokens,
            device=engine.device,
            eos_token_ids=self.eos_token_ids,
            seed=seed,
            decode=None if engine.decode == "auto" else engine.decode,
            decode_burst=engine.decode_burst,
            cpu_attention=engine.cpu_attention,
            cpu_step=engine.cpu_step,
        )
        self.model_path = model.path or f"random-init:{self.model_config.family}:seed={seed}"
        self.served_model_name = engine.served_model_name or self.model_path
        self.in_weight_update = False
        self._update_lock = asyncio.Lock()

    def start(self) -> None:
        self.scheduler.start()

    def close(self) -> None:
        self.scheduler.stop()
        self.receiver.close()

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # ---- generation ----

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest(
                "this engine has no tokenizer (random-init model): send input_ids instead of text"
            )
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_input(self, ids: list[int]) -> None:
        if not ids:
            raise BadRequest("input_ids is empty: a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(
                f"input_ids hold token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) >= self.config.max_seq_len:
            raise BadRequest(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.config.max_seq_len} tokens); raise rollout.engine.max_seq_len or shorten the prompt"
            )

    async def generate(self, inputs: list[GenerateInput]) -> list[Request]:
        """Run the requests concurrently (they join the running batch) and return them finished."""
        if not self.scheduler.alive:
            raise RuntimeError("the engine's scheduler is not running")
        loop = asyncio.get_running_loop()
        futures = []
        for inp in inputs:
            fut: asyncio.Future = loop.create_future()

            def done(req: Request, fut: asyncio.Future = fut) -> None:
                loop.call_soon_threadsafe(_resolve, fut, req)

            named = {} if inp.rid is None else {"rid": inp.rid}  # a uuid only for unnamed requests
            req = Request(
                input_ids=list(inp.input_ids),
                params=inp.params,
                return_logprob=inp.return_logprob,
                on_done=done,
                **named,
            )
            if inp.params.max_new_tokens == 0:
                self.scheduler.call(lambda req=req: self.scheduler.finish_without_running(req))
            else:
                self.scheduler.submit(req)
            futures.append(fut)
        return list(await asyncio.gather(*futures))

    async def _call(self, fn, *, drain: bool = False):
        return await asyncio.wrap_future(self.scheduler.call(fn, drain=drain))

    async def abort(self, rid: str | None, abort_all: bool) -> int:
        return await self._call(lambda: self.scheduler.abort(rid, abort_all))

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode={mode!r}: choose one of {list(PAUSE_MODES)}")
        await self._call(lambda: self.scheduler.pause(mode))

    async def resume(self) -> None:
        await self._call(self.scheduler.resume)

    async def flush_cache(self) -> bool:
        # no prefix cache to drop; like SGLang, refuse while requests hold KV
        return await self._call(self.scheduler.idle)

    async def set_weight_version(self, version: str, abort_all: bool) -> None:
        if abort_all:
            await self.abort(None, True)
        await self._call(lambda: self.scheduler.set_version(version))

    # ---- weights ----

    async def init_weights_update_group(self, **kwargs: Any) -> None:
        await asyncio.to_thread(self.receiver.init_group, **kwargs)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await asyncio.to_thread(self.receiver.destroy, group_name)

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
        weight_version: str | None,
        abort_all_requests: bool,
        checksum: int | None = None,
        bucket_seq: int | None = None,
        segments: list[int] | None = None,
    ) -> None:
        """Receive in a worker thread (generation goes on), then load between steps, with the new version.

        Without ``bucket_seq`` updates run one at a time (SGLang's contract); with it (tidal's sender,
        after this engine declared ``ordered_buckets``) the receiver orders them and bucket k+1 is
        received while bucket k is loaded. With ``segments`` a tensor sent on its own is received
        straight into its weight while generation is paused inside a weight update.
        """

        def paused_in_update() -> bool:
            """Nothing reads the weights: generation is paused inside a weight update."""
            return self.in_weight_update and self.scheduler.paused is not None

        def in_place_target():
            # only while nothing reads the weights, and only if the whole bucket is known: a bad one is
            # received into the buffer and refused before anything is written
            if checksum is not None or not paused_in_update():
                return None
            try:  # shapes only (no meta tensors: this runs per tensor before the receives are posted)
                self.loader.check([(n, _Announced(s)) for n, s in zip(names, shapes, strict=True)])
            except Exception:  # noqa: BLE001 - the receive reports what is wrong with the announcement
                return None
            return lambda name, shape, dtype: self.loader.resolve(name)

        def receive_and_load() -> None:
            with self.receiver.receive_bucket(
                names=names,
                dtypes=dtypes,
                shapes=shapes,
                group_name=group_name,
                load_format=load_format,
                checksum=checksum,
                seq=bucket_seq,
                segments=segments,
                target=in_place_target() if segments is not None else None,
            ) as received:

                def load() -> None:
                    load_all(self.loader, received)  # checks every name and shape before it writes any
                    if weight_version is not None:
                        self.scheduler.set_version(weight_version)

                if paused_in_update() and weight_version in (None, self.scheduler.weight_version):
                    # nothing to hand to the scheduler thread (the version is set; only it may change
                    # that): loaded here, without two thread hops on the sync's critical path
                    load_all(self.loader, received)
                    return
                self.scheduler.call(load, drain=True).result()  # the buffer is reused once this returns

        async def update() -> None:
            if abort_all_requests:
                await self.abort(None, True)
            await asyncio.to_thread(receive_and_load)

        if bucket_seq is not None:
            await update()
            return
        async with self._update_lock:
            await update()

    def get_weights_by_name(self, name: str, truncate_size: int) -> list:
        try:
            tensor = self.loader.resolve(name)
        except WeightLoadError as exc:
            raise BadRequest(str(exc)) from exc
        return tensor.detach().to(torch.float32).cpu().tolist()[:truncate_size]


ENGINE_ERRORS = (BadRequest, WeightUpdateError, WeightLoadError)


@dataclass
class _Announced:
    """An announced tensor's shape, as ``NamedTensorLoader.check`` reads it."""

    shape: list[int]


def _resolve(fut: asyncio.Future, req: Request) -> None:
    if not fut.done():
        fut.set_result(req)


def _load_tokenizer(path: str | None):
    if not path or not (Path(path) / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))

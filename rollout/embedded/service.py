"""The embedded engine as one object: model, scheduler, weight receiver, tokenizer and weight version.

Its async methods are what the HTTP routes call; they never run a forward pass or a collective on the
event loop (the scheduler thread and worker threads do).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tidal.model_config import ModelConfig
from tidal.rollout.config import EmbeddedEngineConfig
from tidal.rollout.embedded import arena
from tidal.rollout.embedded.model import DTYPES, NamedTensorLoader, WeightLoadError, build_model
from tidal.rollout.embedded.sampling import SamplingParams
from tidal.rollout.embedded.scheduler import Request, Scheduler
from tidal.rollout.embedded.weights import WeightReceiver, WeightUpdateError, load_all
from tidal.weights_sync import grouped_qkv, replay

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
        self.recorder = replay.Recorder()  # announced updates, replayed by the next sync (replay_updates)
        self.relayout: arena.RelayoutReport | None = None  # once the weights moved into their arena
        self.memory = None  # set by the colocated routes while weights may be released (memory.py)
        self._replaying = threading.Lock()  # held from a replay's acceptance until its session ends
        self._replay_pool = replay.workers()

    def start(self) -> None:
        self.scheduler.start()

    def close(self) -> None:
        self.scheduler.stop()
        self.receiver.close()  # fails a replay's receives still waiting, so its threads end
        self._replay_pool.shutdown(wait=False, cancel_futures=True)

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
        self.recorder.forget(group_name)  # its plan can never be replayed
        await asyncio.to_thread(self.receiver.destroy, group_name)

    def begin_update(self) -> None:
        """``/begin_weight_update``: the announcements until ``end_update`` are recorded for replays."""
        self.in_weight_update = True
        self.recorder.begin()

    async def end_update(self) -> None:
        self.in_weight_update = False
        self.recorder.end()
        if self._relayout_pending():
            await self._call(self._relayout, drain=True)

    def _relayout_pending(self) -> bool:
        wanted = self.config.relayout_weights
        if wanted is False or self.relayout is not None or self.memory is not None:
            return False
        return wanted is True or torch.device(self.config.device).type == "cpu"

    def _relayout(self) -> None:
        """Once, on the scheduler thread after an update announced in full: the weights move into one arena
        per dtype in the order of the recorded broadcasts (arena.py), so the next updates' segments are
        received in place, each bucket one broadcast with no copy on either side."""
        runs: list[list[str]] = []
        announced: dict[str, tuple[list[int], torch.dtype]] = {}
        for group_name in self.receiver.groups:
            for entry in self.recorder.last(group_name) or []:
                first = 0
                for count in entry.segments or [len(entry.names)]:
                    runs.append(entry.names[first : first + count])
                    first += count
                for name, shape, dtype in zip(entry.names, entry.shapes, entry.dtypes, strict=True):
                    announced[name] = (shape, DTYPES.get(dtype, torch.float32))
        if not runs:
            return

        def resolve(name: str) -> torch.Tensor:
            shape, dtype = announced[name]
            return self.loader.target(name, shape, dtype)  # a fused QKV's landing tensor joins its run

        for run in runs:  # landing tensors exist before the arena is planned, so they are moved with it
            for name in run:
                if grouped_qkv.parts(name) is not None:
                    resolve(name)
        self.relayout = arena.relayout(self.lm, runs, resolve, extra=list(self.loader.landings.values()))
        if self.relayout.laid:
            self.scheduler.weights_moved()
        print(
            f"tidal serve: weights laid out for in-place updates: {self.relayout}",
            file=sys.stderr,
            flush=True,
        )

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
        entry = replay.Entry(names, dtypes, shapes, segments)
        replayable = load_format == "flattened_bucket" and checksum is None
        self.recorder.add(group_name, bucket_seq, entry if replayable else None)

        async def update() -> None:
            if abort_all_requests:
                await self.abort(None, True)
            try:
                await asyncio.to_thread(
                    self._receive_and_load,
                    entry,
                    group_name,
                    load_format,
                    weight_version,
                    checksum,
                    bucket_seq,
                )
            except BaseException:
                self.recorder.fail(group_name)
                raise

        if bucket_seq is not None:
            await update()
            return
        async with self._update_lock:
            await update()

    def _paused_in_update(self) -> bool:
        """Nothing reads the weights: generation is paused inside a weight update."""
        return self.in_weight_update and self.scheduler.paused is not None

    def _receive_and_load(
        self,
        entry: replay.Entry,
        group_name: str,
        load_format: str | None,
        weight_version: str | None,
        checksum: int | None,
        seq: int | None,
        known: bool = False,
    ) -> None:
        """One bucket, on a worker thread: received (in place where it may be), then loaded. ``known``: the
        bucket of a recorded update (a replay), whose names and shapes loaded once already."""
        names, shapes = entry.names, entry.shapes

        def in_place_target():
            # only while nothing reads the weights, and only if the whole bucket is known: a bad one is
            # received into the buffer and refused before anything is written; a bucket of one broadcast
            # can land in place only once the weights were laid out in its order (relayout)
            if checksum is not None or not self._paused_in_update():
                return None
            if entry.segments is None and not (self.relayout is not None and self.relayout.laid):
                return None
            if known:  # the model's names and shapes do not change: no check per tensor per sync
                return self.loader.target
            try:  # shapes only (no meta tensors: this runs per tensor before the receives are posted)
                self.loader.check([(n, _Announced(s)) for n, s in zip(names, shapes, strict=True)])
            except Exception:  # noqa: BLE001 - the receive reports what is wrong with the announcement
                return None
            return self.loader.target

        with self.receiver.receive_bucket(
            names=names,
            dtypes=entry.dtypes,
            shapes=shapes,
            group_name=group_name,
            load_format=load_format,
            checksum=checksum,
            seq=seq,
            segments=entry.segments,
            target=in_place_target(),
        ) as received:

            def load() -> None:
                load_all(self.loader, received, known)  # checks every name and shape before it writes any
                if weight_version is not None:
                    self.scheduler.set_version(weight_version)

            if self._paused_in_update() and weight_version in (None, self.scheduler.weight_version):
                # nothing to hand to the scheduler thread (the version is set; only it may change
                # that): loaded here, without two thread hops on the sync's critical path
                load_all(self.loader, received, known)
            else:
                self.scheduler.call(load, drain=True).result()  # the buffer is reused once this returns
        # fused QKVs received in place (only while paused in an update): their rows into q/k/v
        loaded = {name for name, _ in received}
        self.loader.unscramble([n for n in names if n not in loaded and grouped_qkv.parts(n) is not None])

    async def replay_weight_update(
        self, *, group_name: str, plan: str, weight_version: str, pause_mode: str | None
    ) -> None:
        """Start replaying the last announced update of ``group_name`` (tidal's replay_updates,
        weights_sync/replay.py): returns once ready to receive; a thread receives, loads, sets
        ``weight_version`` and joins the status reduce. Generation stays paused after a failed replay
        (its weights are partly new); the sender's next attempt announces the update and continues it."""
        entries = self.recorder.plan(group_name, plan)
        if entries is None or group_name not in self.receiver.groups:
            raise WeightUpdateError(
                f"no recorded update {plan!r} for group {group_name!r}: announce this update instead"
            )
        if pause_mode is not None and pause_mode not in PAUSE_MODES:
            raise BadRequest(f"pause_mode={pause_mode!r}: choose one of {list(PAUSE_MODES)}")
        # normally free at once (the previous replay ended before its sender returned): no thread hop then
        if not self._replaying.acquire(blocking=False) and not await asyncio.to_thread(
            self._replaying.acquire, timeout=self.config.weight_update_timeout_s
        ):
            raise WeightUpdateError("the previous replayed update is still running")
        try:
            if pause_mode is not None:
                await self.pause(pause_mode)
            self.in_weight_update = True
        except BaseException:
            self._replaying.release()
            raise

        def finish() -> None:
            # every bucket is loaded: the new version, and generation goes on before the status reduce
            # returns to the sender (whatever another engine reports, these weights are complete)
            self.in_weight_update = False

            def version_and_resume() -> None:  # one hop to the scheduler thread, which owns both
                self.scheduler.set_version(weight_version)
                if pause_mode is not None:
                    self.scheduler.resume()

            self.scheduler.call(version_and_resume).result()

        session = replay.ReplaySession(
            self.receiver.shared.group(group_name),
            entries,
            lambda entry, seq: self._receive_and_load(
                entry, group_name, "flattened_bucket", None, None, seq, known=True
            ),
            finish,
            lambda seq: self.receiver.shared.continue_at(group_name, seq),
            self._replay_pool,
        )

        def run() -> None:
            try:
                if not session.run():
                    self.in_weight_update = False
                    self.recorder.fail(group_name)
                    print(
                        f"replayed update of {group_name} failed: {session.error!r}",
                        file=sys.stderr,
                        flush=True,
                    )
            finally:
                self._replaying.release()

        self._replay_pool.submit(run)

    def get_weights_by_name(self, name: str, truncate_size: int) -> list:
        try:
            tensor = self.loader.read(name)
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

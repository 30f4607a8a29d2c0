"""Continuous batching: one scheduler thread owns the model and the KV pool and runs step after step.

Each step is either a prefill of waiting requests (they join the running batch) or one decode token for
every running request, as SGLang's default scheduler does. Everything that touches the model or the
requests (abort, pause, weight loads, version changes) runs on that thread between steps, submitted
through :meth:`Scheduler.call`, so the HTTP event loop never blocks on a forward pass.

Pause modes (SGLang's): ``abort`` finishes every request with an abort reason; ``retract`` frees their KV
slots and puts them back in the queue (prompt + output so far is prefilled again on resume);
``in_place`` keeps them as they are. New requests wait while paused. A weight load while not paused
waits until the running batch has drained (SGLang's writer lock), admitting nothing new meanwhile.
"""

from __future__ import annotations

import collections
import inspect
import threading
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.rollout.embedded.decode_step import DecodeGraphs, EagerDecode
from tidal.rollout.embedded.kv_cache import KVPool, StepBatch, StepCache
from tidal.rollout.embedded.lean import LeanDecoder, unsupported_reason
from tidal.rollout.embedded.prefill import LeanPrefill, lean_prefill_reason
from tidal.rollout.embedded.sampling import SamplingParams, sample

DEFAULT_VERSION = "default"
# how a decode step runs: transformers' modules; the lean forward (lean.py) on the exact rows; the lean
# forward padded to buckets (eager: how CPU tests check the CUDA-graph padding); CUDA graphs of the latter
DECODE_MODES = ("transformers", "lean", "bucketed", "cuda_graphs")
# lean decode steps per scheduler iteration while nothing joins, leaves by length or waits to run
DEFAULT_DECODE_BURST = 8
# how a prefill runs: the lean forward over the prompt tokens (prefill.py), or transformers' modules
PREFILL_MODES = ("lean", "transformers")


@dataclass(eq=False)  # identity: two requests with equal fields are still two requests
class Request:
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    on_done: Callable[[Request], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # (version that produced tokens up to here, number of output tokens at the change), as SGLang records
    version_events: list[tuple[str, int]] = field(default_factory=list)
    version_spans: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: str = DEFAULT_VERSION
    slot: int | None = None
    cached_len: int = 0
    generator: torch.Generator | None = None
    retractions: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids


def version_spans(events: list[tuple[str, int]], current: str, n_out: int) -> list[dict[str, Any]]:
    """Contiguous ``{version, start, end}`` spans over output token indices (end exclusive), SGLang's shape."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, n_out)]:
        end = min(end, n_out)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


class Scheduler:
    def __init__(
        self,
        lm: torch.nn.Module,
        *,
        max_batch_size: int,
        max_seq_len: int,
        max_prefill_tokens: int,
        device: str,
        eos_token_ids: list[int],
        seed: int = 0,
        decode: str | None = None,
        decode_burst: int = DEFAULT_DECODE_BURST,
        cpu_attention: str = "auto",
        prefill: str | None = None,
        cpu_step: str = "auto",
    ):
        """``decode``: one of DECODE_MODES; None picks CUDA graphs on CUDA, else the lean forward, and
        transformers' modules for models the lean forward does not cover (``decode_reason`` says why).
        ``decode_burst``: lean decode steps run back to back while no request joins or ends by length.
        ``cpu_attention``: the lean decode's attention on CPU (lean.CPU_ATTENTION; ``attention`` says which).
        ``cpu_step``: the lean decode and prefill as one native call per step on CPU, or PyTorch ops
        (lean.CPU_STEP; ``step`` says which and why).
        ``prefill``: one of PREFILL_MODES; None picks the lean prefill on CPU wherever the lean decode runs
        and ``prefill.lean_prefill_reason`` has no objection, else transformers' modules (``prefill_reason``)."""
        self.lm = lm
        self.decoder = lm.get_decoder()
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); older 5.x ignores ``cache`` silently,
        # which would make attention see only the new tokens.
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.lm_head = lm.get_output_embeddings()
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        if decode_burst < 1:
            raise ValueError(f"decode_burst={decode_burst} must be >= 1 (1: look at the requests every step)")
        self.decode_burst = decode_burst
        self.vocab_size = lm.config.vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.pool = KVPool(lm.config.num_hidden_layers, max_batch_size, max_seq_len, self.device)
        self.decode_mode, self.decode_reason = self._decode_mode(decode)
        self._lean_step: EagerDecode | DecodeGraphs | None = None
        self.attention = self.step = "transformers' modules"
        lean = None
        if self.decode_mode != "transformers":
            lean = LeanDecoder(lm, self.pool, cpu_attention=cpu_attention, cpu_step=cpu_step)
            self.attention = lean.attention
            if self.decode_mode == "lean":
                self._lean_step = EagerDecode(lean)
            else:
                graphs = self.decode_mode == "cuda_graphs"
                self._lean_step = DecodeGraphs(lean, max_batch_size, max_seq_len, capture=graphs)
            self.step = lean.step
        self._lean = lean
        self.prefill_mode, self.prefill_reason = self._prefill_mode(prefill, lean)
        self._lean_prefill = LeanPrefill(lean) if self.prefill_mode == "lean" else None
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.paused: str | None = None
        self.weight_version = DEFAULT_VERSION
        self._drain_calls: list[tuple[Callable[[], Any], Future]] = []
        self._calls: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        torch.manual_seed(seed)
        self.steps = 0
        self.prefill_rows = 0  # rows run through a prefill forward (a prompt shared by a group counts once)
        # OpenMP's thread count is per thread: the scheduler thread takes its creator's setting
        self._num_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="tidal-engine-scheduler", daemon=True)

    def _decode_mode(self, requested: str | None) -> tuple[str, str]:
        if requested is not None and requested not in DECODE_MODES:
            raise ValueError(f"decode={requested!r}: choose one of {list(DECODE_MODES)}")
        if requested == "transformers":
            return requested, "asked for"
        reason = unsupported_reason(self.lm)
        if reason is not None:
            if requested is not None:
                raise ValueError(f"decode={requested!r} is not available for this model: {reason}")
            return "transformers", f"the lean forward does not cover this model: {reason}"
        if requested == "cuda_graphs" and self.device.type != "cuda":
            raise ValueError(f"decode='cuda_graphs' needs a CUDA device; this engine runs on {self.device}")
        if requested is not None:
            return requested, "asked for"
        if self.device.type == "cuda":
            return "cuda_graphs", "default on CUDA"
        return "lean", "default on CPU"

    def _prefill_mode(self, requested: str | None, lean: LeanDecoder | None) -> tuple[str, str]:
        if requested is not None and requested not in PREFILL_MODES:
            raise ValueError(f"prefill={requested!r}: choose one of {list(PREFILL_MODES)}")
        if requested == "transformers":
            return requested, "asked for"
        if lean is None:
            reason = f"the decode runs transformers' modules ({self.decode_reason})"
        elif requested is None and self.device.type != "cpu":
            # the lean prefill's win is Python overhead on small CPU models; on an accelerator the kernels
            # dominate, and transformers' prefill is the one checked against the GPU suite
            reason = f"default on {self.device.type}"
        else:
            reason = lean_prefill_reason(lean)
        if reason is None:
            return "lean", "asked for" if requested else "default with the lean decode"
        if requested == "lean" and lean is None:
            raise ValueError(f"prefill='lean' is not available: {reason}")
        if requested == "lean":
            return "lean", f"asked for, although {reason}"
        return "transformers", reason

    # ---- called from other threads ----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def submit(self, req: Request) -> None:
        if req.params.sampling_seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.sampling_seed)
        with self._cond:
            self.waiting.append(req)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any], *, drain: bool = False) -> Future:
        """Run ``fn`` on the scheduler thread between steps .

        With ``drain``, ``fn`` waits until no request is running, or runs at once while paused.
        """
        fut: Future = Future()
        with self._cond:
            if self._error is not None:
                fut.set_exception(RuntimeError(f"engine scheduler died: {self._error!r}"))
                return fut
            (self._drain_calls if drain else self._calls).append((fn, fut))
            self._cond.notify_all()
        return fut

    # ---- scheduler thread ----

    def _loop(self) -> None:
        torch.set_num_threads(self._num_threads)
        try:
            if isinstance(self._lean_step, DecodeGraphs):
                self._capture_graphs()
            while True:
                with self._cond:
                    while not self._stop and not self._has_work():
                        self._cond.wait()
                    if self._stop:
                        return
                    calls = list(self._calls)
                    self._calls.clear()
                for fn, fut in calls:
                    _run_call(fn, fut)
                if self._drain_calls and (not self.running or self.paused is not None):
                    with self._cond:
                        drained = list(self._drain_calls)
                        self._drain_calls.clear()
                    for fn, fut in drained:
                        _run_call(fn, fut)
                    continue
                if self.paused is not None:
                    continue
                if self._graphs_stale():
                    self._capture_graphs()
                with torch.inference_mode():
                    if self.waiting and self.pool.free_slots and not self._drain_calls:
                        self._prefill()
                    elif self.running:
                        self._decode()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter, then the server reports unhealthy
            self._error = exc
            traceback.print_exc()
            self._fail_all(exc)

    def _capture_graphs(self) -> None:
        """Capture the padded step's CUDA graphs (the pool's slots must be free); if that fails, decode eagerly."""
        with torch.inference_mode():
            self._lean_step.capture_all()
        if self._lean_step.failure is not None:
            self.decode_mode = "lean"
            self.decode_reason = f"CUDA graph capture failed: {self._lean_step.failure}"
            self._lean_step = EagerDecode(self._lean_step.decoder)

    def _graphs_stale(self) -> bool:
        """Graphs were dropped (weights_moved) and can be captured now: no request holds a KV slot."""
        step = self._lean_step
        return isinstance(step, DecodeGraphs) and step.stale and self.pool.free_slots == self.pool.num_slots

    def _has_work(self) -> bool:
        if self._calls or (self._drain_calls and (not self.running or self.paused is not None)):
            return True
        if self.paused is not None:
            return False
        admit = self.waiting and self.pool.free_slots and not self._drain_calls
        return bool(admit or self.running)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            pending = list(self._calls) + list(self._drain_calls)
            self._calls.clear()
            self._drain_calls.clear()
            reqs = self.running + list(self.waiting)
            self.running, self.waiting = [], collections.deque()
        for _, fut in pending:
            fut.set_exception(RuntimeError(f"engine scheduler died: {exc!r}"))
        for req in reqs:
            self._finish(req, {"type": "abort", "message": f"engine error: {exc!r}", "status_code": 500})

    def _forward(self, batch: StepBatch, ids: torch.Tensor) -> torch.Tensor:
        out = self.decoder(
            input_ids=ids,
            position_ids=batch.position_ids,
            **{self._cache_kwarg: StepCache(self.pool, batch)},
            use_cache=False,
            tidal_step=batch,
        )
        if batch.decode:
            hidden = out.last_hidden_state[:, 0]
        else:
            hidden = out.last_hidden_state[torch.arange(batch.rows, device=self.device), batch.last_index]
        return self.lm_head(hidden)

    def _prefill(self) -> None:
        chosen: list[Request] = []
        tokens = 0
        with self._cond:
            while self.waiting and len(chosen) < self.pool.free_slots:
                n = len(self.waiting[0].all_ids)
                if chosen and tokens + n > self.max_prefill_tokens:
                    break
                chosen.append(self.waiting.popleft())
                tokens += n
        for req in chosen:
            req.slot = self.pool.allocate()
        chosen.sort(key=lambda r: r.slot)
        seqs = [r.all_ids for r in chosen]
        lengths = [len(s) for s in seqs]
        width = max(lengths)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.long).to(self.device)
        slots = [r.slot for r in chosen]
        if self._lean_prefill is not None:
            logits = self._prefill_shared(seqs, ids, lengths, slots)
        else:
            self.prefill_rows += len(chosen)
            logits = self._forward(StepBatch(slots, [0] * len(chosen), lengths, self.device), ids)
        for req, s in zip(chosen, seqs, strict=True):
            req.cached_len = len(s)
        self.running.extend(chosen)
        self.running.sort(key=lambda r: r.slot)
        self._emit(chosen, logits)

    def _prefill_shared(
        self, seqs: list[list[int]], ids: torch.Tensor, lengths: list[int], slots: list[int]
    ) -> torch.Tensor:
        """The lean prefill of each distinct sequence once (a group's n samples of one prompt arrive
        together); a repeated one gets its first copy's keys and values and logits, which are what its own
        prefill would compute."""
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(tuple(seq), row) for row, seq in enumerate(seqs)]
        unique = sorted(first.values())
        self.prefill_rows += len(unique)
        if len(unique) == len(seqs):
            return self._lean_prefill(ids, lengths, slots)
        logits = self._lean_prefill(ids[unique], [lengths[r] for r in unique], [slots[r] for r in unique])
        copies = [row for row in range(len(seqs)) if source[row] != row]
        width = max(lengths[r] for r in copies)
        dst = torch.tensor([slots[r] for r in copies], device=self.device)
        src = torch.tensor([slots[source[r]] for r in copies], device=self.device)
        for buffers in (self.pool.keys, self.pool.values):
            for buf in buffers:
                buf[dst, :, :width] = buf[src, :, :width]
        position = {row: i for i, row in enumerate(unique)}
        return logits[torch.tensor([position[source[r]] for r in range(len(seqs))], device=self.device)]

    def _compact(self) -> None:
        """Keep the running requests in slots 0..n-1: move the highest ones into the holes finished ones left.

        Decode then attends over a view of the pool (no gather), and the lean forward's padding rows are free.
        """
        n = len(self.running)
        held = {r.slot for r in self.running}
        holes = [s for s in range(n) if s not in held]
        movers = sorted((r for r in self.running if r.slot >= n), key=lambda r: r.slot)
        for req, dst in zip(movers, holes, strict=True):
            self.pool.take(dst)
            self.pool.move(req.slot, dst, req.cached_len)
            self.pool.release(req.slot)
            req.slot = dst
        if movers:
            self.running.sort(key=lambda r: r.slot)

    def _decode(self) -> None:
        self._compact()
        reqs = self.running
        positions = [r.cached_len for r in reqs]
        if self._lean_step is None:
            batch = StepBatch([r.slot for r in reqs], positions, [1] * len(reqs), self.device)
            ids = torch.tensor([[r.output_ids[-1]] for r in reqs], dtype=torch.long, device=self.device)
            logits = self._forward(batch, ids)
            for r in reqs:
                r.cached_len += 1
            self._emit(reqs, logits)
            return
        # a burst of decode steps: each step's sampled tokens feed the next on the device, and the host reads
        # the burst's tokens once at its end (no per-step .tolist(), no per-step Python over the requests)
        steps = self._burst_length(reqs)
        params, generators = [r.params for r in reqs], [r.generator for r in reqs]
        ids = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long, device=self.device)
        start = torch.tensor(positions, dtype=torch.long, device=self.device)
        last, uniform = max(positions), min(positions) == max(positions)
        # every row greedy: the native step picks the tokens and their logprobs itself (EagerDecode.greedy)
        greedy = getattr(self._lean_step, "greedy", None) if all(p.greedy for p in params) else None
        tokens, logprobs = [], []
        for step in range(steps):
            args = (ids, start + step if step else start, last + step, uniform)
            picked = greedy(*args) if greedy is not None else None
            ids, chosen = picked if picked is not None else sample(self._lean_step(*args), params, generators)
            tokens.append(ids)
            logprobs.append(chosen)
        self.steps += steps
        for r in reqs:
            r.cached_len += steps
        self._append(reqs, torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist())

    def _burst_length(self, reqs: list[Request]) -> int:
        """Decode steps to run before looking at requests again: 1 while something waits (a call, a request
        that could be admitted); else up to ``decode_burst``, never past the step where a request reaches its
        length limit. A stop token ends its request inside a burst: the later tokens of that row are dropped."""
        if (
            self.decode_burst <= 1
            or self._calls
            or self._drain_calls
            or (self.waiting and self.pool.free_slots)
        ):
            return 1
        left = min(
            min(r.params.max_new_tokens, self.max_seq_len - len(r.input_ids)) - len(r.output_ids)
            for r in reqs
        )
        return max(1, min(self.decode_burst, left))

    def _emit(self, reqs: list[Request], logits: torch.Tensor) -> None:
        self.steps += 1
        tokens, logprobs = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        self._append(reqs, [[t] for t in tokens.tolist()], [[lp] for lp in logprobs.tolist()])

    def _append(self, reqs: list[Request], tokens: list[list[int]], logprobs: list[list[float]]) -> None:
        """Give each request its new tokens in order, up to the one that finishes it (the rest are dropped)."""
        done = []
        for req, toks, lps in zip(reqs, tokens, logprobs, strict=True):
            p = req.params
            room = min(p.max_new_tokens, self.max_seq_len - len(req.input_ids)) - len(req.output_ids)
            take = max(1, min(len(toks), room))
            stops = set(p.stop_token_ids) if p.ignore_eos else self.eos_token_ids.union(p.stop_token_ids)
            if stops:
                take = next((i + 1 for i, tok in enumerate(toks[:take]) if tok in stops), take)
            req.output_ids += toks[:take]
            req.output_logprobs += lps[:take]
            reason = self._finish_reason(req, toks[take - 1])
            if reason is not None:
                done.append((req, reason))
        for req, reason in done:
            self._finish(req, reason)

    def _finish_reason(self, req: Request, tok: int) -> dict[str, Any] | None:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(req.input_ids) + len(req.output_ids) >= self.max_seq_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            self.pool.release(req.slot)
            req.slot = None
        req.cached_len = 0

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        self._release(req)
        if req in self.running:
            self.running.remove(req)
        req.finish_reason = reason
        req.weight_version = self.weight_version
        req.version_spans = version_spans(req.version_events, self.weight_version, len(req.output_ids))
        if req.on_done is not None:
            req.on_done(req)

    # ---- operations run through call() ----

    def finish_without_running(self, req: Request) -> None:
        """A request that asks for no new tokens (max_new_tokens=0) finishes at once, as in SGLang."""
        self._finish(req, {"type": "length", "length": 0})

    def abort(self, rid: str | None, abort_all: bool, message: str = "Aborted by /abort_request.") -> int:
        with self._cond:
            victims = [r for r in [*self.running, *self.waiting] if abort_all or r.rid == rid]
            self.waiting = collections.deque(r for r in self.waiting if r not in victims)
        for req in victims:
            self._finish(req, {"type": "abort", "message": message, "status_code": 200})
        return len(victims)

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(None, True, message="Aborted by /pause_generation (mode=abort).")
        elif mode == "retract":
            for req in reversed(self.running):
                self._release(req)
                req.retractions += 1
                self.waiting.appendleft(req)
            self.running = []
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def set_version(self, version: str) -> None:
        if version == self.weight_version:
            return
        for req in [*self.running, *self.waiting]:
            if req.output_ids:
                req.version_events.append((self.weight_version, len(req.output_ids)))
        self.weight_version = version

    def weights_moved(self) -> None:
        """Refresh whatever holds the weights' addresses after they moved (``arena.relayout``). Run it on the
        scheduler thread (through :meth:`call`) or while the scheduler runs no step.

        The lean decoder takes the model's tensors again and re-points the native step at them; captured CUDA
        graphs are dropped and captured again before the first step that finds every KV slot free (until
        then the padded step runs eagerly). The lean prefill reads through the decoder and transformers'
        modules read their own parameters; the rotary tables and the KV pool are not weights."""
        if self._lean is not None:
            self._lean.refresh_weights()
            self.step = self._lean.step  # says so if the native step no longer applies
        if isinstance(self._lean_step, DecodeGraphs):
            self._lean_step.drop_graphs()

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "paused": self.paused,
            "steps": self.steps,
            "prefill_rows": self.prefill_rows,
            "free_slots": self.pool.free_slots,
            "decode": self.decode_mode,
            "decode_reason": self.decode_reason,
            "decode_attention": self.attention,
            "cpu_step": self.step,
            "prefill": self.prefill_mode,
            "prefill_reason": self.prefill_reason,
        }


def _run_call(fn: Callable[[], Any], fut: Future) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - handed to the caller
        fut.set_exception(exc)

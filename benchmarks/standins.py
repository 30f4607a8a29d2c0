"""Timed stand-ins for what the async-vs-sync benchmark does not measure: generation and the train step.

Everything else (broker, node agents, engine pool, trainer loop, wire protocol) is the real system; these
stand-ins only take the time that a real engine or optimizer step would, so that the benchmark measures
the system's scheduling.

- :class:`StandinEngine` is an :class:`~tidal.rollout.engine.EngineClient`. ``generate`` draws an output
  length from a named distribution and sleeps ``per_token_s`` per output token. Each token carries the
  weight version that was current when it was "produced" (token ``i`` of a request that ran from ``t0``
  to ``t1`` is produced at ``t0 + (i + 1) * (t1 - t0) / n``), as SGLang's in-place updates report them.
  Requests do not slow each other down: an engine's capacity is its concurrency (the pool's limit).
- :class:`StandinTask` gives the agent fixed-length prompts and a deterministic 0/1 reward.
- :class:`TrainStepCost` is the train step: ``overhead_s + per_token_s * tokens in the batch``.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from tidal.broker.types import Batch, PromptRow
from tidal.rollout.engine import EngineClient, EngineError, GenerateResult, token_versions
from tidal.rollout.tasks.base import Score

# --- output length distributions -----------------------------------------------------------------


class LogNormalLengths(BaseModel):
    """Output lengths ``min(max_tokens, ceil(X))`` with ``ln X ~ Normal(ln median, sigma)``.

    The default (median 128, sigma 1.0, cap 2048) has the shape reported for long-reasoning outputs: most
    responses short, a long right tail (the 99th percentile is ``e^(2.33 sigma)`` = 10.3x the median, and
    about 1 in 360 responses reaches 16x the median and is truncated at ``max_tokens``).
    """

    model_config = ConfigDict(extra="forbid")

    type: Literal["lognormal"] = "lognormal"
    median: float = Field(128.0, gt=0, description="median output length in tokens")
    sigma: float = Field(1.0, gt=0, description="standard deviation of ln(length)")
    max_tokens: int = Field(2048, ge=1, description="truncation (the sampling's max_new_tokens)")

    def draw(self, rng: np.random.Generator, size: int | None = None) -> Any:
        x = rng.lognormal(math.log(self.median), self.sigma, size)
        return np.clip(np.ceil(x), 1, self.max_tokens).astype(np.int64)

    def mean(self) -> float:
        return self.mean_max(1)

    def mean_max(self, k: int) -> float:
        """Exact expected longest of ``k`` draws: ``E[max] = sum_{j=0}^{max_tokens-1} (1 - P(L <= j)^k)``,
        where ``P(L <= j) = P(X <= j)`` for integers ``j >= 1`` and ``P(L <= 0) = 0``."""
        mu, s = math.log(self.median), self.sigma
        below = [
            1 - 0.5 * math.erfc((math.log(j) - mu) / (s * math.sqrt(2))) for j in range(1, self.max_tokens)
        ]
        return 1.0 + sum(1 - p**k for p in below)

    def describe(self) -> str:
        return f"lognormal(median={self.median:g}, sigma={self.sigma:g}), ceil, capped at {self.max_tokens}"


class EmpiricalLengths(BaseModel):
    """Output lengths resampled (with replacement) from measured ones: a JSON list or one integer a line."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["empirical"] = "empirical"
    path: str = Field(description="file of observed output lengths (JSON list, or one integer per line)")
    max_tokens: int | None = Field(None, ge=1, description="truncation; None: the largest observed length")
    _values: np.ndarray = PrivateAttr()

    @model_validator(mode="after")
    def _load(self) -> EmpiricalLengths:
        values = load_lengths(self.path)
        if self.max_tokens is None:
            self.max_tokens = int(values.max())
        self._values = np.minimum(values, self.max_tokens)
        return self

    def draw(self, rng: np.random.Generator, size: int | None = None) -> Any:
        return rng.choice(self._values, size)

    def mean(self) -> float:
        return float(self._values.mean())

    def mean_max(self, k: int) -> float:
        """Exact expected longest of ``k`` draws: ``sum_{j=0}^{max-1} (1 - P(L <= j)^k)``."""
        ordered = np.sort(self._values)
        below = np.searchsorted(ordered, np.arange(int(ordered[-1])), side="right") / ordered.size
        return float(np.sum(1 - below**k))

    def describe(self) -> str:
        return f"empirical({self.path}: {len(self._values)} lengths, capped at {self.max_tokens})"


def load_lengths(path: str | Path) -> np.ndarray:
    text = Path(path).read_text()
    try:
        raw = json.loads(text) if text.lstrip().startswith("[") else [int(v) for v in text.split()]
        values = np.asarray(raw, dtype=np.int64)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"{path}: output lengths must be a JSON list of integers or one integer per line ({exc})"
        ) from None
    if values.ndim != 1 or values.size == 0 or (values < 1).any():
        raise ValueError(f"{path}: need at least one output length, every one >= 1")
    return values


LengthDistribution = Annotated[LogNormalLengths | EmpiricalLengths, Field(discriminator="type")]


# --- the engine ----------------------------------------------------------------------------------


def version_spans(
    changes: list[tuple[float, str]], start: float, step: float, n: int
) -> list[dict[str, Any]]:
    """SGLang's ``weight_versions`` spans (``{version, start, end}``, end exclusive) of ``n`` tokens, token
    ``i`` produced at ``start + (i + 1) * step``, under ``changes``: (time, version) in time order, the first
    one covering all earlier times. A token carries the last version set at or before its time."""
    if n == 0:
        return []
    times = [t for t, _ in changes]
    first = bisect.bisect_right(times, start + step) - 1  # the version of token 0
    if first < 0:
        raise ValueError(f"no version covers time {start + step}: the first change is at {times[0]}")
    spans, begin, version = [], 0, changes[first][1]
    for t, v in changes[first + 1 :]:
        at = max(begin, math.ceil((t - start) / step) - 1)  # the first token produced at or after t
        if at >= n:
            break
        if at > begin:
            spans.append({"version": version, "start": begin, "end": at})
            begin = at
        version = v
    spans.append({"version": version, "start": begin, "end": n})
    return spans


class StandinEngine(EngineClient):
    """An engine that takes ``per_token_s`` per output token and holds no weights.

    It follows policy versions through ``update_weight_version`` (what a weight update sets on SGLang);
    the routes that move weights raise, since there are none to move. ``pause`` in any mode stops new
    requests until ``resume``; in ``abort`` mode it also aborts the running ones (they return the tokens
    produced so far, ``finish_reason: abort``). Unlike SGLang's ``in_place`` pause, running requests are
    not frozen: the benchmark never pauses.
    """

    def __init__(
        self,
        url: str,
        lengths: LogNormalLengths | EmpiricalLengths,
        *,
        per_token_s: float,
        seed: int,
        version: str = "0",
    ) -> None:
        if per_token_s <= 0:
            raise ValueError(f"per_token_s must be > 0, got {per_token_s}")
        self.url = url
        self.lengths = lengths
        self.per_token_s = per_token_s
        self._rng = np.random.default_rng(seed)
        # (loop time of the change, version) in time order; the first entry covers all earlier tokens
        self._changes: list[tuple[float, str]] = [(-math.inf, version)]
        self._running: dict[str, asyncio.Event] = {}
        self._accepting = asyncio.Event()
        self._accepting.set()
        self.requests = 0
        self.tokens = 0

    @property
    def version(self) -> str:
        return self._changes[-1][1]

    async def health(self) -> bool:
        return True

    async def wait_healthy(self, timeout_s: float) -> None:
        return None

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        await self._accepting.wait()
        max_new = int(sampling_params.get("max_new_tokens") or self.lengths.max_tokens)
        drawn = int(self.lengths.draw(self._rng))
        n = min(drawn, max_new)
        rid = rid or uuid.uuid4().hex
        aborted = self._running[rid] = asyncio.Event()
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            await asyncio.wait_for(aborted.wait(), n * self.per_token_s)
        except TimeoutError:
            pass
        finally:
            self._running.pop(rid, None)
        end = loop.time()
        if aborted.is_set():
            produced = min(n, int((end - start) / self.per_token_s))
            step = self.per_token_s
            finish: dict[str, Any] = {"type": "abort", "message": "aborted by the stand-in engine"}
        else:
            produced, step = n, (end - start) / n
            stop_ids = sampling_params.get("stop_token_ids") or []
            if drawn <= max_new and stop_ids:
                finish = {"type": "stop", "matched": int(stop_ids[0])}
            else:
                finish = {"type": "length", "length": produced}
        output_ids = [1] * produced
        if finish["type"] == "stop" and produced:
            output_ids[-1] = finish["matched"]
        meta = {
            "weight_version": self.version,
            "weight_versions": version_spans(self._changes, start, step, produced),
        }
        self.requests += 1
        self.tokens += produced
        return GenerateResult(
            rid=rid,
            output_ids=output_ids,
            output_logprobs=[-1.0] * produced,
            finish_reason=finish,
            weight_version=meta["weight_version"],
            token_versions=token_versions(meta, produced),
            prompt_tokens=len(input_ids),
            raw={"meta_info": meta},
        )

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        self._changes.append((asyncio.get_running_loop().time(), str(new_version)))
        if abort_all_requests:
            await self.abort(abort_all=True)

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        for key, event in list(self._running.items()):
            if abort_all or key == rid:
                event.set()

    async def pause(self, mode: str = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise EngineError(
                "/pause_generation", 400, f"mode must be abort, retract or in_place, got {mode!r}"
            )
        self._accepting.clear()
        if mode == "abort":
            await self.abort(abort_all=True)

    async def resume(self) -> None:
        self._accepting.set()

    async def flush_cache(self) -> bool:
        return True

    async def model_info(self) -> dict[str, Any]:
        return {"model_path": "stand-in", "weight_version": self.version, "is_generation": True}

    async def server_info(self) -> dict[str, Any]:
        return {
            "version": "stand-in",
            "lengths": self.lengths.describe(),
            "per_token_s": self.per_token_s,
            "requests": self.requests,
            "tokens": self.tokens,
        }

    def _no_weights(self, route: str) -> EngineError:
        return EngineError(
            route, None, "the stand-in engine holds no weights; it follows versions via update_weight_version"
        )

    async def init_weights_update_group(self, **_: Any) -> None:
        raise self._no_weights("/init_weights_update_group")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        raise self._no_weights("/destroy_weights_update_group")

    async def begin_weight_update(self) -> None:
        raise self._no_weights("/begin_weight_update")

    async def end_weight_update(self) -> None:
        raise self._no_weights("/end_weight_update")

    async def update_weights_from_distributed(self, **_: Any) -> None:
        raise self._no_weights("/update_weights_from_distributed")

    async def needs_weight_update_session(self) -> bool:
        return False

    async def close(self) -> None:
        await self.abort(abort_all=True)


# --- the task --------------------------------------------------------------------------------------


class StandinTask:
    """What the node agent asks of a :class:`~tidal.rollout.tasks.base.Task`, without a tokenizer:
    ``prompt_tokens`` ids per prompt, and reward 1 for odd-length responses (any value would do)."""

    stop_token_ids = [2]

    def __init__(self, prompt_tokens: int) -> None:
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        self.prompt_tokens = prompt_tokens

    def prompt_ids(self, row: PromptRow) -> list[int]:
        return [3 + (row.index + i) % 64 for i in range(self.prompt_tokens)]

    async def score(self, row: PromptRow, response_ids: Sequence[int]) -> Score:
        return Score(reward=float(len(response_ids) % 2))

    def close(self) -> None:
        return None


# --- the train step --------------------------------------------------------------------------------


def batch_tokens(batch: Batch) -> int:
    """Prompt plus response tokens of every sample: what a train step processes."""
    return sum(s.prompt_ids.size + s.response_ids.size for g in batch.groups for s in g.samples)


class TrainStepCost(BaseModel):
    """A train step takes ``overhead_s + per_token_s * tokens`` (forward/backward grow with tokens; the
    optimizer step and the collective launch do not)."""

    model_config = ConfigDict(extra="forbid")

    overhead_s: float = Field(0.0, ge=0, description="fixed time of every step")
    per_token_s: float = Field(gt=0, description="time per prompt or response token in the batch")

    def seconds(self, tokens: float) -> float:
        return self.overhead_s + self.per_token_s * tokens

    def run(self, batch: Batch) -> float:
        """Take the step's time for ``batch``; returns the seconds it should take."""
        seconds = self.seconds(batch_tokens(batch))
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(left)
        return seconds

"""One sample's generation over SGLang's ``/generate``, resumable across aborts and engine failures.

A response is built from segments. Each segment is one ``/generate`` call on ``prompt + tokens so far``
asking for the tokens still allowed. A group's first segments can go out as one call with
``sampling_params.n`` (:func:`generate_group`): one HTTP request, and the engine prefills the ``n`` rows
together. A segment that ends with ``finish_reason: abort`` (a weight update in
``abort`` mode, AReaL's partial rollout) or that fails because its engine died is simply followed by
another segment, on whichever engine is free; tokens, logprobs and per-token policy versions are
concatenated, so every token keeps the version that produced it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.rollout.config import AgentConfig
from tidal.rollout.engine import GenerateResult
from tidal.rollout.engine_pool import EnginePool, EngineRejected, EngineUnavailable

log = logging.getLogger(__name__)


class SampleFailed(RuntimeError):
    """A sample cannot be finished (the engine rejected its request, or it was resumed too often)."""


def parse_version(version: Any) -> int:
    """An engine's ``weight_version`` -> policy version. SGLang reports the string ``"default"`` until the
    first update names a version; those are the initial weights, version 0."""
    if version is None:
        return 0
    try:
        return int(version)
    except (TypeError, ValueError):
        return 0


@dataclass
class Segment:
    """What one ``/generate`` call produced."""

    token_ids: list[int]
    logprobs: list[float]
    versions: np.ndarray
    finish_reason: str
    finish_details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_result(cls, result: GenerateResult) -> Segment:
        n = len(result.output_ids)
        if len(result.output_logprobs) != n or any(math.isnan(lp) for lp in result.output_logprobs):
            raise SampleFailed(
                f"engine returned {n} output ids but {len(result.output_logprobs)} logprobs (or nulls); "
                "requests must set return_logprob=true"
            )
        return cls(
            token_ids=[int(t) for t in result.output_ids],
            logprobs=[float(lp) for lp in result.output_logprobs],
            versions=np.array([parse_version(v) for v in result.token_versions], dtype=np.int32),
            finish_reason=result.finish_type or "abort",
            finish_details=dict(result.finish_reason),
        )


@dataclass
class PartialResponse:
    """A response under construction: every segment so far, concatenated."""

    prompt_ids: list[int]
    max_new_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)
    finish_reason: str | None = None
    segments: int = 0
    resumes: int = 0  # segments that ended in abort and were continued
    retries: int = 0  # requests lost with their engine and sent again

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def request_input_ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add(self, segment: Segment) -> None:
        take = min(len(segment.token_ids), self.remaining)  # an engine may not exceed what was asked
        self.token_ids += segment.token_ids[:take]
        self.logprobs += segment.logprobs[:take]
        self.versions.append(segment.versions[:take])
        self.segments += 1
        if segment.finish_reason in ("stop", "length"):
            self.finish_reason = segment.finish_reason
        elif self.remaining <= 0:
            self.finish_reason = "length"
        else:
            self.resumes += 1

    def version_array(self) -> np.ndarray:
        if not self.versions:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(self.versions).astype(np.int32, copy=False)


def sampling_params(
    base: dict[str, Any], partial: PartialResponse, stop_token_ids: list[int]
) -> dict[str, Any]:
    """SGLang sampling params for the next segment of ``partial``."""
    params = {**base, "max_new_tokens": partial.remaining}
    if stop_token_ids:
        params["stop_token_ids"] = list(stop_token_ids)
    return params


def _check_resumable(partial: PartialResponse, segment: Segment, limits: AgentConfig) -> None:
    """After an aborted segment: fail the sample when the engine refused it or it was resumed too often."""
    status = segment.finish_details.get("status_code")
    if isinstance(status, int) and 400 <= status < 500:
        raise SampleFailed(f"engine aborted the request: {segment.finish_details.get('message')}")
    if partial.resumes > limits.max_resumes:
        raise SampleFailed(f"aborted {partial.resumes} times (rollout.agent.max_resumes)")


def _engine_failed(partials: list[PartialResponse], exc: EngineUnavailable, limits: AgentConfig) -> None:
    """Count a request lost with its engine against each of its samples; give up past max_retries."""
    for partial in partials:
        partial.retries += 1
    retries = max(p.retries for p in partials)
    if retries > limits.max_retries:
        raise SampleFailed(f"{retries} engine failures, the last: {exc}") from exc
    log.warning("resending a request (%d/%d): %s", retries, limits.max_retries, exc)


async def _continue(
    pool: EnginePool,
    partial: PartialResponse,
    rid: str,
    *,
    sampling: dict[str, Any],
    stop_token_ids: list[int],
    limits: AgentConfig,
    backoff: float | None = None,
) -> PartialResponse:
    """Segments of one sample until it stops, resuming aborts and engine failures. ``backoff``: wait this
    long before the first segment (the previous one was aborted without producing anything)."""
    delay = limits.resume_backoff_s
    if backoff is not None:
        await asyncio.sleep(backoff)
        delay = min(backoff * 2, 2.0)
    while not partial.done:
        params = sampling_params(sampling, partial, stop_token_ids)
        try:
            async with pool.slot() as slot:
                segment_rid = f"{rid}-{partial.segments}-{partial.retries}"  # SGLang needs unique rids
                result = await pool.generate(slot, partial.request_input_ids(), params, rid=segment_rid)
        except EngineUnavailable as exc:
            _engine_failed([partial], exc, limits)
            continue
        except EngineRejected as exc:
            raise SampleFailed(str(exc)) from exc
        segment = Segment.from_result(result)
        partial.add(segment)
        if partial.done:
            break
        # an aborted segment: a weight update in abort mode, or the engine refusing the request
        _check_resumable(partial, segment, limits)
        if segment.token_ids:
            delay = limits.resume_backoff_s
        else:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
    return partial


async def generate(
    pool: EnginePool,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: dict[str, Any],
    stop_token_ids: list[int],
    limits: AgentConfig,
) -> PartialResponse:
    """One response to ``prompt_ids``: segments until it stops, resuming aborts and engine failures."""
    partial = PartialResponse(list(prompt_ids), max_new_tokens)
    return await _continue(
        pool, partial, uuid.uuid4().hex, sampling=sampling, stop_token_ids=stop_token_ids, limits=limits
    )


async def generate_group(
    pool: EnginePool,
    prompt_ids: list[int],
    n: int,
    *,
    max_new_tokens: int,
    sampling: dict[str, Any],
    stop_token_ids: list[int],
    limits: AgentConfig,
) -> list[PartialResponse]:
    """``n`` responses to ``prompt_ids``, started as one ``/generate`` with ``sampling_params.n`` (one HTTP
    request, and the engine prefills the n rows together). A sample whose segment was aborted continues on
    its own, as :func:`generate` does; a request lost with its engine is sent again whole."""
    partials = [PartialResponse(list(prompt_ids), max_new_tokens) for _ in range(n)]
    rid = uuid.uuid4().hex
    params = sampling_params(sampling, partials[0], stop_token_ids)
    while True:
        try:
            async with pool.slot(n) as slot:
                request_rid = f"{rid}-{partials[0].retries}"  # SGLang needs unique rids
                results = await pool.generate_n(slot, list(prompt_ids), params, n, rid=request_rid)
            break
        except EngineUnavailable as exc:
            _engine_failed(partials, exc, limits)
        except EngineRejected as exc:
            raise SampleFailed(str(exc)) from exc
    if len(results) != n:
        raise SampleFailed(f"engine returned {len(results)} responses to a request for n={n} samples")
    unfinished = []
    for index, (partial, result) in enumerate(zip(partials, results, strict=True)):
        segment = Segment.from_result(result)
        partial.add(segment)
        if not partial.done:
            _check_resumable(partial, segment, limits)
            wait = None if segment.token_ids else limits.resume_backoff_s
            unfinished.append((index, partial, wait))
    if unfinished:
        jobs = [
            asyncio.ensure_future(
                _continue(
                    pool,
                    partial,
                    f"{rid}_{index}",
                    sampling=sampling,
                    stop_token_ids=stop_token_ids,
                    limits=limits,
                    backoff=wait,
                )
            )
            for index, partial, wait in unfinished
        ]
        try:
            await asyncio.gather(*jobs)
        except BaseException:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            raise
    return partials

"""One sample's generation over SGLang's ``/generate``, resumable across aborts and engine failures.

A response is built from segments. Each segment is one ``/generate`` call on ``prompt + tokens so far``
asking for the tokens still allowed. A segment that ends with ``finish_reason: abort`` (a weight update in
``abort`` mode, AReaL's partial rollout) or that fails because its engine died is simply followed by
another segment, on whichever engine is free; tokens, logprobs and per-token policy versions are
concatenated, so every token keeps the version that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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


def token_versions(meta_info: dict[str, Any], num_tokens: int) -> np.ndarray:
    """Per-token policy versions of one response, from SGLang's ``weight_versions`` spans
    (``[{"version", "start", "end"}]`` over output tokens) or, without spans, its ``weight_version``."""
    versions = np.full(num_tokens, parse_version(meta_info.get("weight_version")), dtype=np.int32)
    for span in meta_info.get("weight_versions") or []:
        if isinstance(span, dict):
            version, start, end = span.get("version"), span.get("start", 0), span.get("end", 0)
        else:  # msgspec's array-like encoding [version, start, end]
            version, start, end = span
        versions[max(0, int(start)) : min(num_tokens, int(end))] = parse_version(version)
    return versions


def finish_type(meta_info: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """SGLang's ``finish_reason`` ({"type": "stop" | "length" | "abort", ...} or None) -> (type, details)."""
    reason = meta_info.get("finish_reason")
    if reason is None:
        return "abort", {}
    if isinstance(reason, str):
        return reason, {}
    return str(reason.get("type", "abort")), reason


@dataclass
class Segment:
    """What one ``/generate`` call produced."""

    token_ids: list[int]
    logprobs: list[float]
    versions: np.ndarray
    finish_reason: str
    finish_details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_response(cls, response: dict[str, Any]) -> Segment:
        meta = response.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        token_ids = response.get("output_ids")
        if token_ids is None:
            token_ids = [int(e[1]) for e in entries]
        if len(entries) != len(token_ids):
            raise SampleFailed(
                f"engine returned {len(token_ids)} output ids but {len(entries)} logprobs; "
                "requests must set return_logprob=true"
            )
        reason, details = finish_type(meta)
        return cls(
            token_ids=[int(t) for t in token_ids],
            logprobs=[float(e[0]) if e[0] is not None else 0.0 for e in entries],
            versions=token_versions(meta, len(token_ids)),
            finish_reason=reason,
            finish_details=details,
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

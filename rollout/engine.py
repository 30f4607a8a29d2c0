"""What the node agent needs from an inference engine, whichever serves it (SGLang or the embedded one).

Both engines speak SGLang's native HTTP protocol, so one implementation (:mod:`tidal.rollout.http_client`)
serves both; this module is the seam the agent codes against, plus the result type it reads.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


class EngineError(RuntimeError):
    """An engine answered a route with an error status (or could not be reached)."""

    def __init__(self, route: str, status: int | None, message: str):
        super().__init__(
            f"{route}: HTTP {status}: {message}" if status is not None else f"{route}: {message}"
        )
        self.route = route
        self.status = status
        self.message = message


@dataclass
class GenerateResult:
    """One finished generation, read from SGLang's ``/generate`` response."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    weight_version: str | None
    # the weight version that produced each output token (from meta_info.weight_versions spans)
    token_versions: list[str | None]
    prompt_tokens: int
    text: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def finish_type(self) -> str:
        """``stop``, ``length`` or ``abort`` (SGLang's finish_reason ``type``)."""
        return str(self.finish_reason.get("type", ""))

    @property
    def aborted(self) -> bool:
        return self.finish_type == "abort"


def token_versions(meta: dict[str, Any], n_out: int) -> list[str | None]:
    """Expand SGLang's ``weight_versions`` spans (``{version, start, end}``, end exclusive) to one per token.

    An engine that reports no spans (SGLang before per-token versions) gets its single
    ``weight_version`` on every token.
    """
    spans = meta.get("weight_versions") or []
    if not spans:
        return [meta.get("weight_version")] * n_out
    out: list[str | None] = [None] * n_out
    for span in spans:
        for i in range(max(0, span["start"]), min(n_out, span["end"])):
            out[i] = span["version"]
    if None in out:
        raise ValueError(f"weight_versions spans {spans} do not cover all {n_out} output tokens")
    return out


class EngineClient(abc.ABC):
    """An engine reached over SGLang's HTTP protocol."""

    url: str

    @abc.abstractmethod
    async def health(self) -> bool: ...

    @abc.abstractmethod
    async def wait_healthy(self, timeout_s: float) -> None: ...

    @abc.abstractmethod
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult: ...

    async def generate_n(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        n: int,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> list[GenerateResult]:
        """``n`` samples of one prompt. SGLang's shape is one ``/generate`` with ``sampling_params.n`` whose
        requests are named ``{rid}_{i}``; this default sends ``n`` requests under those names instead."""
        params = {k: v for k, v in sampling_params.items() if k != "n"}
        return list(
            await asyncio.gather(
                *(
                    self.generate(
                        input_ids,
                        params,
                        rid=None if rid is None else f"{rid}_{i}",
                        return_logprob=return_logprob,
                    )
                    for i in range(n)
                )
            )
        )

    @abc.abstractmethod
    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None: ...

    @abc.abstractmethod
    async def pause(self, mode: str = "abort") -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def flush_cache(self) -> bool: ...

    @abc.abstractmethod
    async def model_info(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def server_info(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None: ...

    @abc.abstractmethod
    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    @abc.abstractmethod
    async def begin_weight_update(self) -> None: ...

    @abc.abstractmethod
    async def end_weight_update(self) -> None: ...

    @abc.abstractmethod
    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = False,
        abort_all_requests: bool = False,
    ) -> None: ...

    @abc.abstractmethod
    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None: ...

    @abc.abstractmethod
    async def needs_weight_update_session(self) -> bool:
        """Whether updates must sit between begin/end_weight_update (SGLang >= 0.5.23)."""

    @contextlib.asynccontextmanager
    async def weight_update_session(self) -> AsyncIterator[None]:
        """begin/end_weight_update around the body when the engine needs them (a no-op otherwise)."""
        needed = await self.needs_weight_update_session()
        if needed:
            await self.begin_weight_update()
        try:
            yield
        finally:
            if needed:
                await self.end_weight_update()

    @abc.abstractmethod
    async def close(self) -> None: ...

"""The one async HTTP client for both engines (an SGLang server or tidal's embedded engine).

Requests are SGLang's native JSON (``sglang/srt/managers/io_struct.py``); responses are read as
``sglang/api/v1/api_types.py`` describes them. The version probe decides whether weight updates need
``begin_weight_update`` / ``end_weight_update`` around them (SGLang >= 0.5.23).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp

from tidal.rollout.engine import EngineClient, EngineError, GenerateResult, token_versions

# First SGLang release whose weight updates sit in a begin/end_weight_update session.
SESSION_VERSION = (0, 5, 23)


def parse_version(text: str) -> tuple[int, ...] | None:
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if m is None:
        return None
    return tuple(int(x or 0) for x in m.groups())


class Response:
    """An engine's HTTP reply, read whole."""

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class SGLangClient(EngineClient):
    """aiohttp underneath: per request it costs a fraction of httpx's CPU, whose connection pool checks
    every pooled connection on each request (a rollout node keeps ~100 requests in flight)."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, max_connections: int = 512):
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=10.0)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._version: tuple[int, ...] | None = None
        self._version_probed = False

    # ---- plumbing ----

    def _http(self) -> aiohttp.ClientSession:
        # created on first use: an aiohttp session belongs to the event loop that runs it
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session_loop = loop
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                json_serialize=json.dumps,
            )
        return self._session

    def build(self, route: str, body: dict[str, Any] | None) -> dict[str, Any] | None:
        """The JSON body sent to ``route`` (a hook the tests use to validate every request built)."""
        return body

    async def _send(self, method: str, route: str, payload: Any, timeout_s: float | None = None) -> Response:
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        async with self._http().request(method, self.url + route, json=payload, timeout=timeout) as resp:
            return Response(resp.status, await resp.read())

    async def _request(self, method: str, route: str, body: dict[str, Any] | None = None) -> Response:
        payload = self.build(route, body)
        try:
            resp = await self._send(method, route, payload)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(route, None, f"{type(exc).__name__}: {exc} (engine at {self.url})") from exc
        if resp.status_code >= 400:
            raise EngineError(route, resp.status_code, _error_message(resp))
        return resp

    async def _post_ok(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to a route answering ``{"success", "message"}``; raise unless it succeeded."""
        data = (await self._request("POST", route, body)).json()
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(route, 200, str(data.get("message")))
        return data

    # ---- status ----

    async def health(self) -> bool:
        try:
            resp = await self._send("GET", "/health", None, timeout_s=5.0)
        except (aiohttp.ClientError, TimeoutError):
            return False
        return resp.status_code == 200

    async def wait_healthy(self, timeout_s: float, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.health():
                return
            await asyncio.sleep(poll_s)
        raise EngineError("/health", None, f"engine at {self.url} not healthy within {timeout_s}s")

    async def model_info(self) -> dict[str, Any]:
        return (await self._request("GET", "/model_info")).json()

    async def server_info(self) -> dict[str, Any]:
        return (await self._request("GET", "/server_info")).json()

    async def version(self) -> tuple[int, ...] | None:
        """The engine's SGLang (protocol) version from /server_info, probed once."""
        if not self._version_probed:
            info = await self.server_info()
            self._version = parse_version(str(info.get("version", "")))
            self._version_probed = True
        return self._version

    async def needs_weight_update_session(self) -> bool:
        version = await self.version()
        return version is not None and version >= SESSION_VERSION

    # ---- generation ----

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        body = _generate_body(input_ids, dict(sampling_params), rid, return_logprob)
        data = (await self._request("POST", "/generate", body)).json()
        return parse_generate_response(data, prompt_tokens=len(input_ids))

    async def generate_n(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        n: int,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> list[GenerateResult]:
        """One ``/generate`` with ``sampling_params.n``: SGLang answers a list of ``n`` responses, its
        requests named ``{rid}_{i}``."""
        if n == 1:
            return [await self.generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob)]
        body = _generate_body(input_ids, {**sampling_params, "n": n}, rid, return_logprob)
        data = (await self._request("POST", "/generate", body)).json()
        if not isinstance(data, list) or len(data) != n:
            raise EngineError(
                "/generate", 200, f"expected a list of {n} responses to n={n}: {str(data)[:200]}"
            )
        return [parse_generate_response(item, prompt_tokens=len(input_ids)) for item in data]

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        if rid is None and not abort_all:
            raise ValueError("abort needs a rid or abort_all=True")
        await self._request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode={mode!r}: choose abort, retract or in_place")
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        try:
            await self._request("POST", "/flush_cache")
        except EngineError as exc:
            if exc.status == 400:
                return False
            raise
        return True

    # ---- weights ----

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        await self._post_ok(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._post_ok("/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> None:
        await self._post_ok("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        await self._post_ok("/end_weight_update", {})

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        await self._post_ok("/update_weights_from_distributed", body)

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        await self._post_ok(
            "/update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests}
        )

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        resp = await self._request(
            "POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size}
        )
        return resp.json()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def parse_generate_response(data: Any, prompt_tokens: int) -> GenerateResult:
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise EngineError("/generate", 200, f"unexpected response shape: {str(data)[:200]}")
    meta = data["meta_info"]
    out_ids = data.get("output_ids")
    entries = meta.get("output_token_logprobs") or []
    if out_ids is None:
        out_ids = [e[1] for e in entries]
    logprobs = [float(e[0]) if e[0] is not None else float("nan") for e in entries]
    return GenerateResult(
        rid=str(meta.get("id", "")),
        output_ids=list(out_ids),
        output_logprobs=logprobs,
        finish_reason=meta.get("finish_reason") or {},
        weight_version=meta.get("weight_version"),
        token_versions=token_versions(meta, len(out_ids)),
        prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
        text=str(data.get("text", "")),
        raw=data,
    )


def _error_message(resp: Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text.strip()[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:500]


def _generate_body(
    input_ids: list[int], sampling_params: dict[str, Any], rid: str | None, return_logprob: bool
) -> dict[str, Any]:
    """SGLang's ``/generate`` request (``GenerateReqInput``) for token ids, without streaming."""
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": sampling_params,
        "return_logprob": return_logprob,
        "stream": False,
    }
    if rid is not None:
        body["rid"] = rid
    return body

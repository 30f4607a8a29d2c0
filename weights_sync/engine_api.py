"""The engine's weight-update routes, as SGLang's HTTP server exposes them (one client per engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

# tidal's receive extensions an engine may declare in its /init_weights_update_group reply (SGLang: none)
EXTENSIONS = ("ordered_buckets", "bucket_segments")


class EngineError(RuntimeError):
    """An engine refused a weight-update call or did not answer in time."""


@dataclass(frozen=True)
class EngineEndpoint:
    url: str
    ranks: int = 1  # the engine's ranks in the weight-update group (its tensor-parallel size)


class EngineWeightsClient:
    def __init__(self, endpoint: EngineEndpoint, timeout_s: float):
        self.endpoint = endpoint
        self._http = httpx.Client(base_url=endpoint.url.rstrip("/"), timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = self._http.post(route, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.endpoint.url}{route}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise EngineError(f"{self.endpoint.url}{route}: HTTP {resp.status_code}: {resp.text[:300]}")
        data = resp.json() if resp.content else {}
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"{self.endpoint.url}{route}: {data.get('message')}")
        return data

    def health(self) -> None:
        try:
            resp = self._http.get("/health", timeout=min(5.0, self._http.timeout.read or 5.0))
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.endpoint.url}/health: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise EngineError(f"{self.endpoint.url}/health: HTTP {resp.status_code}")

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> frozenset[str]:
        """Join the engine to the group; returns the extensions its reply declares (``EXTENSIONS``):
        ``ordered_buckets``: it receives buckets in ``bucket_seq`` order, so the sender may announce the
        next bucket before this one is answered; ``bucket_segments``: a bucket may arrive as several
        broadcasts (``segments``). SGLang declares none and gets one announcement at a time."""
        reply = self._post(
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
        return frozenset(k for k in EXTENSIONS if reply.get(k) is True)

    def destroy_group(self, group_name: str) -> None:
        self._post("/destroy_weights_update_group", {"group_name": group_name})

    def begin(self) -> None:
        self._post("/begin_weight_update", {})

    def end(self) -> None:
        self._post("/end_weight_update", {})

    def pause(self, mode: str) -> None:
        self._post("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._post("/continue_generation", {})

    def update_bucket(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str,
        flush_cache: bool,
        checksum: int | None = None,
        seq: int | None = None,
        segments: list[int] | None = None,
    ) -> None:
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "load_format": "flattened_bucket",
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }
        if checksum is not None:  # tidal's debugging extension; SGLang ignores unknown fields
            body["checksum"] = checksum
        if seq is not None:  # tidal's extension, only to engines that declared ordered_buckets
            body["bucket_seq"] = seq
        if segments is not None:  # tidal's extension, only to engines that declared bucket_segments
            body["segments"] = segments
        self._post("/update_weights_from_distributed", body)

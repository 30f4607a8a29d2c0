"""The engine's weight-update routes, as SGLang's HTTP server exposes them (one client per engine).

Plain HTTP/1.1 keep-alive connections from the standard library (one per concurrent call): a sync makes a
few calls per bucket, and a general client (httpx) costs about three times the CPU per request (0.40 ms
against 0.12 ms, measured against ``tidal serve``) on the same cores the broadcasts need.
"""

from __future__ import annotations

import http.client
import json
import select
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from tidal.weights_sync import replay

# tidal's receive extensions an engine may declare in its /init_weights_update_group reply (SGLang: none)
EXTENSIONS = ("ordered_buckets", "bucket_segments", "pause_in_update", "replay_updates", "grouped_qkv")

# an idle connection is reused only this long: servers close idle keep-alive connections (uvicorn after
# 5 s), and a request sent as the server closes would fail
_REUSE_IDLE_S = 2.0


class EngineError(RuntimeError):
    """An engine refused a weight-update call or did not answer in time."""


@dataclass(frozen=True)
class EngineEndpoint:
    url: str
    ranks: int = 1  # the engine's ranks in the weight-update group (its tensor-parallel size)


class _Connections:
    """Keep-alive connections to one server, each used by one call at a time."""

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine url {url!r}: expected http://HOST:PORT or https://HOST:PORT")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()

    def request(self, method: str, route: str, body: Any, timeout_s: float) -> tuple[int, bytes]:
        """(status, body) of one request (``body``: JSON-able, or JSON already encoded as bytes); raises
        OSError or http.client.HTTPException."""
        conn = self._take(timeout_s)
        payload = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        try:
            conn.request(method, self._prefix + route, body=payload, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except BaseException:
            conn.close()
            raise
        if resp.will_close:
            conn.close()
        else:
            with self._lock:
                self._idle.append((conn, time.monotonic()))
        return resp.status, data

    def _take(self, timeout_s: float) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                conn, since = self._idle.pop() if self._idle else (None, 0.0)
            if conn is None:
                cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                conn = cls(self._host, self._port, timeout=timeout_s)
                break
            # the server may have closed it meanwhile (then its socket reads as ready: EOF)
            if time.monotonic() - since < _REUSE_IDLE_S and not select.select([conn.sock], [], [], 0)[0]:
                conn.sock.settimeout(timeout_s)
                conn.timeout = timeout_s
                break
            conn.close()
        return conn

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()


class Announcement:
    """A bucket's ``/update_weights_from_distributed`` fields that stay the same from sync to sync (names,
    dtypes, shapes, ``load_format`` and tidal's ``segments``), encoded as JSON once: a bucket of a few
    hundred tensors costs ~0.3 ms to encode, per engine and per sync otherwise."""

    def __init__(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        segments: list[int] | None = None,
    ):
        self.names, self.dtypes, self.shapes, self.segments = names, dtypes, shapes, segments
        self._encoded: bytes | None = None

    def body(self, **fields: Any) -> bytes:
        """The request's JSON: these fields and ``fields`` (those that change: version, seq, checksum)."""
        if self._encoded is None:
            fixed: dict[str, Any] = {
                "names": self.names,
                "dtypes": self.dtypes,
                "shapes": self.shapes,
                "load_format": "flattened_bucket",
            }
            if self.segments is not None:  # tidal's extension, only to engines that declared bucket_segments
                fixed["segments"] = self.segments
            self._encoded = json.dumps(fixed).encode()[:-1]  # without the closing brace
        return self._encoded + b", " + json.dumps(fields).encode()[1:]


class EngineWeightsClient:
    def __init__(self, endpoint: EngineEndpoint, timeout_s: float):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._http = _Connections(endpoint.url.rstrip("/"))

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, route: str, body: Any, timeout_s: float) -> tuple[int, bytes]:
        try:
            return self._http.request(method, route, body, timeout_s)
        except (OSError, http.client.HTTPException) as exc:
            raise EngineError(f"{self.endpoint.url}{route}: {type(exc).__name__}: {exc}") from exc

    def _post(self, route: str, body: dict[str, Any] | bytes) -> dict[str, Any]:
        status, content = self._request("POST", route, body, self.timeout_s)
        if status != 200:
            text = content[:300].decode(errors="replace")
            raise EngineError(f"{self.endpoint.url}{route}: HTTP {status}: {text}")
        try:
            data = json.loads(content) if content else {}
        except ValueError as exc:
            raise EngineError(
                f"{self.endpoint.url}{route}: the reply is not JSON: {content[:300]!r}"
            ) from exc
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"{self.endpoint.url}{route}: {data.get('message')}")
        return data

    def health(self) -> None:
        status, _ = self._request("GET", "/health", None, min(5.0, self.timeout_s))
        if status != 200:
            raise EngineError(f"{self.endpoint.url}/health: HTTP {status}")

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
        broadcasts (``segments``); ``pause_in_update``: ``begin`` may pause and ``end`` continue generation
        in the same call. SGLang declares none and gets one announcement at a time."""
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

    def begin(self, pause_mode: str | None = None) -> None:
        """``pause_mode``: pause generation first, in the same call (only to engines that declared
        ``pause_in_update``)."""
        self._post("/begin_weight_update", {} if pause_mode is None else {"pause_mode": pause_mode})

    def end(self, resume: bool = False) -> None:
        """``resume``: continue generation after, in the same call (only to engines that declared
        ``pause_in_update``)."""
        self._post("/end_weight_update", {"continue_generation": True} if resume else {})

    def replay(self, *, group_name: str, plan: str, weight_version: str, pause_mode: str | None) -> None:
        """Start a replayed update (``replay_updates``, replay.py); answers once the engine is ready to receive."""
        body = {"group_name": group_name, "plan": plan, "weight_version": weight_version}
        if pause_mode is not None:
            body["pause_mode"] = pause_mode
        self._post(replay.ROUTE, body)

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
        self.announce(
            Announcement(names, dtypes, shapes, segments),
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            checksum=checksum,
            seq=seq,
        )

    def announce(
        self,
        announcement: Announcement,
        *,
        group_name: str,
        weight_version: str,
        flush_cache: bool,
        checksum: int | None = None,
        seq: int | None = None,
    ) -> None:
        """POST ``/update_weights_from_distributed`` for a flattened bucket (SGLang's fields; ``checksum``,
        ``bucket_seq`` and ``segments`` are tidal's extensions, the last two only to engines that declared
        them)."""
        fields: dict[str, Any] = {
            "group_name": group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }
        if checksum is not None:  # tidal's debugging extension; SGLang ignores unknown fields
            fields["checksum"] = checksum
        if seq is not None:  # tidal's extension, only to engines that declared ordered_buckets
            fields["bucket_seq"] = seq
        self._post("/update_weights_from_distributed", announcement.body(**fields))

"""The weight routes' HTTP client (standard-library keep-alive connections) against a real HTTP server."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tidal.procs import free_port
from tidal.weights_sync import engine_api
from tidal.weights_sync.engine_api import EngineEndpoint, EngineError, EngineWeightsClient


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn serves

    def log_message(self, *args) -> None:
        pass

    def _reply(self, status: int, body: bytes, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.peers.add(self.client_address)
        self._reply(200, b'{"ok": true}')

    def do_POST(self) -> None:
        self.server.peers.add(self.client_address)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append((self.path, body))
        if self.path == "/refuse":
            self._reply(400, b'{"success": false, "message": "bad shapes"}')
        elif self.path == "/fail":
            self._reply(200, b'{"success": false, "message": "no group g"}')
        elif self.path == "/slow":
            time.sleep(1.0)
            self._reply(200, b'{"success": true}')
        else:
            self._reply(200, b'{"success": true, "ordered_buckets": true}', close=self.path == "/close")


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), _Handler)
    srv.daemon_threads = True
    srv.peers, srv.bodies = set(), []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(srv, timeout_s: float = 5.0) -> EngineWeightsClient:
    return EngineWeightsClient(EngineEndpoint(f"http://127.0.0.1:{srv.server_address[1]}"), timeout_s)


def test_calls_reuse_one_connection_and_send_sglangs_json(server):
    client = _client(server)
    try:
        client.begin()
        client.health()
        client.update_bucket(
            names=["w"],
            dtypes=["float32"],
            shapes=[[2, 3]],
            group_name="g",
            weight_version="4",
            flush_cache=True,
        )
        assert len(server.peers) == 1  # one keep-alive connection for the three calls
        assert server.bodies[-1] == (
            "/update_weights_from_distributed",
            {
                "names": ["w"],
                "dtypes": ["float32"],
                "shapes": [[2, 3]],
                "group_name": "g",
                "load_format": "flattened_bucket",
                "weight_version": "4",
                "flush_cache": True,
            },
        )
    finally:
        client.close()


def test_a_connection_the_server_closed_is_replaced_without_an_error(server):
    client = _client(server)
    try:
        assert client._post("/close", {}) == {"success": True, "ordered_buckets": True}
        client.begin()  # the closed connection is not reused
        assert len(server.peers) == 2
        client.end()
        assert len(server.peers) == 2
    finally:
        client.close()


def test_refusals_timeouts_and_unreachable_engines_raise_engine_error_naming_the_call(server):
    client = _client(server, timeout_s=0.2)
    try:
        with pytest.raises(EngineError, match=r"/refuse: HTTP 400: .*bad shapes"):
            client._post("/refuse", {})
        with pytest.raises(EngineError, match=r"/fail: no group g"):
            client._post("/fail", {})
        with pytest.raises(EngineError, match=r"/slow: .*timed out"):
            client._post("/slow", {})
        client.begin()  # the timed-out connection was dropped; the client goes on
    finally:
        client.close()
    gone = EngineWeightsClient(EngineEndpoint(f"http://127.0.0.1:{free_port()}"), 1.0)
    with pytest.raises(EngineError, match=r"127\.0\.0\.1:\d+/health: ConnectionRefusedError"):
        gone.health()
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        EngineWeightsClient(EngineEndpoint("127.0.0.1:30000"), 1.0)


def test_an_idle_connection_is_not_reused_after_the_servers_keep_alive_could_have_closed_it(
    server, monkeypatch
):
    monkeypatch.setattr(engine_api, "_REUSE_IDLE_S", 0.0)
    client = _client(server)
    try:
        client.begin()
        client.end()
        assert len(server.peers) == 2
    finally:
        client.close()


def test_an_engine_that_declared_pause_in_update_is_opened_and_closed_with_one_call_each(server):
    """SGLang's sequence (pause, begin ... end, continue) unless the engine declared ``pause_in_update`` in its
    /init_weights_update_group reply; then begin carries the pause and end the continue."""
    from tidal.weights_sync.config import WeightSyncConfig
    from tidal.weights_sync.sender import SyncReport, WeightSender

    url = f"http://127.0.0.1:{server.server_address[1]}"
    sender = WeightSender(WeightSyncConfig(timeout_s=5), [EngineEndpoint(url)])
    try:
        for declared, want in [
            (
                frozenset({"ordered_buckets"}),  # SGLang-like: every call of its own, in SGLang's order
                [
                    ("/pause_generation", {"mode": "in_place"}),
                    ("/begin_weight_update", {}),
                    ("/end_weight_update", {}),
                    ("/continue_generation", {}),
                ],
            ),
            (
                frozenset({"ordered_buckets", "pause_in_update"}),
                [
                    ("/begin_weight_update", {"pause_mode": "in_place"}),
                    ("/end_weight_update", {"continue_generation": True}),
                ],
            ),
        ]:
            server.bodies.clear()
            sender._declared = {url: declared}
            report = SyncReport(version=0)
            assert sender._settle_calls(sender._start_on_all("begin"), report) is None
            assert sender._settle_calls(sender._start_on_all("end"), report) is None
            assert server.bodies == want
    finally:
        sender.close()

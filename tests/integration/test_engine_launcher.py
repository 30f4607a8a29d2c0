"""The engine launcher's watch-and-restart loop and version probe, on a real process.

SGLang cannot run on this machine, so the process the launcher starts here is a small stand-in that
answers SGLang's ``/health`` and ``/server_info`` (the only routes the launcher itself uses) and reports
an older SGLang version; the full protocol is exercised against the embedded engine in
``test_engine_server.py``.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from tidal.procs import free_port
from tidal.rollout.sglang_launcher import EngineProcess

STAND_IN = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": b"", "/server_info": json.dumps({"version": "0.5.9"}).encode()}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.mark.slow
def test_launcher_waits_for_health_probes_version_and_restarts_a_dead_engine(tmp_path):
    port = free_port()
    proc = EngineProcess(
        [sys.executable, "-c", STAND_IN, str(port)],
        f"http://127.0.0.1:{port}",
        log_path=tmp_path / "engine.log",
        start_timeout_s=30,
    )

    async def go():
        try:
            client = await proc.start()
            first_pid = proc.proc.pid
            assert await client.version() == (0, 5, 9)
            assert not await client.needs_weight_update_session()
            assert not await proc.ensure_alive()
            proc.kill()
            assert not proc.alive()
            assert await proc.ensure_alive()
            assert proc.alive() and proc.proc.pid != first_pid and proc.restarts == 1
            assert await client.health()
        finally:
            await proc.close()

    asyncio.run(go())


@pytest.mark.slow
def test_launcher_reports_an_engine_that_exits_during_startup(tmp_path):
    proc = EngineProcess(
        [sys.executable, "-c", "import sys; print('bad flag --nope'); sys.exit(3)"],
        f"http://127.0.0.1:{free_port()}",
        log_path=tmp_path / "engine.log",
        start_timeout_s=30,
    )
    with pytest.raises(RuntimeError, match=r"exited with 3 before becoming healthy[\s\S]*bad flag --nope"):
        asyncio.run(proc.start())

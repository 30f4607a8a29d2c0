"""A broker that cannot take its address or its metrics port stops at once with a config error naming the
setting (exit code 2), instead of a traceback; the broker already there keeps serving."""

import socket
import subprocess
import sys

import pytest

from tidal.broker.client import BrokerClient
from tidal.broker.testing import start_broker, write_rows
from tidal.procs import free_port, stop

pytestmark = pytest.mark.slow


def _broker(run_dir, *overrides):
    """``tidal broker`` in the foreground: (exit code, its output)."""
    data = write_rows(run_dir / "data.jsonl", 10)
    cmd = [
        sys.executable,
        "-m",
        "tidal.cli",
        "broker",
        f"run_dir={run_dir}",
        f"broker.data.path={data}",
        *overrides,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


def test_a_second_broker_on_a_taken_address_names_broker_bind(tmp_path):
    proc, address = start_broker(tmp_path / "first", 10)
    try:
        code, out = _broker(tmp_path / "second", f"broker.bind={address}")
        assert code == 2, out
        assert (
            f"broker.bind='{address}': cannot bind (Address already in use)" in out and "Traceback" not in out
        )
        with BrokerClient(address, timeout_s=10) as client:  # the first one still serves
            assert "nodes" in client.stats()
    finally:
        stop(proc)


def test_a_taken_metrics_port_names_broker_metrics_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = _broker(
            tmp_path,
            f"broker.bind=tcp://127.0.0.1:{free_port()}",
            f"broker.metrics_port={port}",
            "broker.metrics_host=127.0.0.1",
        )
    assert code == 2, out
    assert (
        f"broker.metrics_port={port} (broker.metrics_host='127.0.0.1'): cannot serve Prometheus there" in out
    )
    assert "Traceback" not in out

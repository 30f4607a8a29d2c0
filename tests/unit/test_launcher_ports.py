"""``tidal run`` refuses a broker address or metrics port that something already listens on, before it
starts anything: its nodes and trainer would otherwise join the broker that is there (another job's)."""

import socket
import time

import pytest
import zmq

from tidal.cli import load_run_config
from tidal.errors import ConfigError
from tidal.launcher import check_broker_ports
from tidal.procs import free_port, port_in_use


@pytest.fixture
def listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_listened_port_is_in_use_and_a_free_one_is_not(listener):
    assert "in use" in port_in_use("127.0.0.1", listener)
    assert port_in_use("127.0.0.1", free_port()) is None
    assert port_in_use("192.0.2.1", free_port()) is None  # not this host's address: the binder says so


def test_a_zeromq_port_whose_connections_closed_is_free_again():
    """After a broker's ROUTER served a connection and closed (its side may wait in TIME_WAIT), the port
    counts as free, as ZeroMQ's own bind finds it."""
    port = free_port()
    ctx = zmq.Context()
    try:
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        router.bind(f"tcp://127.0.0.1:{port}")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        assert router.recv_multipart()[1] == b"hello"
        assert port_in_use("127.0.0.1", port) is not None  # listened on
        router.close(0)
        dealer.close(0)
        deadline = time.monotonic() + 5  # ZeroMQ's I/O thread closes the listening socket after close()
        while port_in_use("127.0.0.1", port) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert port_in_use("127.0.0.1", port) is None
        again = ctx.socket(zmq.ROUTER)
        again.bind(f"tcp://127.0.0.1:{port}")
        again.close(0)
    finally:
        ctx.term()


def test_tidal_run_names_the_setting_whose_port_is_taken(listener):
    config = load_run_config(None, [f"broker.bind=tcp://127.0.0.1:{listener}"])
    with pytest.raises(
        ConfigError, match=rf"broker.bind='tcp://127.0.0.1:{listener}': Address already in use"
    ):
        check_broker_ports(config)
    config = load_run_config(
        None, [f"broker.bind=tcp://127.0.0.1:{free_port()}", f"broker.metrics_port={listener}"]
    )
    with pytest.raises(ConfigError, match=rf"broker.metrics_port={listener}: Address already in use"):
        check_broker_ports(config)
    check_broker_ports(load_run_config(None, [f"broker.bind=tcp://127.0.0.1:{free_port()}"]))

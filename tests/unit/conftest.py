"""Fixtures shared by the unit tests."""

import pytest
import zmq

from tidal.procs import free_port


@pytest.fixture
def unconnected():
    """A bound ROUTER (the broker's side), a DEALER (a client's) not yet connected to it, which cannot take
    a message, and the address; closed after the test."""
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    yield router, dealer, address
    dealer.close(0)
    router.close(0)
    ctx.term()


@pytest.fixture
def router_dealer(unconnected):
    """The ROUTER and the DEALER above, connected."""
    router, dealer, address = unconnected
    dealer.connect(address)
    return router, dealer

"""LoopSocket: a plain ZeroMQ socket awaited on the asyncio loop (the rollout node's client socket)."""

import asyncio
import threading

import pytest
import uvloop
import zmq

from tidal.broker.loop_socket import LoopSocket
from tidal.procs import free_port


class CountingSocket(LoopSocket):
    def __init__(self, sock):
        super().__init__(sock)
        self.readable_calls = 0

    def _on_readable(self):
        self.readable_calls += 1
        super()._on_readable()


@pytest.fixture
def pair():
    """A ROUTER (the broker's side) and a connected DEALER on loopback; closed after the test."""
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    yield router, dealer
    dealer.close(0)
    router.close(0)
    ctx.term()


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_concurrent_sends_and_one_reader_see_every_reply_in_order(run, pair):
    router, dealer = pair
    sock = LoopSocket(dealer)

    def echo():  # the peer answers on its own thread, as the broker's process would
        for _ in range(600):
            router.send_multipart(router.recv_multipart())

    async def main():
        server = threading.Thread(target=echo, daemon=True)
        server.start()

        async def sender(k):
            for i in range(200):
                await sock.send_multipart([f"{k}:{i}".encode()])
                if i % 50 == 0:
                    await asyncio.sleep(0)

        got = []

        async def reader():
            while len(got) < 600:
                got.append((await sock.recv_multipart(copy=True))[0])

        await asyncio.wait_for(asyncio.gather(reader(), *(sender(k) for k in range(3))), 30)
        server.join(10)
        return got

    got = run(main())
    for k in range(3):
        mine = [g for g in got if g.startswith(f"{k}:".encode())]
        assert mine == [f"{k}:{i}".encode() for i in range(200)]


def test_a_send_with_no_peer_waits_until_one_connects():
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    sock = LoopSocket(dealer)  # not connected yet: a DEALER with no peer cannot take a message

    async def main():
        send = asyncio.ensure_future(sock.send_multipart([b"hello"]))
        await asyncio.sleep(0.2)
        assert not send.done()
        dealer.connect(address)
        await asyncio.wait_for(send, 10)
        assert router.poll(10_000)
        assert router.recv_multipart()[1] == b"hello"

    asyncio.run(main())
    sock.close()
    router.close(0)
    ctx.term()


def test_a_message_nobody_waits_for_does_not_spin_the_loop_and_is_received_later(pair):
    router, dealer = pair
    sock = CountingSocket(dealer)

    async def main():
        await sock.send_multipart([b"ping"])
        assert router.poll(10_000)
        peer, _ = router.recv_multipart()
        with pytest.raises(zmq.Again):  # an empty read: the next message is signalled on the descriptor
            dealer.recv(zmq.NOBLOCK)
        router.send_multipart([peer, b"pong"])
        # No receive is waiting: the descriptor turns readable, and must not call back over and over.
        await asyncio.sleep(0.3)
        assert sock.readable_calls < 20
        return await asyncio.wait_for(sock.recv_multipart(copy=True), 10)

    assert asyncio.run(main()) == [b"pong"]


def test_close_after_the_loop_ended_and_reuse_on_a_new_loop(pair):
    router, dealer = pair
    sock = LoopSocket(dealer)

    async def round_trip(payload):
        await sock.send_multipart([payload])
        assert router.poll(10_000)
        router.send_multipart(router.recv_multipart())
        return await asyncio.wait_for(sock.recv_multipart(copy=True), 10)

    assert asyncio.run(round_trip(b"a")) == [b"a"]
    assert uvloop.run(round_trip(b"b")) == [b"b"]  # the first loop is closed: it follows the new one
    sock.close()
    assert sock.sock.closed

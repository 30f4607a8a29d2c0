"""LoopSocket: a plain ZeroMQ socket awaited on the asyncio loop (the rollout node's client socket)."""

import asyncio
import os
import threading

import pytest
import uvloop
import zmq

from tidal.broker.loop_socket import LoopSocket


class CountingSocket(LoopSocket):
    def __init__(self, sock):
        super().__init__(sock)
        self.readable_calls = 0

    def _on_readable(self):
        self.readable_calls += 1
        super()._on_readable()


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_concurrent_sends_and_one_reader_see_every_reply_in_order(run, router_dealer):
    router, dealer = router_dealer
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


def test_a_send_with_no_peer_waits_until_one_connects(unconnected):
    router, dealer, address = unconnected
    sock = LoopSocket(dealer)

    async def main():
        send = asyncio.ensure_future(sock.send_multipart([b"hello"]))
        await asyncio.sleep(0.2)
        assert not send.done()
        dealer.connect(address)
        await asyncio.wait_for(send, 10)
        assert router.poll(10_000)
        assert router.recv_multipart()[1] == b"hello"

    asyncio.run(main())
    sock.detach()


def test_try_send_queues_what_zeromq_takes_at_once_and_sends_nothing_where_it_would_wait(unconnected):
    router, dealer, address = unconnected
    sock = LoopSocket(dealer)

    async def main():
        assert not sock.try_send_multipart([b"no peer yet"])  # a DEALER with no peer would wait
        dealer.connect(address)
        await sock.send_multipart([b"first"])  # waits for the connection
        assert sock.try_send_multipart([b"second"])
        got = [router.recv_multipart()[1] for _ in range(2) if router.poll(10_000)]
        assert got == [b"first", b"second"]

    asyncio.run(main())
    sock.detach()


def test_a_message_nobody_waits_for_does_not_spin_the_loop_and_is_received_later(router_dealer):
    router, dealer = router_dealer
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


def test_close_after_the_loop_ended_and_reuse_on_a_new_loop(router_dealer):
    router, dealer = router_dealer
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


class _ConnectsWhenLookedAt:
    """A DEALER stand-in whose connection completes inside a read of ``EVENTS`` (as ZeroMQ processes the
    connection's command there), with a descriptor that never turns readable again: the one edge is
    taken by whoever reads the events."""

    closed = False

    def __init__(self):
        self._fd_read, self._fd_write = os.pipe()
        self.connected = False
        self.looks = 0
        self.sent = []

    def getsockopt(self, option):
        if option == zmq.FD:
            return self._fd_read
        self.looks += 1
        if self.looks == 2:  # the receive's look, after the send's first one found no connection
            self.connected = True
        return zmq.POLLOUT if self.connected else 0

    def send_multipart(self, frames, flags=0, copy=True):
        if not self.connected:
            raise zmq.Again()
        self.sent.append(frames)

    def recv_multipart(self, flags=0, copy=True):
        raise zmq.Again()

    def close(self, linger=0):
        os.close(self._fd_read)
        os.close(self._fd_write)


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_send_waiting_for_its_connection_is_woken_when_a_receive_sees_it(run):
    # A node's first request: its send waits for the connection while its reply reader starts receiving.
    # The reader's look at the events is what completes the connection; the send slept on (for its whole
    # timeout: a rollout node's `register` went unanswered so, twice in ~45 benchmark runs).
    fake = _ConnectsWhenLookedAt()
    sock = LoopSocket(fake)

    async def main():
        send = asyncio.ensure_future(sock.send_multipart([b"register"]))
        await asyncio.sleep(0)  # the send tries, finds no connection and waits
        receive = asyncio.ensure_future(sock.recv_multipart())
        await asyncio.wait_for(send, 5)
        receive.cancel()

    run(main())
    assert fake.sent == [[b"register"]]
    sock.close()

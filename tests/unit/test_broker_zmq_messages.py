"""send_parts / recv_frames / readable: pyzmq's multipart calls through its backend, same meaning."""

import numpy as np
import pytest
import zmq

from tidal.broker.zmq_messages import readable, recv_frames, send_parts


@pytest.mark.parametrize("copy", [True, False])
def test_parts_of_every_kind_arrive_whole_and_in_order(router_dealer, copy):
    router, dealer = router_dealer
    big = np.arange(100_000, dtype=np.int32)  # over pyzmq's copy threshold: by reference when copy=False
    parts = [b"envelope", memoryview(b"a view"), zmq.Frame(b"a frame"), big.data, b""]
    send_parts(dealer, parts, copy=copy)
    assert readable(router, 5000)
    frames = recv_frames(router)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    peer, *got = [f.bytes for f in frames]
    assert got == [b"envelope", b"a view", b"a frame", big.tobytes(), b""]
    send_parts(router, [peer, b"reply", b"second"], copy=copy)  # a ROUTER routes by the first part
    assert [f.bytes for f in recv_frames(dealer)] == [b"reply", b"second"]
    # what the sugar receives from them is the same message
    send_parts(dealer, [b"one", b"two"])
    assert router.recv_multipart()[1:] == [b"one", b"two"]


def test_messages_are_taken_one_at_a_time(router_dealer):
    router, dealer = router_dealer
    for i in range(3):
        send_parts(dealer, [b"m%d" % i, b"tail"])
    seen = []
    for _ in range(3):
        assert readable(router, 5000)
        seen.append([f.bytes for f in recv_frames(router, zmq.NOBLOCK)][1:])
    assert seen == [[b"m0", b"tail"], [b"m1", b"tail"], [b"m2", b"tail"]]
    with pytest.raises(zmq.Again):
        recv_frames(router, zmq.NOBLOCK)
    assert not readable(router, 0)


def test_a_send_that_would_block_raises_again_and_sends_nothing(unconnected):
    router, dealer, address = unconnected  # a DEALER with no peer has nowhere to queue a message
    with pytest.raises(zmq.Again):
        send_parts(dealer, [b"first", b"second"], zmq.NOBLOCK)
    dealer.sndtimeo = 50
    with pytest.raises(zmq.Again):  # a send timeout as well
        send_parts(dealer, [b"only"])
    # once it connects, the next message is the first the peer sees: nothing half-sent went before it
    dealer.connect(address)
    dealer.sndtimeo = 5000
    send_parts(dealer, [b"after", b"connect"])
    assert readable(router, 5000)
    assert [f.bytes for f in recv_frames(router)][1:] == [b"after", b"connect"]
    assert not readable(router, 100)


def test_a_part_that_is_no_buffer_is_refused_before_anything_is_sent(router_dealer):
    router, dealer = router_dealer
    with pytest.raises(TypeError, match="message part 1 \\(str\\) is no buffer"):
        send_parts(dealer, [b"first", "a str", b"third"])
    send_parts(dealer, [b"next", b"message"])
    assert readable(router, 5000)
    assert [f.bytes for f in recv_frames(router)][1:] == [b"next", b"message"]


def test_what_is_no_zmq_socket_is_refused_not_crashed_on():
    # the backend's C functions would take it for a socket's memory
    class NotASocket:
        def send_multipart(self, *args, **kwargs):
            raise AssertionError("not called")

    with pytest.raises(TypeError, match="zmq.Socket is needed"):
        send_parts(NotASocket(), [b"x"])
    with pytest.raises(TypeError, match="zmq.Socket is needed"):
        recv_frames(NotASocket())

"""Multipart sends and receives through pyzmq's Cython backend, without its per-call Python layer.

``Socket.send_multipart`` and ``recv_multipart`` check and dispatch every part in Python (pyzmq's "sugar"
over the backend): about 4 us a message sent and 2 a message received on this VM, and 9 us a receive that
finds nothing (the last one of every wake-up of the broker's loop) against 5. The broker and its clients
pay that for every request, reply, lease push and ack. These call the backend's ``send`` and ``recv``
directly, with the same meaning: a multipart message goes whole or not at all (ZeroMQ takes the rest of a
message whose first part it took), parts sent with ``copy=False`` go by reference (pyzmq still copies
those under its copy threshold), ``bytes`` parts are copied (what pyzmq does with them below 64 KiB, and
its cheapest path), and received parts are ``zmq.Frame`` objects.
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.backend import Socket as _Backend

_send = _Backend.send
_recv = _Backend.recv
_SNDMORE = zmq.SNDMORE
_BUFFERS = (bytes, zmq.Frame, memoryview)


def _check(sock: Any) -> None:
    # The backend's methods are C functions that take any object for ``self`` and crash on one that is
    # no ZeroMQ socket.
    if not isinstance(sock, _Backend):
        raise TypeError(f"a zmq.Socket is needed, not {type(sock).__name__}")


def send_parts(sock: zmq.Socket, parts: list[Any], flags: int = 0, copy: bool = True) -> None:
    """``sock.send_multipart(parts, flags, copy=copy)``; raises ``zmq.Again`` as it does, and ``TypeError``
    for a part that is no buffer before anything is sent (a message sent in part would be glued to the
    next one)."""
    _check(sock)
    for i, part in enumerate(parts):
        if not isinstance(part, _BUFFERS):
            try:
                memoryview(part)
            except TypeError:
                raise TypeError(f"message part {i} ({type(part).__name__}) is no buffer") from None
    last = len(parts) - 1
    for i in range(last):
        part = parts[i]
        _send(sock, part, flags | _SNDMORE, copy or type(part) is bytes, False)
    part = parts[last]
    _send(sock, part, flags, copy or type(part) is bytes, False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``sock.recv_multipart(flags, copy=False)``; raises ``zmq.Again`` as it does."""
    _check(sock)
    frame = _recv(sock, flags, False, False)
    frames = [frame]
    while frame.more:
        frame = _recv(sock, flags, False, False)
        frames.append(frame)
    return frames


def readable(sock: zmq.Socket, timeout_ms: int | None) -> bool:
    """``sock.poll(timeout_ms)`` for a message to read (``None``: wait for ever), without the ``Poller``
    object pyzmq makes for each call."""
    return bool(zmq.zmq_poll([(sock, zmq.POLLIN)], -1 if timeout_ms is None else timeout_ms))

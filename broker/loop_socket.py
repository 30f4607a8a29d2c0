"""A plain ZeroMQ socket driven by the running asyncio loop: non-blocking sends and receives, and a wait on
the socket's descriptor only when one would block.

pyzmq's ``zmq.asyncio`` sockets make a future and a poller registration per call; at 1K-token samples a
rollout node's messages (a lease pushed, a submit, its acknowledgement) cost about twice the CPU through
them (docs/decisions.md). The broker's own loop already reads its socket this way (server.py).

ZeroMQ's descriptor signals edges only, and any operation on the socket may consume the edge of an event
that arrived meanwhile: a waiter re-reads ``EVENTS`` before it sleeps, a read of ``EVENTS`` wakes the other
waiters whose event it shows (a receive's read may be what makes a waiting send's connection usable), and
a send wakes the waiters so they look again.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import zmq

from tidal.broker.zmq_messages import recv_frames, send_parts


class LoopSocket:
    """``await recv_multipart()`` / ``await send_multipart(frames)`` on a plain socket, on one loop at a
    time (it follows the loop it is first used on after :meth:`detach`)."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        # pyzmq's multipart calls without their Python layer (zmq_messages); a stand-in for a socket (in
        # tests) is called through its own methods
        self._fast = isinstance(sock, zmq.Socket)
        self._fd = sock.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[tuple[int, asyncio.Future]] = []  # (the events it waits for, its future)

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self.detach()
            loop.add_reader(self._fd, self._on_readable)
            self._loop = loop
        return loop

    def detach(self) -> None:
        """Stop watching the descriptor (before the socket closes, or its loop does)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError, ValueError, OSError):  # a closed loop has no readers
                self._loop.remove_reader(self._fd)
            self._loop = None
        self._wake()

    def _on_readable(self) -> None:
        if self._waiters:
            self._wake()
        elif not self.sock.closed:
            # Nobody waits: read the events, which re-arms the descriptor (left readable, the loop would
            # call back at once, again and again). A later waiter reads them itself before it sleeps.
            self.sock.getsockopt(zmq.EVENTS)

    def _wake(self, events: int = -1) -> None:
        """Wake the waiters for any of ``events`` (all of them by default)."""
        waiters, self._waiters = self._waiters, []
        for event, w in waiters:
            if event & events:
                if not w.done():
                    w.set_result(None)
            else:
                self._waiters.append((event, w))

    async def _until(self, event: int, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            events = self.sock.getsockopt(zmq.EVENTS)
            if self._waiters and events:
                # This read may have consumed the descriptor's edge for another waiter's event (a send
                # waiting for its connection while a receive looks): that waiter would sleep on.
                self._wake(events)
            if events & event:
                return
            waiter = loop.create_future()
            self._waiters.append((event, waiter))
            await waiter

    async def recv_multipart(self, copy: bool = False) -> list[Any]:
        loop = self._attach()
        while True:
            try:
                if self._fast and not copy:
                    return recv_frames(self.sock, zmq.NOBLOCK)
                return self.sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                await self._until(zmq.POLLIN, loop)

    def try_send_multipart(self, frames: list[Any], copy: bool = True) -> bool:
        """Queue a message if ZeroMQ takes it without waiting; False (nothing sent) where it would block.
        The usual case, and what a caller needs no timeout for."""
        self._attach()
        try:
            if self._fast:
                send_parts(self.sock, frames, zmq.NOBLOCK, copy)
            else:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return False
        if self._waiters:  # the send may have taken the edge of a message a waiting receive needs
            self._wake()
        return True

    async def send_multipart(self, frames: list[Any], copy: bool = True) -> None:
        """Queue a message; waits only while ZeroMQ would block (no peer connected yet, or the high-water
        mark reached). A multipart message goes whole or not at all."""
        loop = self._attach()
        while not self.try_send_multipart(frames, copy):
            await self._until(zmq.POLLOUT, loop)

    def close(self, linger: int = 0) -> None:
        self.detach()
        self.sock.close(linger)

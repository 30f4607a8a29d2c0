"""Client library: :class:`AsyncBrokerClient` for rollout node agents, :class:`BrokerClient` (blocking) for the
trainer. Both speak the protocol of docs/protocol.md over one ZeroMQ DEALER socket.

A call that gets no reply within ``timeout_s`` raises :class:`BrokerTimeout` (the broker is down or
unreachable, or CURVE refused this client's key: ZeroMQ then never completes the connection). Membership
is not journaled: after a broker restart a registered client registers again by itself (its node id
changes) and its old leases are refused with :class:`LeaseRejected`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Any

import zmq

from tidal.broker import protocol as proto
from tidal.broker.blocking_client import BrokerClient
from tidal.broker.client_common import (
    BrokerError,
    BrokerTimeout,
    LeaseRejected,
    batch_from_reply,
    dealer_socket,
    lease_from_reply,
    log_broker_wait,
    poll_slice_s,
    raise_for_reply,
    release_body,
    timeout_message,
)
from tidal.broker.client_support import (
    MAX_UNACKED_BYTES,
    _BufferPool,
    _LocalFrames,
    _Unacked,
    send_copies,
)
from tidal.broker.codec import encode_group
from tidal.broker.curve import CurveClientKeys
from tidal.broker.local_journal import host_id
from tidal.broker.loop_socket import LoopSocket
from tidal.broker.submit_memory import SubmitMemoryUnavailable, SubmitRing
from tidal.broker.types import Batch, Group, Lease

__all__ = ["AsyncBrokerClient", "BrokerClient", "BrokerError", "BrokerTimeout", "LeaseRejected"]

log = logging.getLogger(__name__)


class AsyncBrokerClient:
    """asyncio client; one reader task matches replies to requests, so calls may run concurrently.

    Submits stream: :meth:`submit_streamed` returns once the groups are sent, and at most
    ``max_unacked_bytes`` of group frames wait for the broker's (cumulative) acknowledgement at a time."""

    def __init__(
        self,
        address: str,
        *,
        curve: CurveClientKeys | None = None,
        timeout_s: float = 30.0,
        max_unacked_bytes: int = MAX_UNACKED_BYTES,
        read_journal: bool = True,
        read_memory: bool = True,
        submit_memory: bool = True,
    ):
        self.address = address
        self.timeout_s = timeout_s
        self.node_id: str | None = None
        self.registered: dict[str, Any] = {}  # the register reply: the broker's settings (docs/protocol.md)
        # On the broker's host, group frames are encoded into memory the broker offers (submit_memory).
        self._host = host_id() if submit_memory else None
        self._ring: SubmitRing | None = None
        self._span_order = asyncio.Lock()  # span submits reach the broker in the order they were allocated
        self.wire_submits = 0  # submits whose frames went over the wire (no ring, or it was full)
        self.span_submits = 0
        self._ctx = zmq.Context()
        self._sock = LoopSocket(dealer_socket(self._ctx, address, curve))
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._registration: dict[str, Any] | None = None
        self._register_lock = asyncio.Lock()
        self._buffers = _BufferPool()
        self._generation = 0  # registrations so far: a call knows whether one happened since it was sent
        self._submits = _Unacked()
        self._local = _LocalFrames(read_journal, read_memory)
        self.max_unacked_bytes = max_unacked_bytes
        self._unacked_bytes = 0
        self._window = asyncio.Condition()
        self._stream: dict[str, Any] | None = None  # the standing lease request, sent again on re-register
        self._pushed: asyncio.Queue[Lease | None] = asyncio.Queue()
        self.leases_finished = False  # the broker pushed the end of the data

    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                rid, type_, body = proto.decode_reply(frames[0].buffer)
            except Exception:
                continue
            if type_ == "lease":  # pushed under the standing request (stream_leases)
                if body.get("node_id") == self.node_id:
                    self._pushed.put_nowait(lease_from_reply(body))
                continue
            if type_ == "ack":
                for rid, result in self._submits.acked(body):
                    fut = self._pending.pop(rid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(("ok", result, []))
                continue
            self._submits.forget(rid)
            fut = self._pending.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result((type_, body, frames[1:]))

    async def _call(
        self, type_: str, body: dict[str, Any], frames=(), timeout: float | None = None
    ) -> tuple[dict[str, Any], list[Any]]:
        generation = self._generation
        try:
            return await self._call_once(type_, body, frames, timeout)
        except BrokerError as exc:
            if not self._should_reregister(exc, type_):
                raise
        await self._reregister(generation)
        return await self._call_once(type_, body, frames, timeout)

    def _should_reregister(self, exc: BrokerError, type_: str) -> bool:
        return exc.code == proto.NOT_REGISTERED and self._registration is not None and type_ != "register"

    async def _reregister(self, generation: int) -> None:
        # The broker restarted (membership is not journaled): register again. Single-flight: a second
        # registration would make the broker drop the first one and take back the leases just granted
        # under it, so concurrent calls wait for one registration and the later ones reuse it.
        async with self._register_lock:
            if self._generation == generation:
                await self._register_once()

    async def _register_once(self) -> None:
        body = (await self._call_once("register", self._registration))[0]
        self.registered = {k: v for k, v in body.items() if k != "submit_memory"}  # the broker's settings
        self.node_id = body["node_id"]
        self._map_ring(body.get("submit_memory"))
        self._generation += 1
        if self._stream is not None:  # the new registration has no standing request yet
            await self._call_once("stream_leases", self._stream)

    async def _call_once(
        self, type_: str, body: dict[str, Any], frames=(), timeout: float | None = None
    ) -> tuple[dict[str, Any], list[Any]]:
        timeout = self.timeout_s if timeout is None else timeout
        rid, fut = await self._send(type_, body, frames, timeout)
        return await self._reply(type_, rid, fut, timeout)

    async def _send(
        self, type_: str, body: dict[str, Any], frames, timeout: float, group_ids: list[str] | None = None
    ) -> tuple[int, asyncio.Future]:
        """Send a request; returns its id and the future its reply (or ack) will complete."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_loop())
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        if group_ids is not None:
            self._submits.add(rid, self.node_id, group_ids)
        message = [proto.encode_envelope(type_, rid, body), *frames]
        copy = send_copies(frames)
        if self._sock.try_send_multipart(message, copy):
            return rid, fut
        try:
            # With no connected peer (broker down, CURVE refused) a DEALER send waits: bound it too.
            async with asyncio.timeout(timeout):
                await self._sock.send_multipart(message, copy=copy)
        except TimeoutError:
            self._forget(rid)
            raise BrokerTimeout(timeout_message(type_, self.address, timeout)) from None
        return rid, fut

    def _forget(self, rid: int) -> None:
        """Stop waiting for request ``rid``'s reply (or acknowledgement)."""
        self._pending.pop(rid, None)
        self._submits.forget(rid)

    async def _reply(
        self, type_: str, rid: int, fut: asyncio.Future, timeout: float
    ) -> tuple[dict[str, Any], list[Any]]:
        try:
            async with asyncio.timeout(timeout):
                rtype, rbody, rframes = await fut
        except TimeoutError:
            raise BrokerTimeout(timeout_message(type_, self.address, timeout)) from None
        finally:
            self._forget(rid)
        raise_for_reply(rtype, rbody, type_)
        return rbody, rframes

    def _map_ring(self, offer: dict[str, Any] | None) -> None:
        self._drop_ring()  # a new registration has a new ring (or none)
        if offer is None:
            return
        try:
            self._ring = SubmitRing(offer)
        except SubmitMemoryUnavailable as exc:
            log.info("submitting over the wire: %s", exc)
            return
        log.info("submitting through %d MiB of memory shared with the broker", self._ring.capacity >> 20)

    def _drop_ring(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    async def register(self, role: str, name: str, meta: dict | None = None, wait_s: float = 0.0) -> str:
        """Join the broker. With ``wait_s``, a broker that does not answer yet (not started, restarting) is
        asked again every ``timeout_s``, logged each time, until ``wait_s`` has passed."""
        self._registration = {"role": role, "name": name, "meta": meta or {}}
        if self._host is not None:
            self._registration["host"] = self._host
        self._stream = None
        deadline = time.monotonic() + wait_s
        async with self._register_lock:
            while True:
                try:
                    await self._register_once()
                    return self.node_id
                except BrokerTimeout:
                    if time.monotonic() >= deadline:
                        raise
                    log_broker_wait(self.address, wait_s, deadline)

    async def heartbeat(self) -> dict:
        return (await self._call("heartbeat", {}))[0]

    async def lease(self, max_groups: int) -> Lease | None:
        return lease_from_reply((await self._call("lease", {"max_groups": max_groups}))[0])

    async def stream_leases(self, credit: int, max_groups: int | None = None) -> None:
        """Stand a lease request: the broker pushes leases (at most ``max_groups`` groups each, default
        ``credit``) whenever fewer than ``credit`` of this node's groups are in flight; a submit, release or
        expiry returns credit. Take them with :meth:`next_lease`. ``credit=0`` stops the pushes."""
        body = {"credit": credit, "max_groups": max_groups}
        await self._call("stream_leases", body)
        self._stream = body if credit > 0 else None

    async def next_lease(self, timeout: float | None = None) -> Lease | None:
        """The next pushed lease; None on timeout or when the data is exhausted (``leases_finished``)."""
        if not self._pushed.empty():  # one is waiting: no timeout scope to set up and tear down
            lease = self._pushed.get_nowait()
        else:
            try:
                async with asyncio.timeout(timeout):
                    lease = await self._pushed.get()
            except TimeoutError:
                return None
        if lease is None:
            self.leases_finished = True
        return lease

    def pushed_leases(self) -> list[Lease]:
        """Leases pushed and not yet taken (to release them when stopping)."""
        out = []
        while not self._pushed.empty():
            lease = self._pushed.get_nowait()
            if lease is not None:
                out.append(lease)
            else:
                self.leases_finished = True
        return out

    async def submit(self, lease_id: str, groups: list[Group]) -> dict:
        """Submit whole groups; returns ``{"accepted": [ids], "filtered": [ids]}`` once they are journaled."""
        generation = self._generation
        try:
            return await (await self.submit_streamed(lease_id, groups))
        except BrokerError as exc:
            if not self._should_reregister(exc, "submit"):
                raise
        await self._reregister(generation)
        return await (await self.submit_streamed(lease_id, groups))

    async def submit_streamed(self, lease_id: str, groups: list[Group]) -> asyncio.Future:
        """Send whole groups without waiting for their acknowledgement: returns once they are on their way
        (waiting first while ``max_unacked_bytes`` are unacknowledged) with a future of what
        :meth:`submit` returns. The broker acknowledges cumulatively, once the groups are journaled."""
        if self._ring is not None:
            async with self._span_order:
                spans = self._ring.encode(groups)
                if spans is not None:
                    body = {"lease_id": lease_id, "groups": len(groups), "spans": spans}
                    rid, fut = await self._send(
                        "submit", body, (), self.timeout_s, [g.group_id for g in groups]
                    )
                    self.span_submits += 1
                    return self._span_submitted(rid, fut)
        self.wire_submits += 1
        frames = [encode_group(g, self._buffers.take) for g in groups]
        nbytes = sum(len(f) for f in frames)
        await self._acquire_window(nbytes)
        body = {"lease_id": lease_id, "groups": len(frames)}
        try:
            rid, fut = await self._send("submit", body, frames, self.timeout_s, [g.group_id for g in groups])
        except BaseException:
            await self._release_window(nbytes)  # a timed-out send may still go: its frames are not reused
            raise
        return asyncio.ensure_future(self._submitted(rid, fut, frames, nbytes))

    def _span_submitted(self, rid: int, fut: asyncio.Future) -> asyncio.Future:
        """What :meth:`_submitted` does for a submit through the ring (no frames to reuse, no window to
        release), with callbacks instead of a task and a timeout scope: per submit these cost a rollout
        node more than the rest of its submit but the encoding (docs/BENCHMARKS.md, session 35)."""
        loop = asyncio.get_running_loop()
        out = loop.create_future()
        timer = loop.call_later(self.timeout_s, self._span_submit_timed_out, rid, out)

        def replied(reply: asyncio.Future) -> None:
            timer.cancel()
            self._forget(rid)
            if out.done():  # timed out or cancelled first
                return
            if reply.cancelled():
                out.cancel()
                return
            if reply.exception() is not None:
                out.set_exception(reply.exception())
                return
            rtype, rbody, _ = reply.result()
            try:
                raise_for_reply(rtype, rbody, "submit")
            except (BrokerError, LeaseRejected) as exc:
                out.set_exception(self._refused(exc))
                return
            out.set_result(rbody)

        def abandoned(result: asyncio.Future) -> None:
            if result.cancelled():  # the caller gave up on it: stop waiting for the acknowledgement
                timer.cancel()
                self._forget(rid)

        fut.add_done_callback(replied)
        out.add_done_callback(abandoned)
        return out

    def _span_submit_timed_out(self, rid: int, out: asyncio.Future) -> None:
        self._forget(rid)
        if not out.done():
            out.set_exception(BrokerTimeout(timeout_message("submit", self.address, self.timeout_s)))

    async def _submitted(self, rid: int, fut: asyncio.Future, frames: list, nbytes: int) -> dict:
        try:
            body = (await self._reply("submit", rid, fut, self.timeout_s))[0]
        except BrokerTimeout:  # without an answer the frames may still be in flight: not reused
            await self._release_window(nbytes)
            raise
        except (BrokerError, LeaseRejected) as exc:
            self._buffers.give(frames)
            await self._release_window(nbytes)
            refusal = self._refused(exc)
            if refusal is exc:
                raise
            raise refusal from None
        self._buffers.give(frames)
        await self._release_window(nbytes)
        return body

    def _refused(self, exc: BrokerError | LeaseRejected) -> BrokerError | LeaseRejected:
        """What a submit the broker refused raises: ``exc``, or LeaseRejected where the broker closed this
        node's submit memory (it timed out: its leases went back), which is then dropped here too."""
        if isinstance(exc, BrokerError) and exc.code == proto.NO_SUBMIT_MEMORY:
            self._drop_ring()
            return LeaseRejected(str(exc))
        return exc

    async def _acquire_window(self, nbytes: int) -> None:
        async with self._window:
            # One submit larger than the window goes alone.
            await self._window.wait_for(
                lambda: self._unacked_bytes == 0 or self._unacked_bytes + nbytes <= self.max_unacked_bytes
            )
            self._unacked_bytes += nbytes

    async def _release_window(self, nbytes: int) -> None:
        async with self._window:
            self._unacked_bytes -= nbytes
            self._window.notify_all()

    async def release(
        self, lease_id: str, group_ids: list[str] | None = None, error: str | None = None
    ) -> None:
        """Give groups back; ``error``: this node failed to sample them (the broker drops a group that
        fails ``broker.max_group_failures`` times instead of leasing it again)."""
        await self._call("release", release_body(lease_id, group_ids, error))

    async def policy_version(self) -> int:
        return (await self._call("policy_version", {}))[0]["policy_version"]

    async def publish_version(self, version: int) -> None:
        await self._call("publish_version", {"version": version})

    async def get_batch(
        self, after: int, num_groups: int | None = None, timeout_s: float | None = None
    ) -> Batch | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = poll_slice_s(deadline)
            request = {"after": after, "num_groups": num_groups, "timeout_s": wait_s}
            try:
                body, frames = await self._call(
                    "get_batch", {**request, **self._local.request_field()}, timeout=wait_s + self.timeout_s
                )
            except BrokerTimeout:
                # no reply to this slice's request: the broker may have restarted and lost it; ask again
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            frames = self._local.frames(body, frames)
            if frames is None:  # the batch is cut: asked again, it comes at once, on the wire
                continue
            if body.get("batch") or body.get("finished") or (deadline and time.monotonic() >= deadline):
                return batch_from_reply(body, frames)

    async def report_consumed(self, batch_id: int) -> None:
        await self._call("report_consumed", {"batch_id": batch_id})

    async def stats(self) -> dict:
        return (await self._call("stats", {}))[0]

    async def leave(self) -> None:
        await self._call("leave", {})
        self.node_id, self._registration = None, None
        self._drop_ring()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._drop_ring()
        self._local.close()
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncBrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

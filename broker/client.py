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
import time
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from tidal.broker import protocol as proto
from tidal.broker.codec import decode_group, encode_group, lease_from_wire
from tidal.broker.curve import CurveClientKeys
from tidal.broker.types import Batch, Group, Lease

# Encode buffers kept for reuse per client: freshly allocated memory costs a page fault per 4 KiB, which
# was the largest part of a rollout node's cost of submitting large groups.
BUFFER_POOL_BYTES = 256 << 20


class _BufferPool:
    """Reusable memory for encoding group frames. A buffer comes back only once the broker has answered
    the submit that carried it: the broker then holds every byte, so nothing still reads it."""

    def __init__(self, max_bytes: int = BUFFER_POOL_BYTES):
        self.max_bytes = max_bytes
        self.free: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        fits = [i for i, b in enumerate(self.free) if len(b) >= nbytes]
        if fits:
            return self.free.pop(min(fits, key=lambda i: len(self.free[i])))
        step = max(4096, 1 << max(0, nbytes.bit_length() - 4))  # round up by 1/16: sizes vary a little
        return np.empty(-(-nbytes // step) * step, np.uint8)

    def give(self, buffers: list[np.ndarray]) -> None:
        held = sum(len(b) for b in self.free)
        for b in buffers:
            base = b.base if isinstance(b.base, np.ndarray) else b
            if held + len(base) <= self.max_bytes:
                self.free.append(base)
                held += len(base)


class LeaseRejected(Exception):
    """Submit on an expired or unknown lease: the prompts were re-leased; drop these groups."""


class BrokerError(Exception):
    """The broker answered with an error; the message says why."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class BrokerTimeout(BrokerError):
    """No reply in time."""


def _raise_for(type_: str, body: dict[str, Any], what: str) -> None:
    if type_ == "ok":
        return
    code, message = body.get("code", "?"), body.get("message", repr(body))
    if code == proto.LEASE_REJECTED:
        raise LeaseRejected(message)
    raise BrokerError(f"broker refused {what} ({code}): {message}", code)


def _batch(body: dict[str, Any], frames: list[Any]) -> Batch | None:
    b = body.get("batch")
    if b is None:
        return None
    return Batch(b["batch_id"], [decode_group(f) for f in frames], b["policy_version"])


def _lease(body: dict[str, Any]) -> Lease | None:
    return lease_from_wire(body["lease"]) if body.get("lease") else None


# A long wait for a batch is asked for in slices, so that a request lost in a broker restart is asked again.
GET_BATCH_SLICE_S = 10.0


def _poll_s(deadline: float | None) -> float:
    if deadline is None:
        return GET_BATCH_SLICE_S
    return max(0.0, min(GET_BATCH_SLICE_S, deadline - time.monotonic()))


def _socket(ctx: zmq.Context, address: str, curve: CurveClientKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    sock.connect(address)
    return sock


def _timeout_msg(what: str, address: str, timeout: float) -> str:
    return (
        f"no reply to {what} from the broker at {address} within {timeout:.1f}s: is it running and "
        "reachable, and (with CURVE) is this client's public key in its allowed keys?"
    )


class AsyncBrokerClient:
    """asyncio client; one reader task matches replies to requests, so calls may run concurrently."""

    def __init__(self, address: str, *, curve: CurveClientKeys | None = None, timeout_s: float = 30.0):
        self.address = address
        self.timeout_s = timeout_s
        self.node_id: str | None = None
        self._ctx = zmq.asyncio.Context()
        self._sock = _socket(self._ctx, address, curve)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._registration: dict[str, Any] | None = None
        self._register_lock = asyncio.Lock()
        self._buffers = _BufferPool()
        self._generation = 0  # registrations so far: a call knows whether one happened since it was sent

    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                rid, type_, body = proto.decode_reply(frames[0].buffer)
            except Exception:
                continue
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
            if exc.code != proto.NOT_REGISTERED or self._registration is None or type_ == "register":
                raise
        # The broker restarted (membership is not journaled): register again and retry once. Single-flight:
        # a second registration would make the broker drop the first one and take back the leases just
        # granted under it, so concurrent calls wait for one registration and the later ones reuse it.
        async with self._register_lock:
            if self._generation == generation:
                await self._register_once()
        return await self._call_once(type_, body, frames, timeout)

    async def _register_once(self) -> None:
        self.node_id = (await self._call_once("register", self._registration))[0]["node_id"]
        self._generation += 1

    async def _call_once(
        self, type_: str, body: dict[str, Any], frames=(), timeout: float | None = None
    ) -> tuple[dict[str, Any], list[Any]]:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_loop())
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        timeout = self.timeout_s if timeout is None else timeout
        try:
            # The send is inside the timeout too: with no connected peer (broker down, CURVE refused) a
            # DEALER send waits.
            async with asyncio.timeout(timeout):
                await self._sock.send_multipart(
                    [proto.encode_envelope(type_, rid, body), *frames], copy=False
                )
                rtype, rbody, rframes = await fut
        except TimeoutError:
            raise BrokerTimeout(_timeout_msg(type_, self.address, timeout)) from None
        finally:
            self._pending.pop(rid, None)
        _raise_for(rtype, rbody, type_)
        return rbody, rframes

    async def register(self, role: str, name: str, meta: dict | None = None) -> str:
        self._registration = {"role": role, "name": name, "meta": meta or {}}
        async with self._register_lock:
            await self._register_once()
        return self.node_id

    async def heartbeat(self) -> dict:
        return (await self._call("heartbeat", {}))[0]

    async def lease(self, max_groups: int) -> Lease | None:
        return _lease((await self._call("lease", {"max_groups": max_groups}))[0])

    async def submit(self, lease_id: str, groups: list[Group]) -> dict:
        frames = [encode_group(g, self._buffers.take) for g in groups]
        try:
            body = (await self._call("submit", {"lease_id": lease_id, "groups": len(frames)}, frames))[0]
        except (BrokerError, LeaseRejected) as exc:
            if not isinstance(exc, BrokerTimeout):  # without an answer the frames may still be in flight
                self._buffers.give(frames)
            raise
        self._buffers.give(frames)
        return body

    async def release(self, lease_id: str, group_ids: list[str] | None = None) -> None:
        await self._call("release", {"lease_id": lease_id, "group_ids": group_ids})

    async def policy_version(self) -> int:
        return (await self._call("policy_version", {}))[0]["policy_version"]

    async def publish_version(self, version: int) -> None:
        await self._call("publish_version", {"version": version})

    async def get_batch(
        self, after: int, num_groups: int | None = None, timeout_s: float | None = None
    ) -> Batch | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = _poll_s(deadline)
            try:
                body, frames = await self._call(
                    "get_batch",
                    {"after": after, "num_groups": num_groups, "timeout_s": wait_s},
                    timeout=wait_s + self.timeout_s,
                )
            except BrokerTimeout:
                if deadline is not None:
                    raise
                continue  # waiting forever: the broker may be restarting; ask again
            if body.get("batch") or body.get("finished") or (deadline and time.monotonic() >= deadline):
                return _batch(body, frames)

    async def report_consumed(self, batch_id: int) -> None:
        await self._call("report_consumed", {"batch_id": batch_id})

    async def stats(self) -> dict:
        return (await self._call("stats", {}))[0]

    async def leave(self) -> None:
        await self._call("leave", {})
        self.node_id, self._registration = None, None

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncBrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class BrokerClient:
    """Blocking client for one thread (the trainer). Replies to calls that timed out are skipped."""

    def __init__(self, address: str, *, curve: CurveClientKeys | None = None, timeout_s: float = 30.0):
        self.address = address
        self.timeout_s = timeout_s
        self.node_id: str | None = None
        self._ctx = zmq.Context()
        self._sock = _socket(self._ctx, address, curve)
        self._ids = itertools.count(1)
        self._registration: dict[str, Any] | None = None
        self._buffers = _BufferPool()

    def _call(
        self, type_: str, body: dict[str, Any], frames=(), timeout: float | None = -1.0
    ) -> tuple[dict[str, Any], list[Any]]:
        try:
            return self._call_once(type_, body, frames, timeout)
        except BrokerError as exc:
            if exc.code != proto.NOT_REGISTERED or self._registration is None or type_ == "register":
                raise
        # The broker restarted (membership is not journaled): register again and retry once.
        self.node_id = self._call_once("register", self._registration)[0]["node_id"]
        return self._call_once(type_, body, frames, timeout)

    def _call_once(
        self, type_: str, body: dict[str, Any], frames=(), timeout: float | None = -1.0
    ) -> tuple[dict[str, Any], list[Any]]:
        timeout = self.timeout_s if timeout == -1.0 else timeout
        rid = next(self._ids)
        # With no connected peer (broker down, CURVE refused) a DEALER send waits: bound it too.
        self._sock.sndtimeo = -1 if timeout is None else max(1, int(timeout * 1000))
        try:
            self._sock.send_multipart([proto.encode_envelope(type_, rid, body), *frames], copy=False)
        except zmq.Again:
            raise BrokerTimeout(_timeout_msg(type_, self.address, timeout)) from None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(wait_ms):
                raise BrokerTimeout(_timeout_msg(type_, self.address, timeout))
            reply = self._sock.recv_multipart(copy=False)
            try:
                got, rtype, rbody = proto.decode_reply(reply[0].buffer)
            except Exception:
                continue
            if got == rid:
                _raise_for(rtype, rbody, type_)
                return rbody, reply[1:]

    def register(self, role: str, name: str, meta: dict | None = None) -> str:
        self._registration = {"role": role, "name": name, "meta": meta or {}}
        body, _ = self._call("register", self._registration)
        self.node_id = body["node_id"]
        return self.node_id

    def heartbeat(self) -> dict:
        return self._call("heartbeat", {})[0]

    def lease(self, max_groups: int) -> Lease | None:
        return _lease(self._call("lease", {"max_groups": max_groups})[0])

    def submit(self, lease_id: str, groups: list[Group]) -> dict:
        frames = [encode_group(g, self._buffers.take) for g in groups]
        try:
            body = self._call("submit", {"lease_id": lease_id, "groups": len(frames)}, frames)[0]
        except (BrokerError, LeaseRejected) as exc:
            if not isinstance(exc, BrokerTimeout):  # without an answer the frames may still be in flight
                self._buffers.give(frames)
            raise
        self._buffers.give(frames)
        return body

    def release(self, lease_id: str, group_ids: list[str] | None = None) -> None:
        self._call("release", {"lease_id": lease_id, "group_ids": group_ids})

    def policy_version(self) -> int:
        return self._call("policy_version", {})[0]["policy_version"]

    def publish_version(self, version: int) -> None:
        """The trainer's policy version after an optimizer step."""
        self._call("publish_version", {"version": version})

    def get_batch(
        self, after: int, num_groups: int | None = None, timeout_s: float | None = None
    ) -> Batch | None:
        """Batch ``after + 1`` (after=-1 for the first); blocks until it is ready, None on timeout or when
        the data is exhausted (``stats()["finished"]`` tells which). A batch once cut is journaled: asking
        again for the same id returns the same groups."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = _poll_s(deadline)
            try:
                body, frames = self._call(
                    "get_batch",
                    {"after": after, "num_groups": num_groups, "timeout_s": wait_s},
                    timeout=wait_s + self.timeout_s,
                )
            except BrokerTimeout:
                if deadline is not None:
                    raise
                continue  # waiting forever: the broker may be restarting; ask again
            if body.get("batch") or body.get("finished") or (deadline and time.monotonic() >= deadline):
                return _batch(body, frames)

    def report_consumed(self, batch_id: int) -> None:
        """The trainer trained through ``batch_id`` durably (checkpointed); a restart resumes after it."""
        self._call("report_consumed", {"batch_id": batch_id})

    def stats(self) -> dict:
        return self._call("stats", {})[0]

    def leave(self) -> None:
        self._call("leave", {})
        self.node_id, self._registration = None, None

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The blocking broker client, :class:`BrokerClient`, for one thread (the trainer); the asynchronous one
for rollout node agents is in broker/client.py, from where both are imported."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import zmq

from tidal.broker import protocol as proto
from tidal.broker.client_common import (
    GET_BATCH_SLICE_S,
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
from tidal.broker.client_support import _BufferPool, _LocalFrames, _Unacked, send_copies
from tidal.broker.codec import encode_group
from tidal.broker.curve import CurveClientKeys
from tidal.broker.process_identity import is_gone
from tidal.broker.types import Batch, Group, Lease
from tidal.broker.zmq_messages import readable, recv_frames, send_parts

log = logging.getLogger("tidal.broker.client")
OTHER_TRAINER_RETRY_S = 1.0


class BrokerClient:
    """Blocking client for one thread (the trainer). Replies to calls that timed out are skipped."""

    def __init__(
        self,
        address: str,
        *,
        curve: CurveClientKeys | None = None,
        timeout_s: float = 30.0,
        read_journal: bool = True,
        read_memory: bool = True,
        ask_ahead: bool = False,
    ):
        self.address = address
        self.timeout_s = timeout_s
        self.node_id: str | None = None
        self.joined: dict[str, Any] = {}  # the broker's reply to register: its settings (node_timeout_s, ...)
        self._local = _LocalFrames(read_journal, read_memory)
        self._ctx = zmq.Context()
        self._sock = dealer_socket(self._ctx, address, curve)
        self._sndtimeo_ms: int | None = None  # the socket's send timeout as last set (see _send_timeout)
        self._ids = itertools.count(1)
        self._registration: dict[str, Any] | None = None
        self._buffers = _BufferPool()
        # With ask_ahead, get_batch asks for the next batch before it copies and decodes the one it got,
        # so the broker's reply time overlaps that work (a starved consumer gains; the trainer turns it on
        # while it waits for batches, trainer/main.py): (after, num_groups, request fields, request id) of
        # the request sent ahead, and its reply when it came while another call waited
        self._ahead: tuple[int, int | None, dict[str, Any], int] | None = None
        self._stash: dict[int, tuple[str, dict[str, Any], list[Any]]] = {}
        self.ask_ahead = ask_ahead
        self.batches_asked_ahead = 0  # batches whose request was sent ahead and used

    def _send_timeout(self, ms: int) -> None:
        """Bound the next send (setting a socket option costs a few microseconds: only when it changes)."""
        if ms != self._sndtimeo_ms:
            self._sock.sndtimeo = self._sndtimeo_ms = ms

    def _call(
        self, type_: str, body: dict[str, Any], frames=(), timeout: float | None = -1.0, group_ids=None
    ) -> tuple[dict[str, Any], list[Any]]:
        try:
            return self._call_once(type_, body, frames, timeout, group_ids)
        except BrokerError as exc:
            if exc.code != proto.NOT_REGISTERED or self._registration is None or type_ == "register":
                raise
        # The broker restarted (membership is not journaled): register again and retry once.
        self.node_id = self._call_once("register", self._registration)[0]["node_id"]
        return self._call_once(type_, body, frames, timeout, group_ids)

    def _call_once(
        self,
        type_: str,
        body: dict[str, Any],
        frames=(),
        timeout: float | None = -1.0,
        group_ids: list[str] | None = None,
    ) -> tuple[dict[str, Any], list[Any]]:
        """One request and its reply; a submit (``group_ids`` given) is answered by an ``ack`` instead."""
        timeout = self.timeout_s if timeout == -1.0 else timeout
        rid = next(self._ids)
        unacked = _Unacked()
        if group_ids is not None:
            unacked.add(rid, self.node_id, group_ids)
        # With no connected peer (broker down, CURVE refused) a DEALER send waits: bound it too.
        self._send_timeout(-1 if timeout is None else max(1, int(timeout * 1000)))
        try:
            send_parts(
                self._sock, [proto.encode_envelope(type_, rid, body), *frames], copy=send_copies(frames)
            )
        except zmq.Again:
            raise BrokerTimeout(timeout_message(type_, self.address, timeout)) from None
        return self._await(type_, rid, timeout, unacked)

    def _await(
        self, type_: str, rid: int, timeout: float | None, unacked: _Unacked | None = None
    ) -> tuple[dict[str, Any], list[Any]]:
        """The reply to request ``rid`` (or the ack that covers it); others are skipped, except the reply
        to a batch request sent ahead, which is kept for the get_batch that will want it."""
        stashed = self._stash.pop(rid, None)
        if stashed is not None:
            raise_for_reply(stashed[0], stashed[1], type_)
            return stashed[1], stashed[2]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not readable(self._sock, wait_ms):
                raise BrokerTimeout(timeout_message(type_, self.address, timeout))
            reply = recv_frames(self._sock)
            try:
                got, rtype, rbody = proto.decode_reply(reply[0].buffer)
            except Exception:
                continue
            if rtype == "ack":
                done = unacked.acked(rbody) if unacked is not None else None
                if done:
                    return done[0][1], []
            elif got == rid:
                raise_for_reply(rtype, rbody, type_)
                return rbody, reply[1:]
            elif self._ahead is not None and got == self._ahead[3]:
                self._stash = {got: (rtype, rbody, reply[1:])}

    def _send_only(self, type_: str, body: dict[str, Any]) -> None:
        """Send a request whose reply nobody waits for (the next call's loop skips it)."""
        self._send_timeout(max(1, int(self.timeout_s * 1000)))
        try:
            send_parts(self._sock, [proto.encode_envelope(type_, next(self._ids), body)])
        except zmq.Again:
            raise BrokerTimeout(timeout_message(type_, self.address, self.timeout_s)) from None

    def register(self, role: str, name: str, meta: dict | None = None, wait_s: float = 0.0) -> str:
        """Join the broker. With ``wait_s``, a broker that does not answer yet (not started, restarting) is
        asked again every ``timeout_s``, logged each time, until ``wait_s`` has passed; so is one that has
        another trainer alive (``another_trainer``: a trainer restarted after a crash waits for its dead
        predecessor to be forgotten), every ``OTHER_TRAINER_RETRY_S``, logged every 30 s. A trainer whose
        ``meta.process`` says where it runs does not wait for a predecessor on its host whose process is
        gone: it takes its place (``_gone_trainer``)."""
        self._registration = {"role": role, "name": name, "meta": meta or {}}
        deadline = time.monotonic() + wait_s
        logged = 0.0
        replaces = None
        while True:
            try:
                request = (
                    self._registration if replaces is None else {**self._registration, "replaces": replaces}
                )
                body, _ = self._call("register", request)
                break
            except BrokerTimeout:
                if time.monotonic() >= deadline:
                    raise
                log_broker_wait(self.address, wait_s, deadline)
            except BrokerError as exc:
                if exc.code != proto.ANOTHER_TRAINER or time.monotonic() >= deadline:
                    raise
                if replaces is None and (replaces := self._gone_trainer()) is not None:
                    continue
                if time.monotonic() - logged >= 30.0:
                    logged = time.monotonic()
                    log.warning("%s; asking again (giving up in %.0f s)", exc, deadline - logged)
                time.sleep(min(OTHER_TRAINER_RETRY_S, max(0.0, deadline - time.monotonic())))
        self.node_id, self.joined = body["node_id"], body
        return self.node_id

    def _gone_trainer(self) -> str | None:
        """The node id of a registered trainer whose process ran on this host and is gone (a trainer
        restarted after a crash finds its predecessor so), for ``register`` to replace; None when there is
        none or this registration does not say where it runs."""
        if self._registration["meta"].get("process") is None:
            return None
        try:
            nodes = self._call("stats", {})[0]["nodes"]
        except BrokerError:  # a broker going away: register's own retries cover it
            return None
        gone = sorted(
            (n["seen_s_ago"], node_id, n["name"], n["meta"]["process"]["pid"])
            for node_id, n in nodes.items()
            if n["role"] == "trainer" and is_gone(n["meta"].get("process"))
        )
        if not gone:
            return None
        _, node_id, name, pid = gone[0]
        log.warning(
            "trainer %r (%s) is registered, but its process %s on this host is gone: taking its place",
            name,
            node_id,
            pid,
        )
        return node_id

    def heartbeat(self, timeout_s: float | None = None) -> dict:
        """Keeps this member alive (and its leases); ``timeout_s`` bounds the wait for the reply instead of
        the client's ``timeout_s``."""
        return self._call("heartbeat", {}, timeout=self.timeout_s if timeout_s is None else timeout_s)[0]

    def lease(self, max_groups: int) -> Lease | None:
        return lease_from_reply(self._call("lease", {"max_groups": max_groups})[0])

    def submit(self, lease_id: str, groups: list[Group]) -> dict:
        frames = [encode_group(g, self._buffers.take) for g in groups]
        try:
            body = self._call(
                "submit",
                {"lease_id": lease_id, "groups": len(frames)},
                frames,
                group_ids=[g.group_id for g in groups],
            )[0]
        except (BrokerError, LeaseRejected) as exc:
            if not isinstance(exc, BrokerTimeout):  # without an answer the frames may still be in flight
                self._buffers.give(frames)
            raise
        self._buffers.give(frames)
        return body

    def release(self, lease_id: str, group_ids: list[str] | None = None, error: str | None = None) -> int:
        """Give groups back; returns how many will be leased again. ``error``: this node failed to sample
        them (a group that fails ``broker.max_group_failures`` times is dropped instead)."""
        return self._call("release", release_body(lease_id, group_ids, error))[0]["released"]

    def policy_version(self) -> int:
        return self._call("policy_version", {})[0]["policy_version"]

    def publish_version(self, version: int, wait: bool = True) -> None:
        """The trainer's policy version after an optimizer step. With ``wait=False`` it is only sent (the
        broker applies requests of one connection in order; the next call skips the reply)."""
        if wait:
            self._call("publish_version", {"version": version})
        else:
            self._send_only("publish_version", {"version": version})

    def get_batch(
        self, after: int, num_groups: int | None = None, timeout_s: float | None = None
    ) -> Batch | None:
        """Batch ``after + 1`` (after=-1 for the first); blocks until it is ready, None on timeout or when
        the data is exhausted (``stats()["finished"]`` tells which). A batch once cut is journaled: asking
        again for the same id returns the same groups."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = poll_slice_s(deadline)
            request = {"after": after, "num_groups": num_groups, "timeout_s": wait_s}
            ahead, self._ahead = self._ahead, None
            try:
                if ahead is not None and ahead[:3] == (after, num_groups, self._local.request_field()):
                    body, frames = self._await("get_batch", ahead[3], wait_s + self.timeout_s)
                    self.batches_asked_ahead += body.get("batch") is not None
                else:
                    self._stash.clear()  # a reply to a request ahead that nobody will ask for
                    body, frames = self._call(
                        "get_batch",
                        {**request, **self._local.request_field()},
                        timeout=wait_s + self.timeout_s,
                    )
            except BrokerTimeout:
                # no reply to this slice's request: the broker may have restarted and lost it; ask again
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            if self.ask_ahead and body.get("batch") is not None:
                self._ask_ahead(after + 1, num_groups)
            frames = self._local.frames(body, frames)
            if frames is None:  # the batch is cut: asked again, it comes at once, on the wire
                continue
            if body.get("batch") or body.get("finished") or (deadline and time.monotonic() >= deadline):
                return batch_from_reply(body, frames)

    def _ask_ahead(self, after: int, num_groups: int | None) -> None:
        """Send the request for batch ``after + 1`` now; the get_batch that wants it takes its reply."""
        body = {"after": after, "num_groups": num_groups, "timeout_s": GET_BATCH_SLICE_S}
        field = self._local.request_field()
        self._send_timeout(max(1, int(self.timeout_s * 1000)))
        rid = next(self._ids)
        try:
            send_parts(self._sock, [proto.encode_envelope("get_batch", rid, {**body, **field})])
        except zmq.Again:
            return  # asked for when wanted
        self._ahead = (after, num_groups, field, rid)

    def report_consumed(self, batch_id: int, wait: bool = True) -> None:
        """The trainer trained through ``batch_id`` durably (checkpointed); a restart resumes after it.

        With ``wait=False`` the report is only sent: the next call skips its reply. Reports are
        cumulative, so one that is lost (a broker restart) is covered by the next one; until then the
        broker holds those batches and a restarted trainer may be served them again."""
        if wait:
            self._call("report_consumed", {"batch_id": batch_id})
        else:
            self._send_only("report_consumed", {"batch_id": batch_id})

    def stats(self) -> dict:
        return self._call("stats", {})[0]

    def leave(self) -> None:
        self._call("leave", {})
        self.node_id, self._registration = None, None

    def close(self) -> None:
        self._local.close()
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The broker process: one ZeroMQ ROUTER socket served by an asyncio loop.

Each request is parsed and validated (:mod:`tidal.broker.protocol`), applied to :class:`BrokerState` (which
journals before returning) and answered. A ``get_batch`` that cannot be served yet waits in a list that is
revisited after every change and on a timer tick, which also expires leases and silent nodes.

The ROUTER socket is a plain (blocking-API) socket whose file descriptor the event loop watches: each
wake-up reads every waiting message without blocking and handles it synchronously, and replies are sent
at once (the socket has no send limit, so sends never block). This costs far less per message than
pyzmq's asyncio futures. Group frames are kept as the ``zmq.Frame`` objects that came in and are sent on
by reference (libzmq counts references; nothing is copied).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from tidal.broker import protocol as proto
from tidal.broker.batch_refs import journal_refs, memory_refs
from tidal.broker.codec import lease_to_wire
from tidal.broker.config import BrokerConfig
from tidal.broker.curve import configure_server
from tidal.broker.local_journal import host_id
from tidal.broker.state import BrokerState
from tidal.broker.state_records import CutBatch, Node
from tidal.broker.status_line import status_line
from tidal.broker.submit_memory import SubmitArena, can_share
from tidal.broker.zmq_messages import recv_frames, send_parts
from tidal.errors import ConfigError

log = logging.getLogger(__name__)

# Codes that mean the frame itself was bad (counted as bad frames); the others are refusals of valid requests.
_BAD_FRAME_CODES = {proto.BAD_FRAME, proto.BAD_VERSION, proto.UNKNOWN_TYPE, proto.TOO_LARGE, proto.BAD_GROUP}
_AUTH_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


# Messages handled per wake-up before the loop gets a turn for its timers and the journal's callbacks.
DRAIN_BATCH = 64


@dataclass
class _Waiter:
    peer: bytes
    rid: int
    after: int
    num_groups: int | None
    deadline: float
    local: bool = False  # the client runs on this host and reads group frames from the journal itself
    memory: bool = False  # ... or copies them out of this process's memory (local_memory)


@dataclass
class _Ack:
    """What one connection's submits of one wake-up were: the last request id, and the filtered groups."""

    through: int = 0
    filtered: list[list[Any]] = field(default_factory=list)  # [request id, [group ids]]


class BrokerServer:
    def __init__(self, config: BrokerConfig, state: BrokerState):
        self.cfg = config
        self.state = state
        self.errors: Counter[str] = Counter()
        self.auth_failures = 0
        self.requests = 0
        self.started = time.time()
        self.snapshot: dict[str, Any] = {}  # stats refreshed every tick, read by the Prometheus thread
        self._waiters: list[_Waiter] = []
        self._held: deque[tuple[int, list[Any]]] = deque()  # replies waiting for the journal
        self._acks: dict[tuple[bytes, str], _Ack] = {}  # submits handled in this wake-up, by connection
        self._ctx = zmq.asyncio.Context(io_threads=config.io_threads)  # for the ZAP and monitor sockets
        self._auth = None
        self.sock = zmq.Context.shadow(self._ctx).socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Frames over the limit make libzmq drop the connection before reading them into memory.
        self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        if config.curve.enabled:
            self._auth = configure_server(self._ctx, self.sock, config.curve)
        self._monitor = None
        if config.curve.enabled:
            address = f"inproc://tidal-broker-monitor-{id(self)}"
            self.sock.monitor(address, _AUTH_FAILED_EVENTS)
            self._monitor = self._ctx.socket(zmq.PAIR)
            self._monitor.connect(address)
        try:
            self.sock.bind(config.bind)
        except zmq.ZMQError as exc:
            self.sock.close(0)
            raise ConfigError(
                f"broker.bind={config.bind!r}: cannot bind ({zmq.strerror(exc.errno)}); another broker or program may "
                "listen there: stop it or choose another address"
            ) from None
        self._fd = self.sock.getsockopt(zmq.FD)
        self._drain_scheduled = False
        self.tick_s = min(0.25, config.lease_timeout_s / 4, config.node_timeout_s / 4)
        self._status_at = 0.0
        self._status_prev: dict[str, Any] = {}
        self.host = host_id()
        # Where local readers find the journal (compaction replaces the file under the same path).
        self._journal_path = str(state.journal.path.resolve()) if state.journal is not None else ""
        # Local consumers may copy batches out of this process (Yama permitting: allow_memory_reads).
        self.memory_reads = config.memory_reads
        self.pid = os.getpid()

    # ------------------------------------------------------------------ loop
    async def serve(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        if self.state.journal is not None:
            self.state.journal.on_durable = self._on_durable
        # rates in the first status line count from here (a restart's replayed groups are not news)
        self._status_at = time.time()
        self._status_prev = self.stats(self._status_at)
        tasks = [asyncio.create_task(self._ticker(stop))]
        if self._monitor is not None:
            tasks.append(asyncio.create_task(self._watch_auth()))
        self._loop.add_reader(self._fd, self._drain)
        self._kick()
        try:
            await stop.wait()
        finally:
            self._loop.remove_reader(self._fd)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.state.journal is not None:
                self.state.journal.flush()
                self._release_held(self.state.journal.durable_seq)
            self.close()

    def _kick(self) -> None:
        """Read the socket soon. ZeroMQ's descriptor signals edges only, and a send may consume the edge
        of a message that arrived meanwhile: whoever sends outside :meth:`_drain` calls this."""
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self.sock.closed:
            return
        try:
            for _ in range(DRAIN_BATCH):
                try:
                    frames = recv_frames(self.sock, zmq.NOBLOCK)
                except zmq.Again:
                    return
                self._handle(frames[0].bytes, frames[1:])
            self._kick()  # more may be waiting: come back after the loop's other callbacks
        finally:
            self._queue_acks()
            self._push_leases(time.time())
            self._commit()

    def _commit(self) -> None:
        """Write (or hand the writer thread) what the requests just handled appended, then send the
        replies that waited for what is written."""
        j = self.state.journal
        if j is None:
            return
        j.commit()
        if self._held:  # also those a compaction's flush made durable
            self._release_held(j.durable_seq)

    def close(self) -> None:
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.sock.close(0)
        self._ctx.term()

    async def _ticker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = time.time()
            self.state.expire(now)
            self._push_leases(now)
            self._serve_waiters(now)
            self._commit()
            self._kick()
            self.snapshot = self.stats(now)
            self._log_status(now)
            await asyncio.sleep(self.tick_s)

    def _log_status(self, now: float) -> None:
        every = self.cfg.status_every_s
        if not every or now - self._status_at < every:
            return
        log.info(status_line(self.snapshot, self._status_prev, now - self._status_at))
        self._status_at, self._status_prev = now, self.snapshot

    async def _watch_auth(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            event = await recv_monitor_message(self._monitor)
            self.auth_failures += 1
            log.warning("CURVE handshake refused: event %s from %s", event["event"], event["endpoint"])

    # -------------------------------------------------------------- requests
    def _handle(self, peer: bytes, frames: list[zmq.Frame]) -> None:
        self.requests += 1
        try:
            req = proto.decode_request(frames, self.cfg.max_frame_bytes)
        except proto.ProtocolError as exc:
            rid = proto.peek_id(frames[0].buffer) if frames else None
            self._error(peer, rid if rid is not None else 0, exc)
            return
        try:
            getattr(self, f"_on_{req.type}")(peer, req)
        except proto.ProtocolError as exc:
            self._error(peer, req.id, exc)
        except Exception as exc:  # a bug must not take the broker down; the client learns what failed
            log.exception("request %s failed", req.type)
            self._error(peer, req.id, proto.ProtocolError("internal", f"{type(exc).__name__}: {exc}"))

    def _error(self, peer: bytes, rid: int, exc: proto.ProtocolError) -> None:
        self.errors[exc.code] += 1
        if exc.code in _BAD_FRAME_CODES:
            self.state.counters.bad_frames += 1
        self._send(peer, rid, "error", proto.error_body(exc.code, exc.message))

    def _send(
        self, peer: bytes, rid: int, type_: str, body: dict[str, Any], frames=(), durable: bool = False
    ) -> None:
        """Send a reply; with ``durable`` only once everything journaled so far is written, for replies that
        acknowledge records (accepted groups, a cut batch, a version, a trainer's model, a consumed batch,
        failed attempts). Other replies go at
        once: a lease's TAKE record need not be durable first, because after a crash every old lease is
        unknown and its prompts are leased again, so a reply that outruns its record loses nothing."""
        message = [peer, proto.encode_envelope(type_, rid, body), *frames]
        journal = self.state.journal
        if durable and journal is not None:
            self._held.append((journal.appended_seq, message))
            if journal.durable_seq >= journal.appended_seq:
                # already durable, but never ahead of earlier held replies (acks stay cumulative in order)
                self._release_held(journal.durable_seq)
        else:
            send_parts(self.sock, message, copy=False)

    def _on_durable(self, seq: int) -> None:
        """From the journal's writer thread: hand the release of held replies to the event loop."""
        self._loop.call_soon_threadsafe(self._release_held, seq)

    def _release_held(self, seq: int) -> None:
        sent = False
        while self._held and self._held[0][0] <= seq:
            send_parts(self.sock, self._held.popleft()[1], copy=False)
            sent = True
        if sent:
            self._kick()

    def _ok(self, peer: bytes, rid: int, body: dict[str, Any] | None = None, durable: bool = False) -> None:
        self._send(peer, rid, "ok", body or {}, durable=durable)

    def _on_register(self, peer: bytes, req: proto.Request) -> None:
        meta = req.body.get("meta") or {}
        if not isinstance(meta, dict):
            raise proto.ProtocolError(proto.BAD_FRAME, "register: meta must be a map")
        replaces = req.body.get("replaces")
        if replaces is not None and not isinstance(replaces, str):
            raise proto.ProtocolError(
                proto.BAD_FRAME, f"register: replaces must be a node id string, got {replaces!r}"
            )
        journal = self.state.journal
        appended = journal.appended_seq if journal is not None else 0
        node = self.state.register(peer, req.body["role"], req.body["name"], meta, time.time(), replaces)
        log.info("node %s (%s %r) joined", node.node_id, node.role, node.name)
        offer = self._submit_memory(node, req.body.get("host"))
        # A trainer's registration journals the model rollout nodes must serve: its reply waits for that
        # record, so a broker killed right after answering still turns other models away when restarted.
        journaled = journal is not None and journal.appended_seq > appended
        self._ok(
            peer,
            req.id,
            {
                **offer,
                "node_id": node.node_id,
                "policy_version": self.state.version,
                "protocol": proto.PROTOCOL_VERSION,
                "group_size": self.cfg.group_size,
                "batch_groups": self.cfg.batch_groups,
                "max_staleness": self.cfg.max_staleness,
                "staleness_policy": self.cfg.staleness_policy,
                "lease_timeout_s": self.cfg.lease_timeout_s,
                "node_timeout_s": self.cfg.node_timeout_s,
            },
            durable=journaled,
        )

    def _submit_memory(self, node: Node, host: Any) -> dict[str, Any]:
        """A ring of shared memory for a rollout node on this host to submit through (submit_memory)."""
        size = self.cfg.submit_memory_bytes
        if not (size and node.role == "rollout" and host is not None and host == self.host and can_share()):
            return {}
        try:
            node.arena = SubmitArena(size)
        except OSError as exc:
            log.warning("no submit memory for node %s: %s", node.node_id, exc)
            return {}
        return {"submit_memory": node.arena.offer(self.pid)}

    def _on_heartbeat(self, peer: bytes, req: proto.Request) -> None:
        now = time.time()
        node = self.state.node_for(peer, now)
        extended = self.state.heartbeat(node, now)
        self._ok(
            peer,
            req.id,
            {"policy_version": self.state.version, "leases": extended, "finished": self.state.finished},
        )

    def _on_lease(self, peer: bytes, req: proto.Request) -> None:
        now = time.time()
        node = self.state.node_for(peer, now)
        lease = self.state.lease(node, req.body["max_groups"], now)
        self._ok(
            peer,
            req.id,
            {
                "lease": lease_to_wire(lease) if lease else None,
                "policy_version": self.state.version,
                "finished": self.state.finished,
            },
        )

    def _on_stream_leases(self, peer: bytes, req: proto.Request) -> None:
        max_groups = req.body.get("max_groups")
        if max_groups is not None and (not isinstance(max_groups, int) or isinstance(max_groups, bool)):
            raise proto.ProtocolError(proto.BAD_FRAME, "stream_leases: max_groups must be an integer or nil")
        node = self.state.node_for(peer, time.time())
        self.state.stream_leases(node, req.body["credit"], max_groups, req.id)
        self._ok(peer, req.id, {"credit": node.credit, "policy_version": self.state.version})

    def _push_leases(self, now: float) -> None:
        """Push leases to the nodes with a standing request, up to their credit (see stream_leases). Like a
        lease reply, a push need not wait for its TAKE record: after a crash every old lease is unknown."""
        if not self.state.streaming:
            return
        pushed = self.state.push_leases(now)
        for node, lease in pushed:
            body = {
                "node_id": node.node_id,
                "lease": lease_to_wire(lease) if lease else None,
                "policy_version": self.state.version,
                "finished": self.state.finished,
            }
            send_parts(self.sock, [node.peer, proto.encode_envelope("lease", node.stream_id, body)])
        if pushed:
            self._kick()  # a send after the socket read empty may have taken the edge of a new message

    def _on_submit(self, peer: bytes, req: proto.Request) -> None:
        now = time.time()
        node = self.state.node_for(peer, now)
        frames = req.attachments
        spans = req.body.get("spans")
        if spans is not None:
            if node.arena is None:
                raise proto.ProtocolError(
                    proto.NO_SUBMIT_MEMORY,
                    "submit: this node has no submit memory (none was offered, or it timed out and its "
                    "leases went back to the queue): lease again and submit over the wire",
                )
            if not isinstance(spans, list) or len(spans) != req.body["groups"]:
                raise proto.ProtocolError(
                    proto.BAD_FRAME,
                    f"submit: body announces {req.body['groups']} group(s); spans must be a list of as many",
                )
            frames = node.arena.spans(spans, self.cfg.max_frame_bytes)
        elif node.arena is not None:
            node.arena.wire_submits += 1
        result = self.state.submit(node, req.body["lease_id"], frames, now)
        # No reply of its own: one cumulative ack per connection covers every submit handled in this
        # wake-up, sent once their records are written (see _queue_acks).
        key = (peer, node.node_id)
        ack = self._acks.get(key)
        if ack is None:
            ack = self._acks[key] = _Ack()
        ack.through = req.id
        if result["filtered"]:
            ack.filtered.append([req.id, result["filtered"]])
        self._serve_waiters(now)

    def _queue_acks(self) -> None:
        """Send (or hold until journaled) one ``ack`` per connection whose submits were just handled."""
        if not self._acks:
            return
        acks, self._acks = self._acks, {}
        for (peer, node_id), ack in acks.items():
            body = {"node_id": node_id, "through": ack.through, "filtered": ack.filtered}
            self._send(peer, ack.through, "ack", body, durable=True)
        self._kick()  # a send after the socket read empty may have taken the edge of a new message

    def _on_release(self, peer: bytes, req: proto.Request) -> None:
        ids = req.body.get("group_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(g, str) for g in ids)):
            raise proto.ProtocolError(proto.BAD_FRAME, "release: group_ids must be a list of strings or nil")
        error = req.body.get("error")
        if error is not None and not isinstance(error, str):
            raise proto.ProtocolError(proto.BAD_FRAME, "release: error must be a string or nil")
        node = self.state.node_for(peer, time.time())
        n = self.state.release(node, req.body["lease_id"], ids, error)
        self._ok(peer, req.id, {"released": n}, durable=error is not None)  # the attempts are journaled

    def _on_leave(self, peer: bytes, req: proto.Request) -> None:
        node = self.state.node_for(peer, time.time())
        self.state.leave(node)
        log.info("node %s (%s %r) left", node.node_id, node.role, node.name)
        self._ok(peer, req.id)

    def _on_policy_version(self, peer: bytes, req: proto.Request) -> None:
        self.state.seen(peer, time.time())
        self._ok(peer, req.id, {"policy_version": self.state.version})

    def _on_publish_version(self, peer: bytes, req: proto.Request) -> None:
        now = time.time()
        self.state.seen(peer, now)
        self.state.publish_version(req.body["version"])
        self._ok(peer, req.id, {"policy_version": self.state.version}, durable=True)
        self._serve_waiters(now)

    def _on_report_consumed(self, peer: bytes, req: proto.Request) -> None:
        self.state.seen(peer, time.time())
        self.state.report_consumed(req.body["batch_id"])
        self._ok(peer, req.id, {"consumed": self.state.consumed}, durable=True)
        if self.state.maybe_compact():
            log.info("journal compaction started: %d live bytes to copy", self.state.live_bytes())

    def _on_stats(self, peer: bytes, req: proto.Request) -> None:
        self.state.seen(peer, time.time())
        self._ok(peer, req.id, self.stats())

    def _on_get_batch(self, peer: bytes, req: proto.Request) -> None:
        now = time.time()
        self.state.seen(peer, now)
        num_groups, timeout_s = req.body.get("num_groups"), req.body.get("timeout_s")
        if num_groups is not None and (not isinstance(num_groups, int) or isinstance(num_groups, bool)):
            raise proto.ProtocolError(proto.BAD_FRAME, "get_batch: num_groups must be an integer or nil")
        if timeout_s is not None and (not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool)):
            raise proto.ProtocolError(proto.BAD_FRAME, "get_batch: timeout_s must be a number or nil")
        deadline = math.inf if timeout_s is None else now + max(0.0, float(timeout_s))
        host = req.body.get("host")
        if host is not None and not isinstance(host, str):
            raise proto.ProtocolError(proto.BAD_FRAME, "get_batch: host must be a string or nil")
        local = host is not None and host == self.host and self.state.journal is not None
        memory = local and self.memory_reads and req.body.get("memory") is True
        waiter = _Waiter(peer, req.id, req.body["after"], num_groups, deadline, local, memory)
        if not self._try_serve(waiter, now):
            self._waiters.append(waiter)

    def _try_serve(self, w: _Waiter, now: float) -> bool:
        try:
            batch = self.state.get_batch(w.after, w.num_groups)
        except proto.ProtocolError as exc:
            self._error(w.peer, w.rid, exc)
            return True
        if batch is not None:
            self._send_batch(w, batch)
            return True
        finished = self.state.finished and not self.state.buffer
        if finished or now >= w.deadline:
            self._ok(w.peer, w.rid, {"batch": None, "finished": finished})
            return True
        return False

    def _serve_waiters(self, now: float) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for w in waiters:
                if not self._try_serve(w, now):
                    self._waiters.append(w)

    def _send_batch(self, w: _Waiter, batch: CutBatch) -> None:
        body = {
            "batch": {
                "batch_id": batch.batch_id,
                "policy_version": batch.policy_version,
                "groups": len(batch.group_ids),
            }
        }
        refs = journal_refs(self.state, batch) if w.local else None
        if refs is not None:
            # Where the frames lie in the journal (held until written, like every batch reply): the
            # client reads them there, so they do not cross loopback a second time.
            file_id, where = refs
            body["batch"]["journal"] = {
                "path": self._journal_path,
                "file_id": file_id,
                "refs": where,
                # page-cache journals are read through the page cache (an O_DIRECT read of dirty pages
                # would first write them back)
                "direct": self.state.journal.direct,
            }
        if w.memory:
            # Where the frames lie in this process: the client copies them (local_memory) and the
            # journal's device only writes; the journal's refs above are its fallback.
            body["batch"]["memory"] = {"pid": self.pid, **memory_refs(self.state, batch)}
        if refs is not None or w.memory:
            self._send(w.peer, w.rid, "ok", body, durable=True)
            return
        self._send(w.peer, w.rid, "ok", body, self.state.frames_of(batch), durable=True)

    # ----------------------------------------------------------------- stats
    def stats(self, now: float | None = None) -> dict[str, Any]:
        out = self.state.stats(now)
        out["errors"] = dict(self.errors)
        out["auth_failures"] = self.auth_failures
        out["requests"] = self.requests
        out["waiting_batch_requests"] = len(self._waiters)
        arenas = [n.arena for n in self.state.nodes.values() if n.arena is not None]
        out["submit_memory"] = {
            "nodes": len(arenas),
            "spans_taken": sum(a.spans_taken for a in arenas),
            "spans_held": sum(a.held for a in arenas),
            # submits over the wire from nodes holding a ring: theirs had no room (or could not be mapped)
            "wire_submits": sum(a.wire_submits for a in arenas),
        }
        out["uptime_s"] = round(time.time() - self.started, 3)
        return out

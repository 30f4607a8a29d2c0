"""The broker's wire protocol: a msgpack envelope in the first ZeroMQ frame, binary attachments after it.

A message is a ZeroMQ multipart message ``[envelope, attachment...]``. The envelope is a msgpack map
``{"v": PROTOCOL_VERSION, "type": str, "id": int, "body": map}``; attachments are group frames
(see :mod:`tidal.broker.codec`) whose count the body states. A reply carries the request's ``id`` and the
type ``"ok"`` (body: the answer) or ``"error"`` (body: ``{"code", "message"}``), except that accepted
submits get no reply of their own: the broker sends ``"ack"`` messages (body ``{"through", "filtered"}``)
that acknowledge every submit of the connection up to the request id ``through`` once it is journaled.
A node that stood a lease request (``stream_leases``) also gets ``"lease"`` messages pushed, carrying
that request's ``id``.
docs/protocol.md is the reference; this module is its executable form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from tidal.broker import native_codec

PROTOCOL_VERSION = 3
# What changed at each version, for the error an older (or newer) peer gets.
VERSION_CHANGES = {
    2: "group frames carry per-sample columns in the data region",
    3: "submits are acknowledged by cumulative 'ack' messages, not one reply each",
}

# Request types and the body fields each one requires, with their types (for validation).
REQUESTS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "register": {"role": str, "name": str},
    "heartbeat": {},
    "lease": {"max_groups": int},
    "stream_leases": {"credit": int},
    "submit": {"lease_id": str, "groups": int},
    "release": {"lease_id": str},
    "leave": {},
    "policy_version": {},
    "publish_version": {"version": int},
    "get_batch": {"after": int},
    "report_consumed": {"batch_id": int},
    "stats": {},
}

ROLES = ("rollout", "trainer")

# Error codes carried in error replies.
BAD_FRAME = "bad_frame"  # not msgpack, not an envelope, wrong field types, wrong attachment count
BAD_VERSION = "bad_version"  # envelope version this broker does not speak
UNKNOWN_TYPE = "unknown_type"
TOO_LARGE = "too_large"
NOT_REGISTERED = "not_registered"
LEASE_REJECTED = "lease_rejected"
BAD_GROUP = "bad_group"  # group frame malformed or inconsistent with its lease (sample count, arrays)
BAD_REQUEST = "bad_request"  # well-formed but not acceptable now (batch order, consumed batch, ...)
NO_SUBMIT_MEMORY = "no_submit_memory"  # a submit named spans of a ring this node no longer has
MODEL_MISMATCH = "model_mismatch"  # a rollout node serves another model than the trainer trains
ANOTHER_TRAINER = "another_trainer"  # a trainer registers while another one is alive


class ProtocolError(Exception):
    """A frame that cannot be served; ``code`` goes into the error reply."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Request:
    type: str
    id: int
    body: dict[str, Any]
    attachments: list[Any]  # zmq.Frame or bytes-like


def encode_envelope(type_: str, id_: int, body: dict[str, Any] | None = None) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": type_, "id": id_, "body": body or {}})


def error_body(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def peek_id(raw: bytes | memoryview) -> int | None:
    """The request id of an envelope that failed validation, so the error reply can carry it."""
    try:
        env = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        return None
    if isinstance(env, dict):
        rid = env.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63:
            return rid
    return None


def decode_request(frames: list[Any], max_frame_bytes: int) -> Request:
    """Parse and validate ``[envelope, attachment...]``; raise :class:`ProtocolError` saying what is wrong."""
    if not frames:
        raise ProtocolError(BAD_FRAME, "empty message: expected [envelope, attachments...]")
    total = sum(len(_buf(f)) for f in frames)
    if total > max_frame_bytes:
        raise ProtocolError(
            TOO_LARGE, f"message of {total} bytes exceeds broker.max_frame_bytes={max_frame_bytes}"
        )
    raw = _buf(frames[0])
    try:
        env = unpackb(raw)
    except Exception as exc:
        raise ProtocolError(BAD_FRAME, f"envelope is not msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(env, dict):
        raise ProtocolError(BAD_FRAME, f"envelope must be a map, got {type(env).__name__}")
    v = env.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            BAD_VERSION,
            f"protocol version {v!r} not supported; this broker speaks v={PROTOCOL_VERSION} "
            f"(v{PROTOCOL_VERSION}: {VERSION_CHANGES[PROTOCOL_VERSION]}): use a client of the same tidal "
            "version as the broker",
        )
    rid, type_, body = env.get("id"), env.get("type"), env.get("body", {})
    if not _is_int(rid) or rid < 0:
        raise ProtocolError(BAD_FRAME, f"envelope id must be a non-negative integer, got {rid!r}")
    if not isinstance(type_, str):
        raise ProtocolError(BAD_FRAME, f"envelope type must be a string, got {type_!r}")
    if type_ not in REQUESTS:
        raise ProtocolError(
            UNKNOWN_TYPE, f"unknown message type {type_[:64]!r}; known: {', '.join(REQUESTS)}"
        )
    if not isinstance(body, dict):
        raise ProtocolError(BAD_FRAME, f"{type_}: body must be a map, got {type(body).__name__}")
    for key, want in REQUESTS[type_].items():
        if key not in body:
            raise ProtocolError(BAD_FRAME, f"{type_}: body lacks required field {key!r}")
        value = body[key]
        ok = _is_int(value) if want is int else isinstance(value, want)
        if not ok:
            raise ProtocolError(
                BAD_FRAME,
                f"{type_}: field {key!r} must be {getattr(want, '__name__', want)}, got {type(value).__name__}",
            )
    attachments = list(frames[1:])
    # a submit carries its group frames, or names where they lie in memory shared with the broker
    expected = body["groups"] if type_ == "submit" and "spans" not in body else 0
    if len(attachments) != expected:
        raise ProtocolError(
            BAD_FRAME, f"{type_}: body announces {expected} attachment(s) but {len(attachments)} came"
        )
    return Request(type_, rid, body, attachments)


def decode_reply(raw: bytes | memoryview) -> tuple[int, str, dict[str, Any]]:
    env = unpackb(raw)
    if not isinstance(env, dict) or env.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(BAD_VERSION, f"reply is not a v{PROTOCOL_VERSION} envelope: {env!r:.200}")
    return env["id"], env["type"], env.get("body") or {}


def unpackb(data: Any, *, strict_map_key: bool = False, native: bool = True) -> Any:
    """``msgpack.unpackb(data, raw=False, strict_map_key=...)``: by the native codec's decoder where it
    takes the input (the same values in about half the time; it decodes only string and bin map keys,
    which both settings accept), else by msgpack, which also raises the errors. ``native=False``: msgpack
    alone (the reference the codec's tests compare with)."""
    decode = native_codec.function("unpack") if native else None
    if decode is not None:
        out = decode(data)
        if out is not NotImplemented:
            return out
    return msgpack.unpackb(data, raw=False, strict_map_key=strict_map_key)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _buf(frame: Any) -> memoryview | bytes:
    return getattr(frame, "buffer", frame)

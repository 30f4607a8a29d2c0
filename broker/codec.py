"""Binary layout of a scored group (one ZeroMQ frame) and the msgpack forms of prompts and leases.

A group frame is ``u32 LE header length | msgpack header | zero padding to 8 bytes | array data``.
The header is ``{"id", "meta", "samples": [{"reward", "finish_reason", "meta", "arrays": {name:
[dtype, shape, offset]}}]}`` with offsets relative to the data region. Arrays are little-endian; decoding
returns numpy views into the frame's buffer (no copy), so the broker can journal and forward the frame
as it came.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from tidal.broker.protocol import BAD_GROUP, ProtocolError
from tidal.broker.types import Group, Lease, PromptGroup, PromptRow, Sample

ALIGN = 8
_HEADER_LEN = struct.Struct("<I")
ALLOWED_DTYPES = {"<i4", "<i8", "<f4", "<f8", "<f2", "|u1", "|i1", "<i2", "<u2", "|b1"}
_DTYPES = {d: np.dtype(d) for d in ALLOWED_DTYPES}
SAMPLE_ARRAYS = ("prompt_ids", "response_ids", "logprobs", "versions", "loss_mask")
RESPONSE_ALIGNED = ("logprobs", "versions", "loss_mask")  # same length as response_ids


@dataclass
class GroupInfo:
    """What the broker needs to know about a group frame without keeping its arrays around."""

    group_id: str
    num_samples: int
    rewards: list[float]
    min_version: int
    num_tokens: int


def _pad(n: int) -> int:
    return (-n) % ALIGN


def _le(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a


def encode_group(group: Group) -> bytearray:
    """One frame holding the whole group; arrays are copied once into it."""
    arrays: list[np.ndarray] = []
    samples_h = []
    offset = 0
    for s in group.samples:
        entry: dict[str, Any] = {}
        for name in SAMPLE_ARRAYS:
            a = getattr(s, name)
            if a is None:
                continue
            a = _le(np.asarray(a))
            entry[name] = [a.dtype.str, list(a.shape), offset]
            arrays.append(a)
            offset += a.nbytes + _pad(a.nbytes)
        samples_h.append(
            {
                "reward": float(s.reward),
                "finish_reason": s.finish_reason,
                "meta": s.meta,
                "arrays": entry,
            }
        )
    header = msgpack.packb({"id": group.group_id, "meta": group.meta, "samples": samples_h})
    start = _HEADER_LEN.size + len(header)
    start += _pad(start)
    out = bytearray(start + offset)
    _HEADER_LEN.pack_into(out, 0, len(header))
    out[_HEADER_LEN.size : _HEADER_LEN.size + len(header)] = header
    pos = start
    for a in arrays:
        out[pos : pos + a.nbytes] = memoryview(a).cast("B") if a.nbytes else b""
        pos += a.nbytes + _pad(a.nbytes)
    return out


def _header(buf: memoryview) -> tuple[dict[str, Any], int]:
    if len(buf) < _HEADER_LEN.size:
        raise ProtocolError(BAD_GROUP, f"group frame of {len(buf)} bytes is shorter than its header length")
    (hlen,) = _HEADER_LEN.unpack_from(buf, 0)
    if _HEADER_LEN.size + hlen > len(buf):
        raise ProtocolError(BAD_GROUP, f"group header length {hlen} runs past the frame ({len(buf)} bytes)")
    try:
        header = msgpack.unpackb(buf[_HEADER_LEN.size : _HEADER_LEN.size + hlen], raw=False)
    except Exception as exc:
        raise ProtocolError(BAD_GROUP, f"group header is not msgpack: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("id"), str):
        raise ProtocolError(BAD_GROUP, "group header must be a map with a string 'id'")
    if not isinstance(header.get("samples"), list):
        raise ProtocolError(BAD_GROUP, f"group {header['id']!r}: 'samples' must be a list")
    start = _HEADER_LEN.size + hlen
    return header, start + _pad(start)


def _spec(buf_len: int, data_start: int, spec: Any, where: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """Validate ``[dtype, shape, offset]`` against the frame; returns (dtype, shape, begin, count)."""
    if not (isinstance(spec, list) and len(spec) == 3):
        raise ProtocolError(BAD_GROUP, f"{where}: array spec must be [dtype, shape, offset]")
    dtype, shape, offset = spec
    if dtype not in ALLOWED_DTYPES:
        raise ProtocolError(
            BAD_GROUP, f"{where}: dtype {dtype!r} not allowed; use one of {sorted(ALLOWED_DTYPES)}"
        )
    if not (
        isinstance(shape, list)
        and all(type(d) is int and d >= 0 for d in shape)
        and type(offset) is int
        and offset >= 0
    ):
        raise ProtocolError(BAD_GROUP, f"{where}: shape must be non-negative ints and offset >= 0")
    dt = _DTYPES[dtype]
    count = math.prod(shape)
    begin = data_start + offset
    if begin + count * dt.itemsize > buf_len:
        raise ProtocolError(BAD_GROUP, f"{where}: array of {count} x {dtype} runs past the frame")
    return dt, tuple(shape), begin, count


def _sample_specs(buf_len: int, data_start: int, s: Any, where: str) -> dict[str, tuple]:
    if not isinstance(s, dict) or not isinstance(s.get("arrays"), dict):
        raise ProtocolError(BAD_GROUP, f"{where}: sample must be a map with 'arrays'")
    reward = s.get("reward")
    if not isinstance(reward, int | float) or isinstance(reward, bool) or not math.isfinite(reward):
        raise ProtocolError(BAD_GROUP, f"{where}: reward must be a finite number, got {reward!r}")
    specs = {k: _spec(buf_len, data_start, v, f"{where} {k}") for k, v in s["arrays"].items()}
    for name in ("response_ids", "logprobs", "versions"):
        if name not in specs:
            raise ProtocolError(BAD_GROUP, f"{where}: array {name!r} is missing")
    r = specs["response_ids"][1][:1]
    for name in RESPONSE_ALIGNED:
        if name in specs and specs[name][1][:1] != r:
            raise ProtocolError(
                BAD_GROUP, f"{where}: {name} has {specs[name][1][:1]} tokens, response_ids has {r}"
            )
    return specs


def _view(buf: memoryview, spec: tuple) -> np.ndarray:
    dt, shape, begin, count = spec
    return np.frombuffer(buf, dtype=dt, count=count, offset=begin).reshape(shape)


def _as_buffer(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")


def decode_group(frame: Any) -> Group:
    """Zero-copy decode: the arrays are read-only views into ``frame``."""
    buf = _as_buffer(frame)
    header, data_start = _header(buf)
    gid = header["id"]
    samples = []
    for i, s in enumerate(header["samples"]):
        specs = _sample_specs(len(buf), data_start, s, f"group {gid!r} sample {i}")
        arrays = {k: _view(buf, v) for k, v in specs.items()}
        samples.append(
            Sample(
                prompt_ids=arrays.get("prompt_ids", np.zeros(0, np.int32)),
                response_ids=arrays["response_ids"],
                logprobs=arrays["logprobs"],
                versions=arrays["versions"],
                reward=float(s["reward"]),
                finish_reason=str(s.get("finish_reason", "")),
                loss_mask=arrays.get("loss_mask"),
                meta=s.get("meta") or {},
            )
        )
    meta = header.get("meta") or {}
    return Group(group_id=gid, samples=samples, meta=meta if isinstance(meta, dict) else {})


def inspect_group(frame: Any) -> GroupInfo:
    """Validate a frame as fully as :func:`decode_group` does, and summarise it for the broker's
    bookkeeping; only the version arrays are looked at."""
    buf = _as_buffer(frame)
    header, data_start = _header(buf)
    gid = header["id"]
    rewards, min_versions, tokens = [], [], 0
    for i, s in enumerate(header["samples"]):
        specs = _sample_specs(len(buf), data_start, s, f"group {gid!r} sample {i}")
        rewards.append(float(s["reward"]))
        if specs["versions"][3]:
            min_versions.append(int(_view(buf, specs["versions"]).min()))
        tokens += specs["response_ids"][3]
    if not rewards:
        raise ProtocolError(BAD_GROUP, f"group {gid!r} has no samples")
    return GroupInfo(
        group_id=gid,
        num_samples=len(rewards),
        rewards=rewards,
        min_version=min(min_versions) if min_versions else 0,
        num_tokens=tokens,
    )


def prompt_group_to_wire(pg: PromptGroup) -> dict[str, Any]:
    r = pg.row
    return {
        "group_id": pg.group_id,
        "n": pg.n,
        "row": {
            "index": r.index,
            "data_source": r.data_source,
            "prompt": r.prompt,
            "ground_truth": r.ground_truth,
            "extra_info": r.extra_info,
        },
    }


def prompt_group_from_wire(d: dict[str, Any]) -> PromptGroup:
    return PromptGroup(group_id=d["group_id"], row=PromptRow(**d["row"]), n=d["n"])


def lease_to_wire(lease: Lease) -> dict[str, Any]:
    return {
        "lease_id": lease.lease_id,
        "deadline": lease.deadline,
        "groups": [prompt_group_to_wire(g) for g in lease.groups],
    }


def lease_from_wire(d: dict[str, Any]) -> Lease:
    return Lease(
        lease_id=d["lease_id"],
        deadline=d["deadline"],
        groups=[prompt_group_from_wire(g) for g in d["groups"]],
    )

"""Binary layout of a scored group (one ZeroMQ frame) and the msgpack forms of prompts and leases.

A group frame is ``u32 LE header length | msgpack header | zero padding to 8 bytes | array data``.
The layout is columnar: each per-token array of all samples is stored concatenated, once per group, with
each sample's lengths in the header, so that validating, summarising and decoding a group costs a few
operations per group rather than per sample. The header is

    {"id": str, "meta": map, "n": int,
     "rewards": [float] * n, "finish_reasons": [str] * n, "sample_meta": [map] * n,
     "prompt_lens": [int] * n, "response_lens": [int] * n,
     "arrays": {name: [dtype, count, offset]}}

with offsets relative to the data region (each a multiple of 8). ``prompt_ids`` holds sum(prompt_lens)
entries; ``response_ids``, ``logprobs``, ``versions`` and the optional ``loss_mask`` hold
sum(response_lens). Arrays are little-endian; decoding returns numpy views into the frame's buffer (no
copy), so the broker can journal and forward the frame as it came.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import msgpack
import numpy as np

from tidal.broker.protocol import BAD_GROUP, ProtocolError
from tidal.broker.types import Group, Lease, PromptGroup, PromptRow, Sample

ALIGN = 8
_HEADER_LEN = struct.Struct("<I")
ALLOWED_DTYPES = {"<i4", "<i8", "<f4", "<f8", "<f2", "|u1", "|i1", "<i2", "<u2", "|b1"}
_DTYPES = {d: np.dtype(d) for d in ALLOWED_DTYPES}
PROMPT_ARRAYS = ("prompt_ids",)
RESPONSE_ARRAYS = ("response_ids", "logprobs", "versions", "loss_mask")
REQUIRED_ARRAYS = ("prompt_ids", "response_ids", "logprobs", "versions")
_PER_SAMPLE = ("rewards", "finish_reasons", "sample_meta", "prompt_lens", "response_lens")


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


def _flat(a: Any, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"sample.{name} must be 1-D, got shape {a.shape}")
    return a


def encode_group(group: Group) -> bytearray:
    """One frame holding the whole group; each array is copied once, straight into the frame."""
    ss = group.samples
    columns: dict[str, list[np.ndarray]] = {
        name: [_flat(getattr(s, name), name) for s in ss] for name in REQUIRED_ARRAYS
    }
    if any(s.loss_mask is not None for s in ss):
        columns["loss_mask"] = [
            _flat(s.loss_mask, "loss_mask")
            if s.loss_mask is not None
            else np.ones(len(s.response_ids), np.uint8)
            for s in ss
        ]
    specs, offset = {}, 0
    for name, parts in columns.items():
        dt = np.result_type(*parts) if parts else np.dtype(np.int32)
        dt = dt.newbyteorder("<") if dt.byteorder == ">" else dt
        count = sum(len(p) for p in parts)
        specs[name] = [dt.str, count, offset]
        offset += count * dt.itemsize
        offset += _pad(offset)
    header = msgpack.packb(
        {
            "id": group.group_id,
            "meta": group.meta,
            "n": len(ss),
            "rewards": [float(s.reward) for s in ss],
            "finish_reasons": [s.finish_reason for s in ss],
            "sample_meta": [s.meta for s in ss],
            "prompt_lens": [len(p) for p in columns["prompt_ids"]],
            "response_lens": [len(p) for p in columns["response_ids"]],
            "arrays": specs,
        }
    )
    start = _HEADER_LEN.size + len(header)
    start += _pad(start)
    out = bytearray(start + offset)
    _HEADER_LEN.pack_into(out, 0, len(header))
    out[_HEADER_LEN.size : _HEADER_LEN.size + len(header)] = header
    for name, parts in columns.items():
        dtype, count, off = specs[name]
        dst = np.frombuffer(out, dtype=dtype, count=count, offset=start + off)
        if parts and count:
            np.concatenate(parts, out=dst, casting="same_kind")
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
    gid, n = header["id"], header.get("n")
    if type(n) is not int or n < 1:
        raise ProtocolError(BAD_GROUP, f"group {gid!r}: 'n' must be a positive integer, got {n!r}")
    for key in _PER_SAMPLE:
        if not isinstance(header.get(key), list) or len(header[key]) != n:
            raise ProtocolError(BAD_GROUP, f"group {gid!r}: {key!r} must be a list of n={n} entries")
    for key in ("prompt_lens", "response_lens"):
        if not all(type(x) is int and x >= 0 for x in header[key]):
            raise ProtocolError(BAD_GROUP, f"group {gid!r}: {key!r} must hold non-negative integers")
    if not all(type(r) in (int, float) and math.isfinite(r) for r in header["rewards"]):
        raise ProtocolError(BAD_GROUP, f"group {gid!r}: rewards must be finite numbers")
    if not isinstance(header.get("arrays"), dict):
        raise ProtocolError(BAD_GROUP, f"group {gid!r}: 'arrays' must be a map")
    start = _HEADER_LEN.size + hlen
    return header, start + _pad(start)


def _specs(buf_len: int, data_start: int, header: dict[str, Any]) -> dict[str, tuple[np.dtype, int, int]]:
    """Validate the array table against the frame and the lengths; returns name -> (dtype, count, begin)."""
    gid = header["id"]
    want = {"prompt_ids": sum(header["prompt_lens"])}
    want.update(dict.fromkeys(RESPONSE_ARRAYS, sum(header["response_lens"])))
    out = {}
    for name, spec in header["arrays"].items():
        where = f"group {gid!r} array {name!r}"
        if name not in want:
            raise ProtocolError(BAD_GROUP, f"{where}: unknown array; known: {', '.join(want)}")
        if not (isinstance(spec, list) and len(spec) == 3):
            raise ProtocolError(BAD_GROUP, f"{where}: spec must be [dtype, count, offset]")
        dtype, count, offset = spec
        if dtype not in ALLOWED_DTYPES:
            raise ProtocolError(
                BAD_GROUP, f"{where}: dtype {dtype!r} not allowed; use one of {sorted(ALLOWED_DTYPES)}"
            )
        if type(count) is not int or type(offset) is not int or offset < 0:
            raise ProtocolError(BAD_GROUP, f"{where}: count and offset must be non-negative integers")
        if count != want[name]:
            length = "prompt_lens" if name in PROMPT_ARRAYS else "response_lens"
            raise ProtocolError(
                BAD_GROUP, f"{where}: {name} has {count} entries, sum({length}) is {want[name]}"
            )
        dt = _DTYPES[dtype]
        begin = data_start + offset
        if begin + count * dt.itemsize > buf_len:
            raise ProtocolError(BAD_GROUP, f"{where}: {count} x {dtype} runs past the frame")
        out[name] = (dt, count, begin)
    for name in REQUIRED_ARRAYS:
        if name not in out:
            raise ProtocolError(BAD_GROUP, f"group {gid!r}: array {name!r} is missing")
    return out


def _as_buffer(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")


def _column(buf: memoryview, spec: tuple[np.dtype, int, int]) -> np.ndarray:
    dt, count, begin = spec
    return np.frombuffer(buf, dtype=dt, count=count, offset=begin)


def decode_group(frame: Any) -> Group:
    """Zero-copy decode: the arrays are read-only views into ``frame``."""
    buf = _as_buffer(frame)
    header, data_start = _header(buf)
    cols = {k: _column(buf, v) for k, v in _specs(len(buf), data_start, header).items()}
    p_ends = list(accumulate(header["prompt_lens"]))
    r_ends = list(accumulate(header["response_lens"]))
    mask = cols.get("loss_mask")
    samples = []
    for i in range(header["n"]):
        p0, r0 = (p_ends[i - 1], r_ends[i - 1]) if i else (0, 0)
        p1, r1 = p_ends[i], r_ends[i]
        meta = header["sample_meta"][i]
        samples.append(
            Sample(
                prompt_ids=cols["prompt_ids"][p0:p1],
                response_ids=cols["response_ids"][r0:r1],
                logprobs=cols["logprobs"][r0:r1],
                versions=cols["versions"][r0:r1],
                reward=float(header["rewards"][i]),
                finish_reason=str(header["finish_reasons"][i]),
                loss_mask=None if mask is None else mask[r0:r1],
                meta=meta if isinstance(meta, dict) else {},
            )
        )
    meta = header.get("meta") or {}
    return Group(group_id=header["id"], samples=samples, meta=meta if isinstance(meta, dict) else {})


def inspect_group(frame: Any) -> GroupInfo:
    """Validate a frame as fully as :func:`decode_group` does and summarise it for the broker."""
    buf = _as_buffer(frame)
    header, data_start = _header(buf)
    specs = _specs(len(buf), data_start, header)
    versions = _column(buf, specs["versions"])
    # A sample without response tokens has no version; such a group counts as current (version 0 floor).
    return GroupInfo(
        group_id=header["id"],
        num_samples=header["n"],
        rewards=[float(r) for r in header["rewards"]],
        min_version=int(versions.min()) if versions.size else 0,
        num_tokens=specs["response_ids"][1],
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

"""Binary layout of a scored group (one ZeroMQ frame) and the msgpack forms of prompts and leases.

A group frame is ``u32 LE header length | msgpack header | zero padding to 8 bytes | data region``. The
header is small and of fixed shape whatever the group size:

    {"id": str, "n": int, "meta": map, "arrays": {name: [dtype, count, offset]}}

with offsets relative to the data region (each a multiple of 8). Everything per sample lives in the data
region as arrays, so that checking a frame costs a few operations per group, never per sample:

- ``rewards`` (<f8, n), ``prompt_lens`` and ``response_lens`` (<i4, n): the samples' rewards and lengths;
- ``sample_info`` (|u1): msgpack ``[finish_reasons, sample_metas]``, opaque to the broker (only the
  trainer's decoder reads it);
- ``prompt_ids`` (sum(prompt_lens) entries), ``response_ids``, ``logprobs``, ``versions`` and the optional
  ``loss_mask`` (sum(response_lens) each): each the concatenation over the group's samples (columnar).

Arrays are little-endian; decoding returns numpy views into the frame's buffer (no copy), so the broker
can journal and forward the frame as it came.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import msgpack
import numpy as np

from tidal.broker import native_codec
from tidal.broker.protocol import BAD_GROUP, ProtocolError, unpackb
from tidal.broker.types import Group, Lease, PromptGroup, PromptRow, Sample

ALIGN = 8
_HEADER_LEN = struct.Struct("<I")
ALLOWED_DTYPES = {"<i4", "<i8", "<f4", "<f8", "<f2", "|u1", "|i1", "<i2", "<u2", "|b1"}
_DTYPES = {d: np.dtype(d) for d in ALLOWED_DTYPES}
PROMPT_ARRAYS = ("prompt_ids",)
RESPONSE_ARRAYS = ("response_ids", "logprobs", "versions", "loss_mask")
TOKEN_ARRAYS = ("prompt_ids", "response_ids", "logprobs", "versions")
# Per-sample columns and the opaque metadata blob: fixed dtypes, required.
SAMPLE_COLUMNS = {"rewards": "<f8", "prompt_lens": "<i4", "response_lens": "<i4"}
SAMPLE_INFO = "sample_info"
REQUIRED_ARRAYS = (*SAMPLE_COLUMNS, SAMPLE_INFO, *TOKEN_ARRAYS)
_KNOWN = (*REQUIRED_ARRAYS, "loss_mask")
_ZEROS = bytes(ALIGN)


@dataclass
class GroupInfo:
    """What the broker needs to know about a group frame without keeping its arrays around."""

    group_id: str
    num_samples: int
    rewards: list[float]
    min_version: int
    num_tokens: int
    max_version: int = 0
    # where the per-token versions lie in the frame: (byte offset, count, dtype); the journal packs them
    versions_at: tuple[int, int, np.dtype] | None = None


def _pad(n: int) -> int:
    return (-n) % ALIGN


def _flat(a: Any, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"sample.{name} must be 1-D, got shape {a.shape}")
    return a


def _little(dt: np.dtype) -> np.dtype:
    return dt.newbyteorder("<") if dt.byteorder == ">" else dt


@functools.cache
def _native() -> Any:
    """The C hot paths (``native_codec.c``), configured; None where they cannot be built."""
    module, _ = native_codec.load()
    if module is not None:
        module.configure(_DTYPES, np.empty, np.uint8, np.frombuffer, msgpack.packb)
    return module


def encode_group(
    group: Group,
    alloc: Callable[[int], np.ndarray] | None = None,
    *,
    native: bool = True,
    streaming: bool = False,
) -> np.ndarray:
    """One frame (a uint8 array) holding the whole group; each array is copied once, into the frame.

    ``alloc(nbytes)`` may supply the memory (a uint8 array of at least ``nbytes``), e.g. a reused buffer.
    ``streaming``: the frame is for other processes and this one will not read it again (a submit ring's
    span): the C code copies its arrays with non-temporal stores, which do not read the memory first (the
    same bytes). ``native=False`` runs the Python code alone (the reference the C code must equal)."""
    module = _native() if native else None
    if module is not None:
        frame = module.encode(group, alloc, streaming)
        if frame is not None:
            return frame
    ss = group.samples
    n = len(ss)
    # Per-sample columns are packed with struct (a handful of values: cheaper than numpy calls).
    packed: dict[str, tuple[str, int, bytes]] = {
        "rewards": ("<f8", n, _struct(n, "d").pack(*[s.reward for s in ss])),
        "prompt_lens": ("<i4", n, _struct(n, "i").pack(*[len(s.prompt_ids) for s in ss])),
        "response_lens": ("<i4", n, _struct(n, "i").pack(*[len(s.response_ids) for s in ss])),
    }
    info = msgpack.packb([[s.finish_reason for s in ss], [s.meta for s in ss]])
    packed[SAMPLE_INFO] = ("|u1", len(info), info)
    columns: dict[str, list[np.ndarray]] = {}
    for name in TOKEN_ARRAYS:
        col = [getattr(s, name) for s in ss]
        # this runs for every group a node submits: arrays that are 1-D already take no call each
        if not all(type(a) is np.ndarray and a.ndim == 1 for a in col):
            col = [_flat(a, name) for a in col]
        columns[name] = col
    if any(s.loss_mask is not None for s in ss):
        columns["loss_mask"] = [
            _flat(s.loss_mask, "loss_mask")
            if s.loss_mask is not None
            else np.ones(len(s.response_ids), np.uint8)
            for s in ss
        ]
    specs, offset = {}, 0
    for name, (dtype, count, data) in packed.items():
        specs[name] = [dtype, count, offset]
        offset += len(data) + _pad(len(data))
    for name, col in columns.items():
        dt = _little(np.result_type(*col)) if col else np.dtype(np.int32)
        count = sum(map(len, col))
        specs[name] = [dt.str, count, offset]
        offset += count * dt.itemsize
        offset += _pad(offset)
    header = msgpack.packb({"id": group.group_id, "n": n, "meta": group.meta, "arrays": specs})
    start = _HEADER_LEN.size + len(header)
    start += _pad(start)
    total = start + offset
    out = np.empty(total, np.uint8) if alloc is None else alloc(total)[:total]
    view = memoryview(out)
    _HEADER_LEN.pack_into(view, 0, len(header))
    view[_HEADER_LEN.size : _HEADER_LEN.size + len(header)] = header
    view[_HEADER_LEN.size + len(header) : start] = _ZEROS[: start - _HEADER_LEN.size - len(header)]
    for name, (_, _, data) in packed.items():
        at = start + specs[name][2]
        view[at : at + len(data)] = data
        view[at + len(data) : at + len(data) + _pad(len(data))] = _ZEROS[: _pad(len(data))]
    for name, col in columns.items():
        dtype, count, off = specs[name]
        size = count * np.dtype(dtype).itemsize
        if col and count:
            np.concatenate(col, out=out[start + off : start + off + size].view(dtype), casting="same_kind")
        at = start + off + size
        view[at : at + _pad(size)] = _ZEROS[: _pad(size)]  # no stray memory on the wire
    return out


def _as_buffer(frame: Any) -> memoryview:
    return memoryview(getattr(frame, "buffer", frame)).cast("B")


class _Frame:
    """A validated group frame: the header, and where each array lies (dtype, count, byte offset)."""

    __slots__ = (
        "buf",
        "bytes_",
        "gid",
        "meta",
        "n",
        "prompt_lens",
        "response_lens",
        "rewards",
        "specs",
        "version_range",
    )

    def __init__(self, frame: Any, *, native: bool = True, want_versions: bool = False):
        buf = self.buf = _as_buffer(frame)
        self.bytes_: np.ndarray | None = None  # the frame as uint8, made by the first column()
        if len(buf) < _HEADER_LEN.size:
            raise ProtocolError(
                BAD_GROUP, f"group frame of {len(buf)} bytes is shorter than its header length"
            )
        (hlen,) = _HEADER_LEN.unpack_from(buf, 0)
        if _HEADER_LEN.size + hlen > len(buf):
            raise ProtocolError(
                BAD_GROUP, f"group header length {hlen} runs past the frame ({len(buf)} bytes)"
            )
        try:
            header = unpackb(
                buf[_HEADER_LEN.size : _HEADER_LEN.size + hlen], strict_map_key=True, native=native
            )
        except Exception as exc:
            raise ProtocolError(BAD_GROUP, f"group header is not msgpack: {exc}") from None
        if not isinstance(header, dict) or not isinstance(header.get("id"), str):
            raise ProtocolError(BAD_GROUP, "group header must be a map with a string 'id'")
        gid, n, arrays = header["id"], header.get("n"), header.get("arrays")
        if type(n) is not int or n < 1:
            raise ProtocolError(BAD_GROUP, f"group {gid!r}: 'n' must be a positive integer, got {n!r}")
        if not isinstance(arrays, dict):
            raise ProtocolError(BAD_GROUP, f"group {gid!r}: 'arrays' must be a map")
        self.gid, self.n, self.meta = gid, n, header.get("meta")
        start = _HEADER_LEN.size + hlen
        data_start = start + _pad(start)
        self.version_range: tuple[int, int] | None = None
        module = _native() if native and n <= len(buf) else None
        if module is not None:
            # the C checks accept exactly what the Python ones below accept; where they refuse, the Python
            # checks run to raise the error with its message
            checked = module.layout(buf, data_start, n, arrays, want_versions)
            if checked is not None:
                self.specs, self.prompt_lens, self.response_lens, self.rewards, low, high = checked
                if want_versions:
                    self.version_range = (low, high)
                return
        self.specs = self._specs(arrays, data_start)
        self._check_samples()

    def _specs(self, arrays: dict[Any, Any], data_start: int) -> dict[str, tuple[np.dtype, int, int]]:
        # Runs for every submitted group: the messages are built only when a check fails.
        out = {}
        size = len(self.buf)
        for name, spec in arrays.items():
            if name not in _KNOWN:
                raise self._bad(name, f"unknown array; known: {', '.join(_KNOWN)}")
            if type(spec) is not list or len(spec) != 3:
                raise self._bad(name, "spec must be [dtype, count, offset]")
            dtype, count, offset = spec
            dt = _DTYPES.get(dtype) if type(dtype) is str else None
            if dt is None:
                raise self._bad(name, f"dtype {dtype!r} not allowed; use one of {sorted(ALLOWED_DTYPES)}")
            if type(count) is not int or type(offset) is not int or count < 0 or offset < 0:
                raise self._bad(name, "count and offset must be non-negative integers")
            begin = data_start + offset
            if begin + count * dt.itemsize > size:
                raise self._bad(name, f"{count} x {dtype} runs past the frame")
            out[name] = (dt, count, begin)
        for name in REQUIRED_ARRAYS:
            if name not in out:
                raise ProtocolError(BAD_GROUP, f"group {self.gid!r}: array {name!r} is missing")
        for name, dtype in SAMPLE_COLUMNS.items():
            dt, count, _ = out[name]
            if dt.str != dtype or count != self.n:
                raise ProtocolError(
                    BAD_GROUP, f"group {self.gid!r}: {name!r} must be {self.n} x {dtype} (one per sample)"
                )
        if out[SAMPLE_INFO][0].str != "|u1":
            raise ProtocolError(BAD_GROUP, f"group {self.gid!r}: {SAMPLE_INFO!r} must be bytes (|u1)")
        if out["versions"][0].kind not in "iu":
            raise self._bad(
                "versions", f"dtype {out['versions'][0].str} not allowed; policy versions are integers"
            )
        return out

    def _bad(self, name: Any, what: str) -> ProtocolError:
        return ProtocolError(BAD_GROUP, f"group {self.gid!r} array {name!r}: {what}")

    def column(self, name: str) -> np.ndarray:
        dt, count, begin = self.specs[name]
        # views of one uint8 array of the frame: a third of np.frombuffer's cost per column (per group)
        if self.bytes_ is None:
            self.bytes_ = np.frombuffer(self.buf, np.uint8)
        return self.bytes_[begin : begin + count * dt.itemsize].view(dt)

    def _per_sample(self, name: str, code: str) -> tuple[Any, ...]:
        _, count, begin = self.specs[name]
        return _struct(count, code).unpack_from(self.buf, begin)

    def _check_samples(self) -> None:
        self.prompt_lens = self._per_sample("prompt_lens", "i")
        self.response_lens = self._per_sample("response_lens", "i")
        self.rewards = self._per_sample("rewards", "d")
        if min(self.prompt_lens) < 0 or min(self.response_lens) < 0:
            raise ProtocolError(BAD_GROUP, f"group {self.gid!r}: sample lengths must be non-negative")
        prompt_tokens, response_tokens = sum(self.prompt_lens), sum(self.response_lens)
        for name, (_, count, _) in self.specs.items():
            want = prompt_tokens if name in PROMPT_ARRAYS else response_tokens
            if count != want and (name in PROMPT_ARRAYS or name in RESPONSE_ARRAYS):
                length = "prompt_lens" if name in PROMPT_ARRAYS else "response_lens"
                raise ProtocolError(
                    BAD_GROUP,
                    f"group {self.gid!r} array {name!r}: {name} has {count} entries, sum({length}) is {want}",
                )
        if not all(map(math.isfinite, self.rewards)):
            raise ProtocolError(BAD_GROUP, f"group {self.gid!r}: rewards must be finite numbers")


@functools.cache
def _struct(count: int, code: str) -> struct.Struct:
    return struct.Struct(f"<{count}{code}")


def decode_group(frame: Any, *, native: bool = True) -> Group:
    """Zero-copy decode: the arrays are read-only views into ``frame``."""
    module = _native() if native else None
    if module is not None:
        group = module.decode(_as_buffer(frame), Sample, Group)  # the whole of what follows, in C
        if group is not None:
            return group
    f = _Frame(frame, native=native)
    try:
        finish_reasons, metas = unpackb(f.column(SAMPLE_INFO), strict_map_key=True, native=native)
        if not (len(finish_reasons) == len(metas) == f.n):
            raise ValueError(f"{len(finish_reasons)} finish reasons and {len(metas)} metas")
    except Exception as exc:
        raise ProtocolError(
            BAD_GROUP,
            f"group {f.gid!r}: {SAMPLE_INFO} must be msgpack [finish_reasons, metas] of n={f.n}: {exc}",
        ) from None
    column, rewards = f.column, f.rewards
    prompt_ids, response_ids = column("prompt_ids"), column("response_ids")
    logprobs, versions = column("logprobs"), column("versions")
    mask = column("loss_mask") if "loss_mask" in f.specs else None
    group_meta = f.meta if isinstance(f.meta, dict) else {}
    p_ends = list(accumulate(f.prompt_lens))
    r_ends = list(accumulate(f.response_lens))
    samples = []
    p0 = r0 = 0
    for i in range(f.n):
        p1, r1 = p_ends[i], r_ends[i]
        meta = metas[i]
        samples.append(
            Sample(
                prompt_ids=prompt_ids[p0:p1],
                response_ids=response_ids[r0:r1],
                logprobs=logprobs[r0:r1],
                versions=versions[r0:r1],
                reward=rewards[i],
                finish_reason=str(finish_reasons[i]),
                loss_mask=None if mask is None else mask[r0:r1],
                meta=meta if isinstance(meta, dict) else {},
            )
        )
        p0, r0 = p1, r1
    return Group(group_id=f.gid, samples=samples, meta=group_meta)


def inspect_group(frame: Any, *, native: bool = True) -> GroupInfo:
    """Validate a frame as :func:`decode_group` does (all but the opaque per-sample metadata, which only
    the trainer reads) and summarise it for the broker, in a few operations per group."""
    module = _native() if native else None
    if module is not None:
        fields = module.inspect(_as_buffer(frame))  # what follows, in C
        if fields is not None:
            return GroupInfo(*fields)
    f = _Frame(frame, native=native, want_versions=True)
    dt, count, begin = f.specs["versions"]
    if f.version_range is not None:
        low, high = f.version_range
        return GroupInfo(
            group_id=f.gid,
            num_samples=f.n,
            rewards=list(f.rewards),
            min_version=low,
            num_tokens=f.specs["response_ids"][1],
            max_version=high,
            versions_at=(begin, count, dt),
        )
    versions = f.column("versions")
    # A sample without response tokens has no version; such a group counts as current (version 0 floor).
    # (np.minimum.reduce: no np.min wrapper)
    return GroupInfo(
        group_id=f.gid,
        num_samples=f.n,
        rewards=list(f.rewards),
        min_version=int(np.minimum.reduce(versions)) if count else 0,
        num_tokens=f.specs["response_ids"][1],
        max_version=int(np.maximum.reduce(versions)) if count else 0,
        versions_at=(begin, count, dt),
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

"""Analysis only: the broker codec's work replaced by the least a native codec could still do.

``broker_throughput.py --free-codec LEVEL`` installs these in the producers, the consumer and (through
``free_codec_site/sitecustomize.py`` on the broker's PYTHONPATH) the broker, to bound what a native codec
would gain:

- ``encode_inspect``: a producer's encode is one copy of a template frame plus the header written for its
  group id; the broker's inspect parses the header and returns the template's summary under that id; the
  consumer decodes with no validation (header, sample info, the samples as views);
- ``all``: decoding costs nothing either: the consumer gets the same Sample objects again under each id.

Valid only for the benchmark's groups, which carry the same arrays and metadata whatever their id (the
templates are keyed by frame length and id length). Never used outside ``benchmarks/``.
"""

from __future__ import annotations

import os
from typing import Any

import msgpack
import numpy as np

from tidal.broker import codec
from tidal.broker.types import Group, Sample

ENV = "TIDAL_BENCH_FREE_CODEC"
LEVELS = ("encode_inspect", "all")


def _header(buf: memoryview) -> tuple[dict[str, Any], int]:
    (hlen,) = codec._HEADER_LEN.unpack_from(buf, 0)
    start = codec._HEADER_LEN.size + hlen
    return msgpack.unpackb(buf[codec._HEADER_LEN.size : start], raw=False), start + (-start) % codec.ALIGN


def _encoder():
    real = codec.encode_group
    templates: dict[tuple[int, int], tuple[np.ndarray, dict]] = {}

    def encode_group(group: Group, alloc=None) -> np.ndarray:
        key = (len(group.samples), len(group.group_id))
        if key not in templates:
            frame = real(group)
            templates[key] = (frame, _header(memoryview(frame))[0]["arrays"])
        frame, specs = templates[key]
        out = np.empty(len(frame), np.uint8) if alloc is None else alloc(len(frame))[: len(frame)]
        out[:] = frame
        header = msgpack.packb({"id": group.group_id, "n": key[0], "meta": group.meta, "arrays": specs})
        at = codec._HEADER_LEN.size
        out[at : at + len(header)] = np.frombuffer(header, np.uint8)  # same length: the id's is in the key
        return out

    return encode_group


def _inspector():
    real = codec.inspect_group
    templates: dict[int, codec.GroupInfo] = {}

    def inspect_group(frame: Any) -> codec.GroupInfo:
        buf = codec._as_buffer(frame)
        gid = _header(buf)[0]["id"]
        t = templates.get(len(buf)) or templates.setdefault(len(buf), real(frame))
        return codec.GroupInfo(
            gid, t.num_samples, t.rewards, t.min_version, t.num_tokens, t.max_version, t.versions_at
        )

    return inspect_group


def _lean_decode(frame: Any) -> Group:
    buf = codec._as_buffer(frame)
    header, start = _header(buf)
    specs = header["arrays"]

    def column(name: str) -> np.ndarray:
        dtype, count, offset = specs[name]
        return np.frombuffer(buf, dtype=dtype, count=count, offset=start + offset)

    finish_reasons, metas = msgpack.unpackb(column("sample_info"), raw=False)
    prompt_lens, response_lens = column("prompt_lens").tolist(), column("response_lens").tolist()
    rewards = column("rewards").tolist()
    p, r, lp, v = (column(n) for n in ("prompt_ids", "response_ids", "logprobs", "versions"))
    samples, p0, r0 = [], 0, 0
    for i in range(header["n"]):
        p1, r1 = p0 + prompt_lens[i], r0 + response_lens[i]
        samples.append(
            Sample(p[p0:p1], r[r0:r1], lp[r0:r1], v[r0:r1], rewards[i], finish_reasons[i], None, metas[i])
        )
        p0, r0 = p1, r1
    return Group(header["id"], samples, header.get("meta") or {})


def _free_decoder():
    groups: dict[int, Group] = {}

    def decode_group(frame: Any) -> Group:
        buf = codec._as_buffer(frame)
        gid = _header(buf)[0]["id"]
        g = groups.get(len(buf)) or groups.setdefault(len(buf), _lean_decode(frame))
        return Group(gid, g.samples, g.meta)

    return decode_group


def install(level: str) -> None:
    """Replace the codec where the broker, its clients and its state look it up."""
    if level not in LEVELS:
        raise ValueError(f"free codec level {level!r}: one of {', '.join(LEVELS)}")
    from tidal.broker import blocking_client, client, client_common, state, submit_memory

    encode = _encoder()
    for module in (codec, submit_memory, client, blocking_client):
        module.encode_group = encode
    codec.inspect_group = state.inspect_group = _inspector()
    codec.decode_group = client_common.decode_group = _lean_decode if level != "all" else _free_decoder()


def install_from_env() -> None:
    level = os.environ.get(ENV)
    if level:
        install(level)

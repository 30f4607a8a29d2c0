"""The broker benchmark's free-codec bound moves the same bytes and yields the same values as the codec."""

import sys
from pathlib import Path

import numpy as np

from tidal.broker.codec import decode_group, encode_group, inspect_group

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import free_codec  # noqa: E402
from broker_baselines import sample_arrays  # noqa: E402
from broker_method import _group  # noqa: E402


def test_free_encode_writes_the_codecs_frame_under_each_group_id():
    arrays = sample_arrays(64)
    encode = free_codec._encoder()
    for gid in ("0:12", "0:13", "1:99"):  # ids of one length share the template
        group = _group(gid, arrays, 4)
        assert np.array_equal(encode(group), encode_group(group))


def test_free_inspect_and_decodes_give_the_codecs_values():
    arrays = sample_arrays(64)
    inspect, free_decode = free_codec._inspector(), free_codec._free_decoder()
    for gid in ("0:12", "0:13"):
        frame = encode_group(_group(gid, arrays, 4))
        assert inspect(frame) == inspect_group(frame)
        want = decode_group(frame)
        for got in (free_codec._lean_decode(frame), free_decode(frame)):
            assert got.group_id == gid and got.meta == want.meta and len(got.samples) == 4
            for a, b in zip(got.samples, want.samples, strict=True):
                assert np.array_equal(a.response_ids, b.response_ids) and a.meta == b.meta
                assert np.array_equal(a.logprobs, b.logprobs) and np.array_equal(a.versions, b.versions)
                assert a.reward == b.reward and a.finish_reason == b.finish_reason

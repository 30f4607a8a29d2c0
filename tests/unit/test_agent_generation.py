"""The agent's segment bookkeeping on SGLang-shaped responses (checked against SGLang's own types)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from tidal.rollout.generation import PartialResponse, SampleFailed, Segment, parse_version, sampling_params
from tidal.rollout.http_client import parse_generate_response

SGLANG_TYPES = Path(sys.prefix) / "lib/python3.12/site-packages/sglang/api/v1/api_types.py"


@pytest.fixture(scope="module")
def sglang_types():
    if not SGLANG_TYPES.exists():
        pytest.skip(
            f"SGLang's generated types are not installed at {SGLANG_TYPES} (make setup installs them)"
        )
    spec = importlib.util.spec_from_file_location("sglang_api_types", SGLANG_TYPES)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def segment(raw):
    return Segment.from_result(parse_generate_response(raw, prompt_tokens=3))


def response(ids, logprobs, finish, version="0", spans=None):
    meta = {
        "id": "r1",
        "prompt_tokens": 3,
        "completion_tokens": len(ids),
        "finish_reason": finish,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
        "weight_version": version,
    }
    if spans is not None:
        meta["weight_versions"] = spans
    return {"text": "", "output_ids": ids, "meta_info": meta}


def test_per_token_versions_come_from_weight_version_spans(sglang_types):
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    raw = response([5, 6, 7, 8, 9], [-0.1] * 5, {"type": "stop", "matched": 2}, version="4", spans=spans)
    sglang_types.GenerateResponse.from_json_value(raw)  # the shape SGLang 0.5.23 returns
    seg = segment(raw)
    assert seg.versions.tolist() == [3, 3, 4, 4, 4]
    assert seg.finish_reason == "stop" and seg.token_ids == [5, 6, 7, 8, 9]


def test_without_spans_every_token_gets_the_weight_version_and_default_is_zero():
    assert segment(response([4, 5, 6], [-1.0] * 3, {"type": "length"}, "7")).versions.tolist() == [7, 7, 7]
    assert segment(response([4, 5], [-1.0] * 2, {"type": "length"}, "default")).versions.tolist() == [0, 0]
    assert parse_version(None) == 0 and parse_version("12") == 12


def test_logprobs_are_required_for_every_token():
    raw = response([5, 6], [-0.1, -0.2], {"type": "length", "length": 2})
    raw["meta_info"]["output_token_logprobs"] = raw["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(SampleFailed, match="2 output ids but 1 logprobs"):
        segment(raw)


def test_an_aborted_segment_is_resumed_from_prompt_plus_partial_output(sglang_types):
    partial = PartialResponse(prompt_ids=[1, 2, 3], max_new_tokens=6)
    aborted = response([10, 11], [-0.5, -0.25], {"type": "abort", "message": "weight update"}, version="0")
    sglang_types.GenerateResponse.from_json_value(aborted)
    partial.add(segment(aborted))
    assert not partial.done and partial.resumes == 1 and partial.remaining == 4
    assert partial.request_input_ids() == [1, 2, 3, 10, 11]

    params = sampling_params({"temperature": 0.7, "top_p": 1.0, "top_k": -1}, partial, [2])
    payload = {"input_ids": partial.request_input_ids(), "sampling_params": params, "return_logprob": True}
    request = sglang_types.GenerateRequest.from_json_value(payload)  # what the agent sends validates
    assert request.sampling_params.max_new_tokens == 4

    partial.add(segment(response([12, 2], [-0.125, -1.0], {"type": "stop", "matched": 2}, "1")))
    assert partial.done and partial.finish_reason == "stop" and partial.segments == 2
    assert partial.token_ids == [10, 11, 12, 2]
    assert partial.logprobs == [-0.5, -0.25, -0.125, -1.0]
    assert partial.version_array().tolist() == [0, 0, 1, 1]
    assert partial.version_array().dtype == np.int32


def test_an_abort_that_used_up_the_budget_finishes_as_length():
    partial = PartialResponse(prompt_ids=[1], max_new_tokens=2)
    partial.add(segment(response([4, 5], [-1.0, -1.0], {"type": "abort"})))
    assert partial.done and partial.finish_reason == "length"


def test_an_engine_returning_more_than_asked_is_truncated_to_the_budget():
    partial = PartialResponse(prompt_ids=[1], max_new_tokens=2)
    partial.add(segment(response([4, 5, 6], [-1.0] * 3, {"type": "length", "length": 3})))
    assert partial.token_ids == [4, 5] and len(partial.logprobs) == 2 and partial.version_array().size == 2

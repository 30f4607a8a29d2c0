"""Colocated weight sync's payloads on CPU: what the sender pickles, what the engine accepts, and its errors.

CUDA IPC itself needs a GPU (tests/gpu/test_gpu_colocated.py); here the same pickles carry host tensors,
which ``torch.multiprocessing`` shares by file descriptor, and the engine's decoder admits them only when a
test asks (``allow_host=True``; the route refuses a CPU engine before decoding anything).
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import io
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from tidal.rollout.embedded import ipc_receive
from tidal.rollout.embedded.ipc_receive import (
    IpcPayloadError,
    UpdateFromTensorBody,
    check_engine_device,
    decode_payload,
    parse_request,
)
from tidal.weights_sync import bucket
from tidal.weights_sync.colocated import serialize_bucket

SGLANG = Path(importlib.util.find_spec("sglang").origin).parent
TENSORS = [
    ("model.embed_tokens.weight", torch.randn(7, 5, dtype=torch.bfloat16)),
    ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 5, dtype=torch.bfloat16)),
    ("model.norm.weight", torch.randn(5, dtype=torch.bfloat16)),
]


def _sglang_safe_globals() -> set[tuple[str, str]]:
    """SafeUnpickler.ALLOWED_GLOBALS from SGLang's source (the module cannot be imported without its deps)."""
    tree = ast.parse((SGLANG / "srt" / "utils" / "common.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler":
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and stmt.targets[0].id == "ALLOWED_GLOBALS":
                    return set(ast.literal_eval(stmt.value))
    raise AssertionError("SafeUnpickler.ALLOWED_GLOBALS not found in SGLang's source")


def _globals_of(payload: str) -> set[tuple[str, str]]:
    """The globals a payload's pickle refers to (loaded once, by an unpickler that records them)."""
    found = set()

    class Recording(ipc_receive._Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            return super().find_class(module, name)

    Recording(base64.b64decode(payload), allow_host=True).load()
    return found


def _body(payloads: list[str], **kw) -> UpdateFromTensorBody:
    return UpdateFromTensorBody(
        serialized_named_tensors=payloads, **{"load_format": "flattened_bucket", **kw}
    )


def test_sender_bucket_round_trips_bitwise_and_passes_sglangs_safe_unpickler():
    buf, spec = bucket.pack(TENSORS)
    payload = serialize_bucket(buf, spec)
    got = parse_request(_body([payload]), allow_host=True)
    assert [n for n, _ in got] == [n for n, _ in TENSORS]
    for (_, a), (_, b) in zip(got, TENSORS, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))
    unknown = _globals_of(serialize_bucket(buf, spec)) - _sglang_safe_globals()
    assert not unknown, f"SGLang's SafeUnpickler would refuse {unknown}"


def test_engine_accepts_the_payload_sglangs_client_builds():
    # SGLang's own FlattenedTensorBucket, loaded from its source under its real module name (its parent
    # packages as empty modules: importing sglang itself needs its runtime dependencies)
    name = "sglang.srt.weight_sync.tensor_bucket"
    spec = importlib.util.spec_from_file_location(name, SGLANG / "srt" / "weight_sync" / "tensor_bucket.py")
    module = importlib.util.module_from_spec(spec)
    added = [p for p in ("sglang", "sglang.srt", "sglang.srt.weight_sync") if p not in sys.modules]
    for parent in added:
        sys.modules[parent] = types.ModuleType(parent)
    added.append(name)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        sg = module.FlattenedTensorBucket(named_tensors=TENSORS)
        out = io.BytesIO()
        ForkingPickler(out).dump(
            {"flattened_tensor": sg.get_flattened_tensor(), "metadata": sg.get_metadata()}
        )
    finally:
        for added_name in added:
            del sys.modules[added_name]
    body = {
        "serialized_named_tensors": [base64.b64encode(out.getvalue()).decode()],
        "load_format": "flattened_bucket",
    }
    got = parse_request(UpdateFromTensorBody(**body), allow_host=True)
    assert [(n, t.shape) for n, t in got] == [(n, t.shape) for n, t in TENSORS]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, TENSORS, strict=True))


def test_request_fields_are_sglangs():
    tree = ast.parse((SGLANG / "srt" / "managers" / "io_struct.py").read_text())
    node = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "UpdateWeightsFromTensorReqInput"
    )
    fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)}
    assert fields | {"rid"} == set(UpdateFromTensorBody.model_fields)


def test_direct_load_format_takes_name_tensor_pairs():
    out = io.BytesIO()
    ForkingPickler(out).dump(TENSORS[:2])
    body = _body([base64.b64encode(out.getvalue()).decode()], load_format=None)
    got = parse_request(body, allow_host=True)
    assert [n for n, _ in got] == [n for n, _ in TENSORS[:2]]


def _pickled(obj) -> str:
    out = io.BytesIO()
    ForkingPickler(out).dump(obj)
    return base64.b64encode(out.getvalue()).decode()


class _Shell:
    def __reduce__(self):
        import os

        return (os.system, ("true",))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_body(["a", "b"]), "has 2 entries: the embedded engine is one rank"),
        (_body(["not base64!"]), "not valid base64"),
        (_body([base64.b64encode(b"junk").decode()]), "not a tensor pickle"),
        (_body(["eA=="], load_format="safetensors"), "load_format='safetensors' is not supported"),
        (_body(["eA=="], selector="draft"), "no draft model"),
        (_body([base64.b64encode(pickle.dumps(_Shell())).decode()]), "refers to posix.system"),
        (_body([_pickled({"metadata": []})]), "a pickled dict with 'flattened_tensor' and 'metadata'"),
    ],
)
def test_bad_requests_name_what_is_wrong(body, message):
    with pytest.raises(IpcPayloadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_request(body, allow_host=True)


def test_bucket_metadata_outside_the_buffer_is_refused():
    buf, spec = bucket.pack(TENSORS)
    spec.shapes[-1] = [50]  # claims more bytes than the buffer holds
    with pytest.raises(IpcPayloadError, match=r"model.norm.weight: bytes \[.*\) do not hold"):
        parse_request(_body([serialize_bucket(buf, spec)]), allow_host=True)


def test_host_tensors_and_cpu_engines_are_refused_with_the_way_out():
    buf, spec = bucket.pack(TENSORS)
    with pytest.raises(IpcPayloadError, match="takes CUDA tensors shared by CUDA IPC"):
        decode_payload(serialize_bucket(buf, spec))
    with pytest.raises(IpcPayloadError, match="needs a CUDA engine; this engine runs on cpu"):
        check_engine_device(torch.device("cpu"))

"""Colocated mode on one GPU: weights by CUDA IPC handles, and the engine's sleep / wake.

- ``tidal serve`` (bf16, CUDA graphs) and a megatron-core trainer process (``child_colocated_sync.py``) on the
  same GPU: ``weights_sync.transport='auto'`` picks CUDA IPC, and after each of two syncs every tensor the
  engine holds is bitwise equal to the trainer's bf16 export.
- The embedded engine in this process: releasing its weights, KV cache and CUDA graphs drops
  ``torch.cuda.memory_allocated`` by at least their bytes (and ``memory_reserved`` after ``empty_cache``);
  after waking, its greedy output equals the output before sleeping, with CUDA graphs recaptured.
- ``/update_weights_from_tensor`` takes what SGLang's own client sends (bitwise), and refuses a broken payload, and a
  GPU it cannot see, naming the cause.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tidal.rollout.embedded.testing import served_engine

pytestmark = pytest.mark.gpu

MODEL = dict(
    family="qwen3",
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [100, 200, 300, 400, 500]]
# large enough (about 0.3 GB of weights, tensors of 8-64 MB) that freed storages are whole allocator segments
MEMORY_MODEL = dict(
    MODEL, vocab_size=32768, hidden_size=1024, num_hidden_layers=4, head_dim=128, intermediate_size=4096
)


@pytest.fixture(scope="module")
def colocated_engine(tmp_path_factory):
    with served_engine(
        MODEL,
        "seed=3",
        "rollout.engine.device=cuda",
        "rollout.engine.dtype=bfloat16",
        "rollout.engine.max_batch_size=8",
        "rollout.engine.max_seq_len=64",
        log_path=tmp_path_factory.mktemp("colocated") / "serve.log",
        start_timeout_s=240,
    ) as proc:
        yield proc


def test_colocated_sync_of_the_trainers_export_is_bitwise_equal(colocated_engine, child):
    result = child("child_colocated_sync.py", colocated_engine.url, json.dumps(MODEL), timeout_s=300)
    assert result["transport"] == "cuda_ipc", "transport=auto did not see the engine on the trainer's GPU"
    assert [s["weight_version"] for s in result["syncs"]] == ["1", "2"]
    for sync in result["syncs"]:
        assert sync["ok"] and not sync["dropped"], sync
        assert sync["buckets"] > 4, "small buckets: both staging buffers are reused"
        assert sync["checked"] > 0 and sync["mismatched"] == [], sync


def test_engine_generates_after_colocated_updates(colocated_engine):
    import httpx

    resp = httpx.post(
        f"{colocated_engine.url}/generate",
        json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        timeout=60,
    )
    assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 8


def test_sleep_frees_gpu_memory_and_wake_restores_greedy_output():
    import torch

    from tidal.model_config import ModelConfig
    from tidal.rollout.config import EmbeddedEngineConfig
    from tidal.rollout.embedded.memory_routes import release_memory, resume_memory
    from tidal.rollout.embedded.sampling import SamplingParams
    from tidal.rollout.embedded.service import EmbeddedEngine, GenerateInput

    engine = EmbeddedEngine(
        ModelConfig(**MEMORY_MODEL),
        EmbeddedEngineConfig(device="cuda", dtype="bfloat16", max_batch_size=8, max_seq_len=256),
        seed=3,
    )
    engine.start()

    def greedy() -> list[list[int]]:
        async def go():
            inputs = [
                GenerateInput(p, SamplingParams(max_new_tokens=12, temperature=0), return_logprob=False)
                for p in PROMPTS
            ]
            return [r.output_ids for r in await engine.generate(inputs)]

        return asyncio.run(go())

    try:
        before = greedy()
        assert engine.scheduler.decode_mode == "cuda_graphs", engine.scheduler.decode_reason
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        freed = asyncio.run(release_memory(engine, None))  # empties the allocator's cache after freeing
        after_allocated, after_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        storage_bytes = freed["weights"] + freed["kv_cache"]
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.lm.parameters())
        assert freed["weights"] >= weight_bytes * 0.99  # tied / fused views share storage
        assert allocated - after_allocated >= storage_bytes, (allocated, after_allocated, freed)
        assert reserved - after_reserved >= storage_bytes, (reserved, after_reserved, freed)
        assert not engine.scheduler._lean_step.graphs

        asyncio.run(resume_memory(engine, None))
        assert engine.scheduler._lean_step.graphs, "CUDA graphs were not recaptured on wake"
        assert torch.cuda.memory_allocated() >= allocated - (1 << 20)
        assert greedy() == before
    finally:
        engine.close()


def test_update_from_tensor_refusals_name_the_cause(colocated_engine):
    import httpx
    import torch

    from tidal.rollout.embedded import ipc_receive

    resp = httpx.post(
        f"{colocated_engine.url}/update_weights_from_tensor",
        json={"serialized_named_tensors": ["AAAA"], "load_format": "flattened_bucket"},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert "not a tensor pickle" in resp.json()["message"]
    # SGLang's senders name the device by UUID: one that no visible GPU has is refused with the reason
    assert ipc_receive._device_index(str(torch.cuda.get_device_properties(0).uuid)) == 0
    with pytest.raises(ipc_receive.IpcPayloadError, match="cannot see"):
        ipc_receive._device_index("GPU-00000000-0000-0000-0000-000000000000")


def test_payload_of_sglangs_client_loads_bitwise(colocated_engine):
    """What SGLang's own client sends: its FlattenedTensorBucket, tensors pickled with SGLang's patched
    reduction (the device named by GPU UUID, rebuilt by sglang.srt.utils.patch_torch)."""
    import base64
    import importlib.util
    import io
    import sys
    import types
    from multiprocessing.reduction import ForkingPickler
    from pathlib import Path

    import httpx
    import torch
    from torch.multiprocessing import reductions

    found = importlib.util.find_spec("sglang")
    if found is None:
        # the device image has no SGLang (too large to carry); tests/unit/test_colocated_ipc.py checks the
        # same payload, built by SGLang's FlattenedTensorBucket, on CPU where SGLang's source is installed
        pytest.skip("needs SGLang's source (pip install --no-deps sglang) for its FlattenedTensorBucket")
    sglang_dir = Path(found.origin).parent
    names = ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.weight_sync"]
    added = [n for n in names if n not in sys.modules]
    for n in added:
        sys.modules[n] = types.ModuleType(n)
    bucket_name, patch_name = "sglang.srt.weight_sync.tensor_bucket", "sglang.srt.utils.patch_torch"
    spec = importlib.util.spec_from_file_location(
        bucket_name, sglang_dir / "srt" / "weight_sync" / "tensor_bucket.py"
    )
    tensor_bucket = importlib.util.module_from_spec(spec)
    sys.modules[bucket_name] = tensor_bucket
    patch = types.ModuleType(patch_name)  # only its name travels: the engine maps it onto its own rebuild

    def _rebuild_cuda_tensor_modified(*args):
        raise AssertionError("never called in the sender")

    _rebuild_cuda_tensor_modified.__module__ = patch_name
    _rebuild_cuda_tensor_modified.__qualname__ = "_rebuild_cuda_tensor_modified"
    patch._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified
    sys.modules[patch_name] = patch
    added += [bucket_name, patch_name]
    uuid = str(torch.cuda.get_device_properties(0).uuid)

    def reduce_like_sglang(t):
        fn, args = reductions.reduce_tensor(t)
        assert fn is reductions.rebuild_cuda_tensor
        return _rebuild_cuda_tensor_modified, (*args[:6], uuid, *args[7:])

    class SGLangPickler(ForkingPickler):
        _extra_reducers = {**ForkingPickler._extra_reducers, torch.Tensor: reduce_like_sglang}

    try:
        spec.loader.exec_module(tensor_bucket)
        gen = torch.Generator(device="cuda").manual_seed(0)
        named = [
            ("model.norm.weight", torch.randn(256, device="cuda", generator=gen).to(torch.bfloat16)),
            (
                "model.layers.1.mlp.down_proj.weight",
                torch.randn(256, 512, device="cuda", generator=gen).to(torch.bfloat16),
            ),
        ]
        sg = tensor_bucket.FlattenedTensorBucket(named_tensors=named)
        out = io.BytesIO()
        SGLangPickler(out).dump(
            {"flattened_tensor": sg.get_flattened_tensor(), "metadata": sg.get_metadata()}
        )
        torch.cuda.synchronize()
        body = {
            "serialized_named_tensors": [base64.b64encode(out.getvalue()).decode()],
            "load_format": "flattened_bucket",
            "flush_cache": True,
            "weight_version": "sglang-client",
        }
        resp = httpx.post(f"{colocated_engine.url}/update_weights_from_tensor", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        for name, t in named:
            held = httpx.post(
                f"{colocated_engine.url}/get_weights_by_name",
                json={"name": name, "truncate_size": t.shape[0]},
                timeout=60,
            ).json()
            assert torch.equal(torch.tensor(held, dtype=torch.float32), t.float().cpu()), name
    finally:
        for n in added:
            sys.modules.pop(n, None)

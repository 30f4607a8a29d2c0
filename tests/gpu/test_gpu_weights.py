"""weights_sync's mapping on CUDA: HF <-> megatron-core round trips, bitwise, and logits equal to transformers.

Two levels: the pure mapping (fuse/unfuse, TP split/merge, flattened buckets) on CUDA tensors in this
process, and real megatron-core models on CUDA loaded from and exported to HF checkpoints (child process,
since megatron's parallel state is process-wide).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

FAMILIES = ["qwen3", "qwen3_moe", "deepseek_v3"]
DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    from tidal.weights_sync.tiny_models import TINY, save_random_hf

    root = tmp_path_factory.mktemp("hf")
    return {family: save_random_hf(TINY[family], root / family, seed=7) for family in FAMILIES}


@pytest.fixture(scope="module")
def megatron_runs(child, checkpoints, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron")
    return child("child_weights.py", str(out), *map(str, checkpoints.values()), timeout_s=300)


def _record(megatron_runs, family: str, dtype: str) -> dict:
    import torch

    run = megatron_runs[f"{family}_{dtype}"]
    assert run["not_loaded"] == [], "checkpoint tensors with no place in the megatron-core model"
    return torch.load(run["file"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_model_on_cuda_exports_the_loaded_checkpoint_bitwise(megatron_runs, family, dtype):
    import torch

    record = _record(megatron_runs, family, dtype)
    assert record["param_device"] == "cuda" and record["export_devices"] == ["cuda"]
    source, exported = record["source"], record["exported"]
    assert sorted(exported) == sorted(source)
    # values bit for bit (a bf16 value widened to fp32 and narrowed back is the same bits)
    differ = [n for n in source if not torch.equal(source[n], exported[n].to(source[n].dtype))]
    assert differ == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_export_keeps_the_checkpoint_dtype(megatron_runs, family, dtype):
    import torch

    record = _record(megatron_runs, family, dtype)

    def expected(name: str) -> torch.dtype:
        # DeepSeek-V3's router correction bias stays fp32: megatron-core keeps the expert bias in fp32 by
        # design (its updates are tiny); everything else keeps the checkpoint dtype
        return torch.float32 if name.endswith("e_score_correction_bias") else getattr(torch, dtype)

    wrong = sorted(n for n, t in record["exported"].items() if t.dtype != expected(n))
    assert wrong == []


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_logits_on_cuda_equal_transformers(megatron_runs, family):
    import torch

    record = _record(megatron_runs, family, "float32")
    # fp32 on CUDA (TF32 off, torch's default for matmuls): assert_close's fp32 tolerances
    torch.testing.assert_close(record["megatron_logits"], record["transformers_logits"])
    assert record["transformers_logits"].std() > 1e-3, "logits near constant: the comparison has no power"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_mapping_and_tp_sharding_round_trip_on_cuda(checkpoints, family, dtype):
    import torch

    from tidal.weights_sync import hf_io
    from tidal.weights_sync.families import mapping_for
    from tidal.weights_sync.sharding import merge, split

    model = hf_io.load_config(checkpoints[family])
    mapping = mapping_for(model, padded_vocab_size=model.vocab_size + 28)  # vocab padding trimmed on export
    hf = {n: t.to("cuda", getattr(torch, dtype)) for n, t in hf_io.load_tensors(checkpoints[family]).items()}
    back = {}
    for name, full in mapping.to_megatron(hf):
        assert full.is_cuda, name
        shard = mapping.rule_for(name).rule.shard
        full = merge(split(full, shard, 2), shard)  # as two tensor-parallel ranks would hold it
        back.update(mapping.to_hf(name, full))
    assert sorted(back) == sorted(hf)
    assert [n for n in hf if not torch.equal(hf[n], back[n])] == []


def test_flattened_buckets_round_trip_on_cuda(checkpoints):
    import torch

    from tidal.weights_sync import bucket, hf_io

    tensors = hf_io.load_tensors(checkpoints["qwen3_moe"])
    named = [
        (n, t.to("cuda", torch.bfloat16 if i % 2 else torch.float32))
        for i, (n, t) in enumerate(tensors.items())
    ]
    buckets = bucket.plan_buckets(named, bucket_bytes=64 * 1024)
    assert len(buckets) > 2 and all(len({t.dtype for _, t in b}) == 1 for b in buckets)
    seen = {}
    for items in buckets:
        buf, spec = bucket.pack(items)
        assert buf.is_cuda
        seen.update(bucket.unpack(buf.clone(), spec))
    assert sorted(seen) == sorted(n for n, _ in named)
    assert all(torch.equal(seen[n], t) for n, t in named)

"""Qwen3.5, GLM-5 and Kimi K2.6 megatron-core models on CPU against transformers, from one random checkpoint.

One child process (megatron's parallel state is process-wide) loads a random Hugging Face checkpoint of each
tiny preset (configs/tiny/) into tidal's megatron-core model through the weight mapping, exports it back,
and compares logits with transformers' in fp32, for a batch and for two sequences packed in one THD row.

Qwen3.5's Gated DeltaNet runs flash-linear-attention's Triton kernels, which have no CPU path. Here, and
only here, they are replaced by torch reference implementations of the same three functions (``l2norm``,
``causal_conv1d``, ``chunk_gated_delta_rule``; the last is megatron-core's own torch version, applied per
packed sequence). The GPU test (tests/gpu/test_gpu_qwen3_5.py) runs the real kernels. The trainer itself
refuses the family on CPU, which is checked too.

Kimi K2.6 (DeepSeek-V3 architecture) checks the MLA details both MLA families share: the routed
experts' weights scaled by ``routed_scaling_factor`` and the latent norms at transformers' eps.

GLM-5 runs megatron-core's DSA modules as they are: its indexer keeps ``index_topk`` = 8 of the up to 28
previous tokens, so the batch comparison covers the sparse selection. The packed comparison keeps the rows
that see at most ``index_topk`` tokens (all of them selected): with random tiny weights many keys score
exactly 0 after the indexer's ReLU, and which of several equal scores a top-k keeps is up to the
implementation -- megatron-core's multi-sequence THD path breaks those ties differently (measured: a
single packed sequence equals the unpacked run bitwise; with two, only rows past position 8 differ, each
at a tie or near-tie of the 8th score).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = (20, 28)
PRESETS = ("qwen3_5_35b_a3b", "glm_5_1", "kimi_k2_6")
# fp32 on both sides; the implementations sum in different orders (fused q/k/v, absorbed MLA, chunked
# delta rule), which moves the last bits of the logits
FP32_RTOL = 1e-5

_CHILD = textwrap.dedent(
    """
    import json, sys, tempfile
    import torch, torch.nn.functional as F, yaml

    from tidal.model_config import ModelConfig
    from tidal.trainer import models, parallel
    from tidal.trainer.mesh import MeshConfig
    from tidal.weights_sync import hf_io
    from tidal.weights_sync.families import mapping_for
    from tidal.weights_sync.gather import Groups, iter_hf, load_hf_into_chunks
    from tidal.weights_sync.tiny_models import save_random_hf

    ROOT, LENGTHS = sys.argv[1], (20, 28)

    # ---- torch stand-ins for flash-linear-attention's kernels (CPU only, see the test's docstring)
    def _segments(total, cu_seqlens):
        if cu_seqlens is None:
            return [(0, total)]
        cu = cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))

    def l2norm(x, dim=-1, eps=1e-6):
        return x * torch.rsqrt((x * x).sum(dim, keepdim=True) + eps)

    def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, **unused):
        out = torch.empty_like(x)
        for start, end in _segments(x.shape[1], cu_seqlens):
            seg = x[:, start:end].transpose(1, 2)
            y = F.conv1d(seg, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=seg.shape[1])
            out[:, start:end] = F.silu(y[..., : end - start]).transpose(1, 2)
        return out, None

    def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, use_qk_l2norm_in_kernel=False, **unused):
        from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule as rule

        parts = [rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
                 for s, e in _segments(q.shape[1], cu_seqlens)]
        return torch.cat(parts, dim=1), None

    from megatron.core.ssm.gated_delta_net import common, gdn
    common.HAVE_FLA, common.l2norm = True, l2norm
    gdn.causal_conv1d, gdn.chunk_gated_delta_rule = causal_conv1d, chunk_gated_delta_rule

    def error(got, want):
        return float((got - want).abs().max() / want.abs().max())

    def refusal(model, mesh, training):
        try:
            models.transformer_config(model, mesh, training=training)
        except ValueError as e:
            return str(e)
        return None

    def check(preset):
        with open(f"{ROOT}/configs/tiny/{preset}.yaml") as f:
            spec = ModelConfig(**yaml.safe_load(f)["model"])
        directory = save_random_hf(spec, tempfile.mkdtemp(), seed=0)
        model = hf_io.load_config(directory)
        hf = hf_io.load_tensors(directory)
        mesh = MeshConfig()
        parallel.init_parallel(mesh, model, seed=0)
        tconfig = models.transformer_config(model, mesh, training=False)
        chunks = models.build_model(model, tconfig, seed=1)
        mapping = mapping_for(model)
        loaded = load_hf_into_chunks(chunks, hf, mapping, Groups.from_megatron())
        exported = dict(iter_hf(chunks, mapping, Groups.from_megatron()))

        from megatron.core.packed_seq_params import PackedSeqParams
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        ids = torch.randint(0, model.vocab_size, (2, max(LENGTHS)), generator=torch.Generator().manual_seed(0))
        seqs = [ids[i, :n] for i, n in enumerate(LENGTHS)]
        cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
        batch = ids[:, : min(LENGTHS)]
        with torch.no_grad():
            batch_error = error(
                chunks[0](batch, torch.arange(batch.shape[1])[None].expand_as(batch), None), ref(batch).logits
            )
            packed = chunks[0](torch.cat(seqs)[None], torch.cat([torch.arange(n) for n in LENGTHS])[None], None,
                               packed_seq_params=params)[0]
            want = torch.cat([ref(s[None]).logits[0] for s in seqs])
            if model.family == "glm_moe_dsa":
                # rows that see at most index_topk tokens (see the test's docstring: ties in the top-k)
                dense = torch.cat([torch.arange(n) for n in LENGTHS]) < model.index_topk
                packed, want = packed[dense], want[dense]
            packed_error = error(packed, want)
        result = dict(
            family=model.family,
            config_round_trip=model.model_copy(update={"path": None}) == spec,
            names=sorted(n for n, _ in chunks[0].named_parameters()),
            not_loaded=sorted({n for n, _ in mapping.to_megatron(hf)} - loaded),
            export_bitwise=sorted(exported) == sorted(hf) and all(torch.equal(exported[n], hf[n]) for n in hf),
            batch_error=batch_error,
            packed_error=packed_error,
            train_refusal=refusal(model, mesh, True),
            tp2_refusal=refusal(model, MeshConfig(tp=2), True),
        )
        parallel.shutdown()
        return result

    results = {preset: check(preset) for preset in sys.argv[2:]}
    with open(f"{ROOT}/configs/tiny/deepseek_v4_flash.yaml") as f:
        v4 = ModelConfig(**yaml.safe_load(f)["model"])
    results["deepseek_v4_refusal"] = refusal(v4, MeshConfig(), True)
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def results() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT), *PRESETS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("preset", PRESETS)
def test_checkpoint_loads_exports_bitwise_and_keeps_its_config(results, preset):
    result = results[preset]
    assert result["config_round_trip"], "the config must come back from the Hugging Face directory"
    assert result["not_loaded"] == []
    assert result["export_bitwise"]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", ["batch", "packed"])
def test_logits_match_transformers(results, preset, layout):
    assert results[preset][f"{layout}_error"] < FP32_RTOL, results[preset]


def test_qwen3_5_layers_follow_the_hybrid_pattern(results):
    names = results["qwen3_5_35b_a3b"]["names"]
    # full_attention_interval 4: layers 0-2 Gated DeltaNet, layer 3 gated attention; MoE with a gated
    # shared expert everywhere
    for layer in range(3):
        assert f"decoder.layers.{layer}.self_attention.A_log" in names
        assert f"decoder.layers.{layer}.self_attention.linear_qkv.weight" not in names
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in names
    assert "decoder.layers.3.self_attention.A_log" not in names
    assert all(f"decoder.layers.{layer}.mlp.shared_experts.gate_weight" in names for layer in range(4))


def test_qwen3_5_training_is_refused_on_cpu_with_the_reason(results):
    message = results["qwen3_5_35b_a3b"]["train_refusal"]
    assert message is not None
    assert "model.family=qwen3_5_moe cannot train on CPU" in message
    assert "flash-linear-attention" in message and "CUDA GPU" in message
    assert "tp=2" in results["qwen3_5_35b_a3b"]["tp2_refusal"]


def test_glm5_has_the_dsa_indexer_in_every_layer_and_trains_on_cpu(results):
    result = results["glm_5_1"]
    names = result["names"]
    for layer in range(4):
        assert f"decoder.layers.{layer}.self_attention.core_attention.indexer.linear_wq_b.weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names  # the dense leading layer
    assert "decoder.layers.1.mlp.router.expert_bias" not in names  # a buffer, not a parameter
    assert result["train_refusal"] is None
    assert "Transformer Engine" in result["tp2_refusal"]


def test_deepseek_v4_training_is_refused_naming_what_is_missing(results):
    message = results["deepseek_v4_refusal"]
    assert message is not None and message.startswith("model.family=deepseek_v4 cannot be trained")
    assert "hyper-connections" in message and "compressed sparse attention" in message

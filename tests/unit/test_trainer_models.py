"""The megatron-core model builder on CPU, single process.

Each case runs in a child process: megatron's parallel state and the CPU support module are process-wide
and must not leak into other tests of the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tidal.trainer.models import global_param_name

FAMILIES = {
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v3": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_shared_experts=1,
        first_k_dense_replace=1,
    ),
}

_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from tidal.model_config import ModelConfig
    from tidal.trainer import models, parallel
    from tidal.trainer.mesh import MeshConfig

    def check(extra):
        model = ModelConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128, **extra)
        mesh = MeshConfig()
        parallel.init_parallel(mesh, model, seed=0)
        tconfig = models.transformer_config(model, mesh)
        net = models.build_model(model, tconfig, seed=3)[0]
        again = models.build_model(model, tconfig, seed=3)[0]
        other = models.build_model(model, tconfig, seed=4)[0]
        params = dict(net.named_parameters())
        same_seed = all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in params.items())
        other_seed = {n for n, p in other.named_parameters() if not torch.equal(p, params[n])}
        ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
        pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        packed_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                        max_seqlen_q=7, max_seqlen_kv=7)
        with torch.no_grad():
            packed = net(ids, pos, None, packed_seq_params=packed_params)
            apart = torch.cat([net(ids[:, :5], pos[:, :5], None), net(ids[:, 5:], pos[:, 5:], None)], dim=1)
        return dict(
            names=sorted(params), same_seed=same_seed, differ=sorted(other_seed),
            packed_vs_apart=float((packed - apart).abs().max()), logits_shape=list(packed.shape),
            expert_bias=sorted(n for n, _ in net.named_buffers() if n.endswith("expert_bias")),
        )

    cases = json.loads(sys.argv[1])
    result = {family: check(extra) for family, extra in cases.items()}
    from tidal.trainer import cpu_support
    on_cpu = torch.zeros(2, device="cuda")
    result["cpu_support"] = dict(
        enabled=cpu_support.enabled(), device=str(on_cpu.device), moved=str(on_cpu.cuda().device),
        type_string=on_cpu.type(), current_device=str(torch.cuda.current_device()),
    )
    with cpu_support.cuda_device_ordinals():
        result["cpu_support"]["ordinal_device"] = str(torch.device(f"cuda:{torch.cuda.current_device()}"))
    result["cpu_support"]["device_after_ordinals"] = str(torch.cuda.current_device())
    import torch.distributed as dist
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buffers
    gathered = torch.zeros(4)
    with fsdp_buffers._coalescing_manager(dist.group.WORLD, async_ops=True) as manager:
        dist.all_gather_into_tensor(gathered, torch.ones(4), async_op=True)
    result["cpu_support"]["fsdp_gather_done_at_exit"] = gathered.tolist() == [1.0] * 4
    result["cpu_support"]["fsdp_gathers_left_pending"] = len(manager.works)
    # gloo's threads must stop before the interpreter does: left to exit, one was now and then destroyed
    # while joinable and the child aborted after its work ("terminate called without an active exception")
    parallel.shutdown()
    print(json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def built() -> dict:
    cases = {family: dict(family=family, **extra) for family, extra in FAMILIES.items()}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_builds_seeded_and_packs_sequences(built, family):
    result = built[family]
    assert result["logits_shape"] == [1, 12, 64]
    assert result["same_seed"], "the same seed must give the same model"
    matrices = [n for n in result["names"] if not n.endswith("layernorm.weight") and "norm" not in n]
    assert set(matrices) <= set(result["differ"]), "a different seed must change every weight matrix"
    # two sequences packed in one THD row attend only within themselves
    assert result["packed_vs_apart"] < 1e-5
    if family == "deepseek_v3":
        assert any("linear_kv_down_proj" in n for n in result["names"])
        assert any("shared_experts" in n for n in result["names"])
        assert not any(n.startswith("decoder.layers.0.mlp.router") for n in result["names"])
        # aux-loss-free balancing: the MoE layer's router carries the expert bias (HF e_score_correction_bias)
        assert result["expert_bias"] == ["decoder.layers.1.mlp.router.expert_bias"]
    else:
        assert result["expert_bias"] == []
    if family == "qwen3":
        assert any("q_layernorm" in n for n in result["names"])


def test_global_param_name_undoes_pipeline_and_expert_offsets():
    assert (
        global_param_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 2, 4)
        == "decoder.layers.2.mlp.experts.5.linear_fc1.weight"
    )
    assert global_param_name("module.embedding.word_embeddings.weight", 3, 0) == (
        "embedding.word_embeddings.weight"
    )
    assert global_param_name("decoder.final_layernorm.weight", 1, 0) == "decoder.final_layernorm.weight"


def test_cpu_support_redirects_cuda_calls_on_a_host_without_cuda(built):
    # (this machine has no CUDA; on a CUDA host enable() is a no-op and this path is never taken)
    assert built["cpu_support"] == dict(
        enabled=True,
        device="cpu",
        moved="cpu",
        type_string="torch.cuda.FloatTensor",
        current_device="cpu",
        # Megatron-FSDP formats device strings from current_device() while it is built
        ordinal_device="cuda:0",
        device_after_ordinals="cpu",
        # Megatron-FSDP's asynchronous coalesced all-gathers complete before their block exits on gloo
        fsdp_gather_done_at_exit=True,
        fsdp_gathers_left_pending=0,
    )

"""Small parts of the embedded engine and its client: parameter parsing, weight names, versions, launcher."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tidal.model_config import ModelConfig
from tidal.rollout.config import SGLangEngineConfig
from tidal.rollout.embedded.model import NamedTensorLoader, WeightLoadError, build_model
from tidal.rollout.embedded.sampling import SamplingError, SamplingParams, sample
from tidal.rollout.embedded.scheduler import version_spans
from tidal.rollout.embedded.testing import tiny_config
from tidal.rollout.engine import token_versions
from tidal.rollout.http_client import parse_version
from tidal.rollout.sglang_launcher import sglang_command

SGLANG = Path(importlib.util.find_spec("sglang").origin).parent


def test_sampling_params_defaults_and_errors_name_the_key():
    p = SamplingParams.from_json({"temperature": 0, "top_k": 1000, "stop_token_ids": [3]}, vocab_size=64)
    assert p.greedy and p.top_k == -1 and p.stop_token_ids == [3] and p.max_new_tokens == 128
    for bad, key in [
        ({"top_p": 0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": "8"}, "max_new_tokens"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
        ({"beam": 2}, "beam"),
    ]:
        with pytest.raises(SamplingError, match=key):
            SamplingParams.from_json(bad, vocab_size=64)


def test_version_spans_match_sglang_and_expand_per_token():
    # the expected spans follow sglang/srt/utils/weight_versions.py (its package cannot be imported here)
    events = [("1", 3), ("2", 5)]
    spans = version_spans(events, "3", 9)
    assert spans == [
        {"version": "1", "start": 0, "end": 3},
        {"version": "2", "start": 3, "end": 5},
        {"version": "3", "start": 5, "end": 9},
    ]
    assert version_spans([("1", 0), ("1", 2)], "1", 4) == [{"version": "1", "start": 0, "end": 4}]
    assert token_versions({"weight_versions": spans}, 9) == ["1"] * 3 + ["2"] * 2 + ["3"] * 4
    assert token_versions({"weight_version": "7"}, 2) == ["7", "7"]


def test_loader_maps_per_expert_checkpoint_names_onto_fused_experts():
    cfg = ModelConfig(
        family="qwen3_moe",
        vocab_size=32,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=3,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
    )
    lm = build_model(cfg, seed=0, device="cpu", dtype="float32")
    loader = NamedTensorLoader(lm)
    gate, up, down = torch.randn(8, 32), torch.randn(8, 32), torch.randn(32, 8)
    loader.load(
        [
            ("model.layers.1.mlp.experts.2.gate_proj.weight", gate),
            ("model.layers.1.mlp.experts.2.up_proj.weight", up),
            ("model.layers.1.mlp.experts.2.down_proj.weight", down),
        ]
    )
    experts = lm.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_proj[2], torch.cat([gate, up]))
    assert torch.equal(experts.down_proj[2], down)
    with pytest.raises(WeightLoadError, match="unknown parameter name 'model.layers.9.mlp.gate.weight'"):
        loader.load([("model.layers.9.mlp.gate.weight", torch.zeros(3, 32))])
    before = lm.model.norm.weight.clone()
    with pytest.raises(WeightLoadError, match=r"shape mismatch for 'lm_head.weight': received \[2, 2\]"):
        loader.load([("model.norm.weight", torch.zeros(32)), ("lm_head.weight", torch.zeros(2, 2))])
    assert torch.equal(lm.model.norm.weight, before), "a rejected update must not be partly applied"


def test_sglang_command_uses_only_flags_sglang_defines():
    # sglang's ServerArgs fields, read by file path (its package cannot be imported here)
    spec = importlib.util.spec_from_file_location(
        "sgl_fields", SGLANG / "srt" / "arg_groups" / "field_order.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fields = set(module.POSITIONAL_FIELD_ORDER)
    cfg = SGLangEngineConfig(tp=2, ep=2, port=31000, extra_args=["--context-length", "4096"])
    cmd = sglang_command(cfg, "/models/qwen3")
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    flags = [tok for tok in cmd[3:] if tok.startswith("--")]
    assert flags and all(f[2:].replace("-", "_") in fields for f in flags), flags
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--port") + 1] == "31000"


def test_parse_version():
    assert parse_version("0.5.23") == (0, 5, 23)
    assert parse_version("v0.4.10.post2") == (0, 4, 10)
    assert parse_version("0.5.23") >= (0, 5, 23) > parse_version("0.5.9")
    assert parse_version("dev") is None


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (4, 1)])
def test_grouped_qkv_rows_give_transformers_logits_for_any_heads_per_group(heads, kv_heads):
    """The fused Q/K/V in megatron's grouped order, its output gathered back to q | k | v (qkv_order): the
    same logits as transformers' separate projections with one, four or all query heads per KV head."""
    cfg = tiny_config("qwen3", num_attention_heads=heads, num_key_value_heads=kv_heads)
    fused = build_model(cfg, seed=2, device="cpu", dtype="float32")
    plain = build_model(cfg, seed=2, device="cpu", dtype="float32", fuse=False)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)
    loader = NamedTensorLoader(fused)
    for part in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.1.self_attn.{part}.weight"
        assert torch.equal(loader.read(name), dict(plain.named_parameters())[name])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_fused_projections_match_unfused_model_and_see_every_weight_load(family):
    extra = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)
    cfg = ModelConfig(
        family=family,
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        **(extra if family == "qwen3_moe" else {}),
    )
    fused = build_model(cfg, seed=0, device="cpu", dtype="float32")
    plain = build_model(cfg, seed=0, device="cpu", dtype="float32", fuse=False)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert type(attn).__name__.startswith("Fused")
    # Qwen3-MoE's layers are all expert layers here (their experts are fused by transformers already)
    assert type(mlp).__name__.startswith("Fused") == (family == "qwen3")
    # in HF's shapes (the grouped q/k/v rows read out as 2-D)
    assert {k: v.shape for k, v in fused.state_dict().items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.allclose(fused(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)
        # a named update lands in the fused matrices (they share storage with the named weights)
        update = [("model.layers.0.self_attn.k_proj.weight", torch.randn(16, 32))]
        if family == "qwen3":
            update.append(("model.layers.0.mlp.up_proj.weight", torch.randn(48, 32)))
        NamedTensorLoader(fused).load(update)
        NamedTensorLoader(plain).load(update)
        # the fused rows lie in megatron's grouped order: per KV group (2) its q heads (2), k head, v head
        assert torch.equal(attn.qkv_weight.view(2, 4, 8, 32)[:, 2].reshape(16, 32), update[0][1])
        assert torch.equal(
            NamedTensorLoader(fused).read("model.layers.0.self_attn.k_proj.weight"), update[0][1]
        )
        if family == "qwen3":
            assert torch.equal(mlp.gate_up_weight[48:], update[1][1])
        assert torch.allclose(fused(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)


def test_a_batch_mixing_greedy_seeded_and_unseeded_rows_samples_each_row_its_own_way():
    vocab = 16
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[3, 9] = 60.0  # all the mass (at temperature 1) on one token: any draw picks it
    greedy = SamplingParams(temperature=0.0)
    plain = SamplingParams(temperature=1.0)
    seeded = SamplingParams(temperature=1.0, sampling_seed=5)
    params = [greedy, plain, seeded, plain, greedy]

    def run():
        gens = [None, None, torch.Generator().manual_seed(5), None, None]
        return sample(logits, params, gens)

    tokens, logprobs = run()
    assert tokens[0] == logits[0].argmax() and tokens[4] == logits[4].argmax()
    assert tokens[1] == 7 and tokens[3] == 9
    assert run()[0][2] == tokens[2]  # the seeded row draws the same token again
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs, expected)
    # every row sampled without a seed: one draw for the batch, each row from its own distribution
    tokens, _ = sample(logits[[1, 3]], [plain, plain], [None, None])
    assert tokens.tolist() == [7, 9]

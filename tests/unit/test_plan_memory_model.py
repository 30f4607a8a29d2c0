"""The memory model on small cases whose numbers can be checked by hand."""

import json
from pathlib import Path

import pytest

from tidal.config import RunConfig
from tidal.configio import load_config
from tidal.memory_measured import compare_with_measured, load_measured, write_peak
from tidal.memory_model import (
    BF16,
    FP32,
    estimate,
    in_flight_microbatches,
    layer_count,
    layer_params,
    parallelism,
    stage_layers,
    total_params,
)
from tidal.model_config import ModelConfig
from tidal.trainer.mesh import MeshConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY_CONFIGS = sorted((CONFIGS / "tiny").glob("*.yaml"))

# hidden 128, 4 heads of 32, 2 KV heads, MLP 256, vocab 512, 2 layers (ModelConfig's defaults)
DENSE = ModelConfig(family="qwen3")
# per layer: q 128*128 + k,v 2*128*64 + o 128*128 + qk-norm 2*32 + MLP 3*128*256 + two norms 2*128
DENSE_LAYER = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 2 * 32 + 3 * 128 * 256 + 2 * 128
DENSE_TOTAL = 2 * DENSE_LAYER + 512 * 128 + (512 * 128 + 128)  # + embedding, output layer and final norm


def test_dense_layer_and_model_parameters_by_hand():
    assert layer_params(DENSE, 0) == (DENSE_LAYER, 0)
    assert total_params(DENSE) == (DENSE_TOTAL, DENSE_TOTAL)


def test_moe_layer_splits_routed_experts_from_the_rest():
    model = ModelConfig(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    dense, experts = layer_params(model, 0)
    assert experts == 4 * 3 * 128 * 64
    attention_and_norms = DENSE_LAYER - 3 * 128 * 256
    assert dense == attention_and_norms + 4 * 128  # + the router
    total, active = total_params(model)
    assert total - active == 2 * (4 - 2) * 3 * 128 * 64  # two of four experts idle per token, per layer


@pytest.mark.parametrize("path", TINY_CONFIGS, ids=lambda p: p.stem)
def test_parameter_count_matches_the_transformers_model(path):
    """Every family's count equals the parameters of transformers' model built from the same config."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = load_config(RunConfig, path).model
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(model.to_hf_config())
    assert total_params(model)[0] == sum(p.numel() for p in hf.parameters())


def test_even_uneven_and_interleaved_stage_layers():
    assert stage_layers(MeshConfig(pp=2), 4) == [(0, 1), (2, 3)]
    assert stage_layers(MeshConfig(pp=4, last_stage_layers=10), 43) == [
        tuple(range(0, 11)),
        tuple(range(11, 22)),
        tuple(range(22, 33)),
        tuple(range(33, 43)),
    ]
    assert stage_layers(MeshConfig(pp=3, first_stage_layers=2, last_stage_layers=2), 8) == [
        (0, 1),
        (2, 3, 4, 5),
        (6, 7),
    ]
    # interleaved: chunk c of size 2 goes to rank c % pp
    assert stage_layers(MeshConfig(pp=2, vpp=2), 8) == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_in_flight_microbatches_follow_megatron_schedules():
    one_f_one_b = parallelism(MeshConfig(pp=4), 4, 8)
    assert [in_flight_microbatches(one_f_one_b, r) for r in range(4)] == [4, 3, 2, 1]
    # interleaved warm-up: 2*(pp-r-1) + (vpp-1)*pp chunks, plus the one being computed, each 1/vpp
    interleaved = parallelism(MeshConfig(pp=2, vpp=2), 2, 8)
    assert [in_flight_microbatches(interleaved, r) for r in range(2)] == [(4 + 1) / 2, (2 + 1) / 2]


def test_dist_opt_bytes_per_parameter_by_hand():
    p = parallelism(MeshConfig(), 2, DENSE.num_hidden_layers)  # dp=2
    stage = estimate(DENSE, p, "dist_opt", 1024).stages[0]
    assert stage.dense_params == DENSE_TOTAL
    assert stage.weights == BF16 * DENSE_TOTAL
    assert stage.grads == FP32 * DENSE_TOTAL
    assert stage.optimizer == (4 + 4 + 4) * DENSE_TOTAL / 2  # fp32 master, two fp32 moments, sharded
    fp32 = estimate(DENSE, p, "dist_opt", 1024, bf16=False).stages[0]
    assert fp32.weights == FP32 * DENSE_TOTAL  # fp32 weights are their own master copy
    assert fp32.optimizer == (4 + 4) * DENSE_TOTAL / 2
    # the same kept tensors at twice the bytes (fp32 on CUDA runs the reference attention, as on CPU)
    fp32_counts = [layer_count(DENSE, i, "cuda", bf16=False) for i in range(DENSE.num_hidden_layers)]
    as_bf16 = estimate(DENSE, p, "dist_opt", 1024, fp32_counts).stages[0]
    assert fp32.activations == 2 * as_bf16.activations
    # in bf16 the varlen flash kernel keeps less than the reference (no K/V repeat, no copies)
    assert stage.activations < as_bf16.activations


def test_fsdp2_shards_everything_but_two_layers():
    p = parallelism(MeshConfig(), 4, DENSE.num_hidden_layers)  # dp=4
    stage = estimate(DENSE, p, "fsdp2", 1024).stages[0]
    sharded = DENSE_TOTAL / 4
    assert stage.weights == FP32 * sharded + BF16 * 2 * DENSE_LAYER
    assert stage.grads == FP32 * sharded + FP32 * 2 * DENSE_LAYER
    assert stage.optimizer == 8 * sharded


def test_tensor_and_expert_parallel_split_the_parameters():
    model = ModelConfig(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    counts = [layer_count(model, i) for i in range(2)]
    p = parallelism(MeshConfig(tp=2, ep=4), 8, 2)
    stage = estimate(model, p, "dist_opt", 1024, counts).stages[0]
    dense = sum(c.dense_params for c in counts) + 512 * 128 + 512 * 128 + 128
    assert stage.dense_params == dense / 2
    assert stage.expert_params == 2 * 8 * 3 * 128 * 64 / 4


def test_activations_scale_with_tokens_and_split_over_cp_and_tp():
    def act(mesh, world, tokens):
        s = estimate(DENSE, parallelism(mesh, world, 2), "dist_opt", tokens).stages[0]
        return s.activations, s.logits

    base, base_logits = act(MeshConfig(), 1, 2048)
    assert act(MeshConfig(), 1, 4096)[0] == pytest.approx(2 * base)
    assert act(MeshConfig(cp=2), 2, 2048)[0] == pytest.approx(base / 2)
    assert act(MeshConfig(tp=2, sequence_parallel=True), 2, 2048)[0] == pytest.approx(base / 2)
    # final norm (input, fp32 1/rms) and the output layer's input, then over the vocabulary (fused
    # logprobs): the bf16 logits and their bf16 gradient, and two fp32 row chunks of 1024 tokens
    assert base_logits == ((128 + 2) + 128) * BF16 * 2048 + 2 * BF16 * 512 * 2048 + 2 * FP32 * 512 * 1024


def test_full_recompute_keeps_layer_inputs_and_one_layer():
    p = parallelism(MeshConfig(pp=2), 2, 2)
    counts = [layer_count(DENSE, i) for i in range(2)]
    first = estimate(DENSE, p, "dist_opt", 1000, counts).stages[0]
    assert first.in_flight == 2 and first.layers == (0,)
    sent = 128 * BF16 * 1000  # the stage output the schedule keeps per in-flight micro-batch
    received = 128 * BF16 * 1000  # the gradient from the next stage, held through a backward
    # a dense layer has no transient peak: after the forward, the received gradient
    assert first.activations == 2 * (counts[0].dense_act * 1000 + sent) + received
    assert (
        first.activations_recompute == 2 * (128 * BF16 * 1000 + sent) + received + counts[0].dense_act * 1000
    )


MOE = ModelConfig(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


def test_moe_layers_keep_grouped_experts_tensors_and_peak_on_three_routed_copies():
    count = layer_count(MOE, 0)
    # per routed copy: the expert's input (128), fc1's output (2 x 64), silu(gate), the product, the
    # product scaled by the probability (64 each), and the fp32 probability (2 bf16 units)
    assert count.expert_act == BF16 * 2 * (128 + 5 * 64 + 2)
    # the permuted tokens, the experts' output, the copy sorted back: three routed hidden states
    assert count.transient_act == BF16 * 3 * 2 * 128
    assert layer_count(DENSE, 0).transient_act == 0


def test_moe_first_stage_with_recompute_holds_one_layer_its_transient_and_the_received_gradient():
    tokens = 1000
    counts = [layer_count(MOE, i) for i in range(2)]
    # the experts' weights, stacked by GroupedExperts while the layer runs (not kept: backward restacks)
    stacked = BF16 * 4 * 3 * 128 * 64
    layer = (counts[0].dense_act + counts[0].expert_act) * tokens
    transient = counts[0].transient_act * tokens + stacked
    hidden = 128 * BF16 * tokens
    first = estimate(MOE, parallelism(MeshConfig(pp=2), 2, 2), "dist_opt", tokens, counts).stages[0]
    assert first.activations_recompute == 2 * (hidden + hidden) + hidden + layer + transient
    # without recompute: both micro-batches kept, then the last layer's transient peak (> the gradient)
    assert first.activations == 2 * (layer + hidden) + transient
    # with EP the all-to-all's output is one more routed copy at the peak
    ep2 = estimate(MOE, parallelism(MeshConfig(pp=2, ep=2), 4, 2), "dist_opt", tokens, counts).stages[0]
    routed_copy = BF16 * 2 * 128 * tokens
    assert ep2.activations_recompute == first.activations_recompute - stacked / 2 + routed_copy


def test_last_stage_recompute_peaks_on_the_logits_or_one_layer_not_both():
    tokens = 1000
    counts = [layer_count(MOE, i) for i in range(2)]
    last = estimate(MOE, parallelism(MeshConfig(), 1, 2), "dist_opt", tokens, counts).stages[0]
    stacked = BF16 * 4 * 3 * 128 * 64
    layer = (counts[0].dense_act + counts[0].expert_act + counts[0].transient_act) * tokens + stacked
    inputs = 2 * 128 * BF16 * tokens
    assert last.total_recompute == last.static + inputs + max(layer, last.logits)


def test_compare_with_measured_reads_peak_memory_json(tmp_path):
    p = parallelism(MeshConfig(pp=2), 2, 2)
    est = estimate(DENSE, p, "dist_opt", 1000)
    path = tmp_path / "peak_memory.json"
    measured_0 = int(est.stages[0].total * 1.25)
    path.write_text(
        json.dumps(
            {
                "ranks": [
                    {"rank": 0, "pp_rank": 0, "peak_bytes": measured_0},
                    {"rank": 1, "pp_rank": 1, "peak_bytes": 10},
                    {"rank": 2, "pp_rank": 1, "peak_bytes": int(est.stages[1].total)},
                ]
            }
        )
    )
    measured = load_measured(path)
    assert measured == {0: measured_0, 1: int(est.stages[1].total)}
    rows = compare_with_measured(est, measured, recompute=False)
    assert rows[0][0] == 0 and rows[0][3] == pytest.approx(1 / 1.25 - 1, abs=1e-6)
    assert rows[1][3] == pytest.approx(0, abs=1e-6)


def test_load_measured_names_the_expected_format(tmp_path):
    path = tmp_path / "peak.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="peak_bytes"):
        load_measured(path)


def test_ranks_write_their_peaks_and_the_plan_reads_a_run_directory(tmp_path):
    write_peak(tmp_path, rank=0, pp_rank=0, peak_bytes=100)
    write_peak(tmp_path, rank=1, pp_rank=0, peak_bytes=300)
    write_peak(tmp_path, rank=2, pp_rank=1, peak_bytes=200)
    assert load_measured(tmp_path) == {0: 300, 1: 200}
    assert load_measured(tmp_path / "peak_memory") == {0: 300, 1: 200}

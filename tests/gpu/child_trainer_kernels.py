"""The trainer's CUDA kernels against their reference paths in bf16; print JSON (errors and timings).

    python child_trainer_kernels.py

Errors are measured against an fp32 computation of the same (bf16-rounded) inputs, for the fast path and
for the reference path run in bf16, so the test can require the fast path to be as accurate as the path
it replaces. Timings (forward + backward, medians) are reported, never asserted.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from tidal.model_config import ModelConfig
from tidal.trainer import models, parallel
from tidal.trainer.attention import (
    PackedCoreAttention,
    cp_token_positions,
    cp_varlen_layout,
    flash_varlen,
    varlen_reference,
)
from tidal.trainer.config import KernelConfig
from tidal.trainer.experts import grouped_linear
from tidal.trainer.fused_logprobs import vocab_parallel_logprobs
from tidal.trainer.mesh import MeshConfig

DEV = torch.device("cuda")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def timed(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def qkv(lengths, heads=16, groups=8, dim=128, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    t = sum(lengths)
    return [
        torch.randn(t, h, dim, generator=gen, device=DEV, dtype=torch.bfloat16)
        for h in (heads, groups, groups)
    ]


def grads_of(out_fn, inputs, weights):
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = out_fn(*inputs)
    grads = torch.autograd.grad((out.float() * weights).sum(), inputs)
    return out.detach(), grads


def attention_checks() -> dict:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    lengths = [1, 17, 300, 1024, 7, 2048]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q, k, v = qkv(lengths)
    scale = 128**-0.5
    weights = torch.randn(q.shape[0], 16, 128, device=DEV)
    attn = PackedCoreAttention(
        TransformerConfig(num_layers=1, hidden_size=2048, num_attention_heads=16, num_query_groups=8),
        1,
        AttnMaskType.causal,
        "self",
    ).eval()
    longest = max(lengths)
    ref, ref_g = grads_of(
        lambda a, b, c: varlen_reference(a, b, c, cu, cu, longest, longest, scale),
        [x.float() for x in (q, k, v)],
        weights,
    )
    fast, fast_g = grads_of(
        lambda a, b, c: flash_varlen(a, b, c, cu, cu, longest, longest, scale), [q, k, v], weights
    )
    sdpa, sdpa_g = grads_of(
        lambda a, b, c: attn._per_sequence(a, b, c, cu.cpu().long()).view(a.shape), [q, k, v], weights
    )
    out = {
        "flash_err": max([rel_err(fast, ref)] + [rel_err(g, r) for g, r in zip(fast_g, ref_g, strict=True)]),
        "sdpa_bf16_err": max(
            [rel_err(sdpa, ref)] + [rel_err(g, r) for g, r in zip(sdpa_g, ref_g, strict=True)]
        ),
    }

    # fixed-length batches under kernel=auto: one batched SDPA call (cuDNN or flash, torch's choice)
    from megatron.core.packed_seq_params import PackedSeqParams

    fixed = [1024, 1024, 1024]
    cu_fixed = torch.tensor([0, 1024, 2048, 3072], dtype=torch.int32, device=DEV)
    qf, kf, vf = qkv(fixed, seed=3)
    fixed_params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_fixed, cu_seqlens_kv=cu_fixed, max_seqlen_q=1024, max_seqlen_kv=1024
    )
    wf = torch.randn(qf.shape[0], 16 * 128, device=DEV)
    ref_f, ref_fg = grads_of(
        lambda a, b, c: varlen_reference(a, b, c, cu_fixed, cu_fixed, 1024, 1024, scale).reshape(
            a.shape[0], -1
        ),
        [x.float() for x in (qf, kf, vf)],
        wf,
    )
    auto_f, auto_fg = grads_of(
        lambda a, b, c: attn(a, b, c, None, packed_seq_params=fixed_params), [qf, kf, vf], wf
    )
    out["batched_sdpa_err"] = max(
        [rel_err(auto_f, ref_f)] + [rel_err(g, r) for g, r in zip(auto_fg, ref_fg, strict=True)]
    )

    # context parallel (cp=2): each rank's chunk problems through the real kernel (bottom-right causal)
    cp_err = 0.0
    cu_cpu = cu.cpu().long()
    even = [2 * 2 * n for n in (3, 50, 256)]  # multiples of 2*cp
    cu_even = torch.tensor([0, *torch.tensor(even).cumsum(0).tolist()], dtype=torch.int32)
    q2, k2, v2 = qkv(even, seed=1)
    full = varlen_reference(*(x.float() for x in (q2, k2, v2)), cu_even.to(DEV), cu_even.to(DEV), 0, 0, scale)
    for rank in range(2):
        pos = cp_token_positions(cu_even.long(), 2, rank).to(DEV)
        cu_q, key_pos, cu_k, max_q, max_k = cp_varlen_layout(cu_even.long(), 2, rank)
        key_pos = key_pos.to(DEV)
        got = flash_varlen(q2[pos], k2[key_pos], v2[key_pos], cu_q.to(DEV), cu_k.to(DEV), max_q, max_k, scale)
        cp_err = max(cp_err, rel_err(got, full[pos]))
    out["flash_cp_err"] = cp_err
    del cu_cpu

    # timing at the dense benchmark's shape: 2 x 4096 tokens, 16 query / 8 key heads of 128
    big = [4096, 4096]
    cu_big = torch.tensor([0, 4096, 8192], dtype=torch.int32, device=DEV)
    qb, kb, vb = (x.requires_grad_() for x in qkv(big, seed=2))
    gb = torch.randn(8192, 16, 128, device=DEV, dtype=torch.bfloat16)

    def step(fn):
        return lambda: torch.autograd.grad(fn(), (qb, kb, vb), gb)

    out["ms_fwd_bwd_2x4096"] = {
        "flash_varlen": timed(step(lambda: flash_varlen(qb, kb, vb, cu_big, cu_big, 4096, 4096, scale))),
        "batched_sdpa": timed(step(lambda: attn._batched_sdpa(qb, kb, vb, 2).view(qb.shape))),
        "sdpa_per_length": timed(
            step(lambda: attn._per_sequence(qb, kb, vb, cu_big.cpu().long()).view(qb.shape))
        ),
    }
    return out


def experts_timing() -> dict:
    """One MoE layer's expert GEMMs at moe-small's shape (8192 tokens x top-4, 32 experts, 1024 -> 768)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    experts, hidden, ffn, rows = 32, 1024, 768, 8192 * 4
    counts = torch.multinomial(
        torch.ones(experts, device=DEV), rows, replacement=True, generator=gen
    ).bincount(minlength=experts)
    x = torch.randn(rows, hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w1 = torch.randn(experts, 2 * ffn, hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    offsets = counts.cumsum(0).to(torch.int32)
    counts_list = counts.tolist()
    grad = torch.randn(rows, 2 * ffn, device=DEV, dtype=torch.bfloat16)

    def step(use_kernel):
        return lambda: torch.autograd.grad(
            grouped_linear(x, w1, offsets, counts_list, use_kernel), (x, w1), grad
        )

    got = grouped_linear(x, w1, offsets, counts_list, True)
    ref = grouped_linear(x.float(), w1.float(), offsets, counts_list, False)
    loop = grouped_linear(x, w1, offsets, counts_list, False)
    return {
        "grouped_mm_err": rel_err(got, ref),
        "loop_bf16_err": rel_err(loop, ref),
        "ms_fc1_fwd_bwd": {"grouped_mm": timed(step(True)), "loop": timed(step(False))},
    }


SHAPE = dict(
    vocab_size=1024,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
)


def build(model: ModelConfig, bf16: bool, kernels: KernelConfig, weights_from=None):
    tconfig = models.transformer_config(model, MeshConfig(), bf16=bf16)
    net = models.build_model(model, tconfig, seed=5, kernels=kernels)[0]
    if weights_from is not None:  # fp32 copy of the bf16 model's (rounded) weights
        with torch.no_grad():
            for (name, p), (other, q) in zip(
                net.named_parameters(), weights_from.named_parameters(), strict=True
            ):
                assert name == other, (name, other)
                p.copy_(q.float())
    return net


def grad_err(got: dict, ref: dict) -> float:
    return max(rel_err(got[n], ref[n]) for n in ref)


def dense_model_checks() -> dict:
    """qwen3 through megatron-core in bf16: flash attention + fused logprobs vs SDPA + plain logprobs."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model = ModelConfig(family="qwen3", **SHAPE)
    parallel.init_parallel(MeshConfig(), model, seed=0)
    lengths = [37, 256, 5, 700]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (1, total), device=DEV, generator=gen)
    labels = torch.randint(0, model.vocab_size, (total,), device=DEV, generator=gen)
    pos = torch.cat([torch.arange(n, device=DEV) for n in lengths])[None]
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )

    def run(net, logprobs: str):
        logits = net(ids, pos, None, packed_seq_params=params).reshape(total, -1)
        if logprobs == "fused":
            lp, ent = vocab_parallel_logprobs(logits, labels, with_entropy=True)
        else:
            logp = torch.log_softmax(logits.float(), -1)
            lp, ent = logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return lp.detach(), {n: p.grad.detach().float().clone() for n, p in net.named_parameters()}

    reference = KernelConfig(attention="sdpa", logprobs="reference")
    ref_net = build(model, True, reference)
    ref_lp, ref_grads = run(ref_net, "reference")
    fast_lp, fast_grads = run(
        build(model, True, KernelConfig(attention="flash_varlen", logprobs="fused")), "fused"
    )
    exact_lp, exact_grads = run(build(model, False, reference, weights_from=ref_net), "reference")
    return {
        "fast_err": max(rel_err(fast_lp, exact_lp), grad_err(fast_grads, exact_grads)),
        "reference_bf16_err": max(rel_err(ref_lp, exact_lp), grad_err(ref_grads, exact_grads)),
    }


def moe_expert_checks() -> dict:
    """One layer's experts fed the same permuted tokens (no router: no top-k flips between precisions):
    GroupedExperts with torch._grouped_mm vs SequentialMLP, both bf16, against SequentialMLP in fp32."""
    model = ModelConfig(
        family="qwen3_moe", **SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128
    )
    parallel.init_parallel(MeshConfig(), model, seed=0)
    sequential = build(model, True, KernelConfig(experts="sequential"))
    grouped = build(model, True, KernelConfig(experts="grouped_mm"))
    exact = build(model, False, KernelConfig(experts="sequential"), weights_from=sequential)
    gen = torch.Generator(device=DEV).manual_seed(3)
    counts = torch.tensor([40, 0, 7, 300, 1, 64, 0, 100], device=DEV)  # empty experts included
    x = torch.randn(int(counts.sum()), model.hidden_size, device=DEV, generator=gen)
    probs = torch.rand(x.shape[0], device=DEV, generator=gen)
    weights = torch.randn(x.shape, device=DEV, generator=gen)

    def run(net, dtype):
        experts = net.decoder.layers[0].mlp.experts
        inp = x.to(dtype).requires_grad_()
        out, _ = experts(inp, counts, probs)
        (out.float() * weights).sum().backward()
        grads = {n: p.grad.float().clone() for n, p in experts.named_parameters()}
        grads["input"] = inp.grad.float()
        return type(experts).__name__, out.detach(), grads

    ref_kind, ref_out, ref_grads = run(sequential, torch.bfloat16)
    fast_kind, fast_out, fast_grads = run(grouped, torch.bfloat16)
    _, exact_out, exact_grads = run(exact, torch.float32)
    return {
        "kinds": {"reference": ref_kind, "fast": fast_kind},
        "empty_expert_grad_max": max(
            fast_grads[f"local_experts.{e}.linear_fc{i}.weight"].abs().max().item()
            for e in (1, 6)
            for i in (1, 2)
        ),
        "fast_err": max(rel_err(fast_out, exact_out), grad_err(fast_grads, exact_grads)),
        "reference_bf16_err": max(rel_err(ref_out, exact_out), grad_err(ref_grads, exact_grads)),
    }


def sft_minibatch(model: ModelConfig):
    """A fixed synthetic minibatch (8 groups of 4, up to 2,048 tokens) and its SFT loss."""
    from tidal.trainer.config import LossConfig
    from tidal.trainer.synthetic import make_loss, plan, synthetic_groups

    groups = synthetic_groups(
        vocab_size=model.vocab_size,
        groups=8,
        group_size=4,
        prompt_len=(16, 48),
        response_len=(16, 96),
        seed=0,
    )
    minibatch = plan(groups, dp_size=1, max_tokens=2048, pad_multiple=8)
    return minibatch, make_loss("sft", LossConfig(kind="sft"), minibatch.normalizer, 0)


def train_step_checks() -> dict:
    """Two train steps with the default kernels: torch's fused Adam is switched on, no host sync per tensor.
    Then a checkpoint, loaded into a fresh model and optimizer, takes the third step as the first run does
    (a resume on a GPU used to fail: the restored Adam step counts were on the CPU, which fused Adam refuses)."""
    import tempfile

    from tidal.trainer import checkpoint
    from tidal.trainer.config import OptimizerConfig
    from tidal.trainer.fused_optim import _torch_optimizers
    from tidal.trainer.optimizer import build_train_state
    from tidal.trainer.step import train_step

    model = ModelConfig(family="qwen3", **SHAPE)
    parallel.init_parallel(MeshConfig(), model, seed=0)
    tconfig = models.transformer_config(model, MeshConfig(), bf16=True)
    optimizer = OptimizerConfig(lr=1e-3, clip_grad=1.0)
    state = build_train_state(models.build_model(model, tconfig, seed=1), tconfig, optimizer, total_steps=4)
    minibatch, loss_fn = sft_minibatch(model)
    losses = [train_step(state, minibatch.micro_batches(0), loss_fn).loss for _ in range(2)]
    fused = [bool(g["fused"]) for opt in _torch_optimizers(state.optimizer) for g in opt.param_groups]
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint.save(state, tmp, checkpoint.Progress(step=2))
        continued = [train_step(state, minibatch.micro_batches(0), loss_fn).loss for _ in range(2)]
        fresh = build_train_state(
            models.build_model(model, tconfig, seed=2), tconfig, optimizer, total_steps=4
        )
        progress = checkpoint.load(fresh, path)
        resumed = [train_step(fresh, minibatch.micro_batches(0), loss_fn).loss for _ in range(2)]
    steps = {
        str(st["step"].device) if torch.is_tensor(st["step"]) else "number"
        for opt in _torch_optimizers(fresh.optimizer)
        for st in opt.state.values()
    }
    return {
        "losses": losses,
        "adam_groups_fused": fused,
        "resumed_at": progress.step,
        "continued": continued,
        "resumed": resumed,
        "resumed_fused": [
            bool(g["fused"]) for opt in _torch_optimizers(fresh.optimizer) for g in opt.param_groups
        ],
        "resumed_step_devices": sorted(steps),
    }


def three_steps(model: ModelConfig, kernels: KernelConfig) -> dict:
    """Three train steps of ``model`` (bf16, seed 1, the same minibatch each step) with ``kernels``; clip at
    0.05, far below the initial gradients' norm, so the clip coefficient is exercised."""
    from tidal.trainer.config import OptimizerConfig
    from tidal.trainer.optimizer import build_train_state
    from tidal.trainer.step import train_step

    parallel.init_parallel(MeshConfig(), model, seed=0)
    minibatch, loss_fn = sft_minibatch(model)
    tconfig = models.transformer_config(model, MeshConfig(), bf16=True)
    chunks = models.build_model(model, tconfig, seed=1, kernels=kernels)
    state = build_train_state(chunks, tconfig, OptimizerConfig(lr=1e-3, clip_grad=0.05), total_steps=3)
    before = torch.cat([p.detach().float().flatten() for p in chunks[0].parameters()])
    results = [train_step(state, minibatch.micro_batches(0), loss_fn) for _ in range(3)]
    after = torch.cat([p.detach().float().flatten() for p in chunks[0].parameters()])
    return {
        "losses": [r.loss for r in results],
        "grad_norms": [r.grad_norm for r in results],
        "update": after - before,
        "device_step": getattr(state, "_tidal_device_step", None) is not None,
        "fusion": bool(tconfig.gradient_accumulation_fusion),
    }


def compare_runs(got: dict, ref: dict) -> dict:
    """How far ``got``'s three steps are from ``ref``'s (relative update error: |update - reference| /
    |reference update| over all parameters)."""
    return {
        "first_loss_equal": got["losses"][0] == ref["losses"][0],
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True)),
        "grad_norm_rel_steps": [
            abs(a - b) / b for a, b in zip(got["grad_norms"], ref["grad_norms"], strict=True)
        ],
        "update_rel": ((got["update"] - ref["update"]).norm() / ref["update"].norm()).item(),
        "device_step": got["device_step"],
        "fusion": got["fusion"],
    }


def device_step_checks() -> dict:
    """The fused grad scale (normalisation x clip applied inside fused Adam) and the accumulating
    weight-gradient product against megatron's own path, from the same initial model."""
    model = ModelConfig(family="qwen3", **SHAPE)
    megatron = three_steps(model, KernelConfig(grad_scale="megatron", wgrad="megatron"))
    scaled = three_steps(model, KernelConfig(grad_scale="fused", wgrad="megatron"))
    fused = three_steps(model, KernelConfig(grad_scale="fused", wgrad="accumulate"))
    return {
        "reference": {
            "grad_norms": megatron["grad_norms"],
            "device_step": megatron["device_step"],
            "fusion": megatron["fusion"],
            "clip": 0.05,
        },
        "grad_scale": compare_runs(scaled, megatron),
        "grad_scale_and_wgrad": compare_runs(fused, megatron),
    }


def moe_permute_checks() -> dict:
    """An MoE's train steps with the gather-based token permutation against megatron's scatter-add one."""
    model = ModelConfig(
        family="qwen3_moe", **SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128
    )
    from tidal.trainer import moe_permute

    megatron = three_steps(model, KernelConfig(moe_permute="megatron"))
    gather = three_steps(model, KernelConfig(moe_permute="gather"))
    result = compare_runs(gather, megatron)
    result["mode_after"] = moe_permute._state["mode"]
    return result


def main() -> None:
    results = {
        "device_step": device_step_checks(),
        "moe_permute": moe_permute_checks(),
        "attention": attention_checks(),
        "experts": experts_timing(),
        "dense_model": dense_model_checks(),
        "moe_experts": moe_expert_checks(),
        "train_step": train_step_checks(),
    }
    parallel.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main()

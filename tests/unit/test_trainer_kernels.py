"""The trainer's fast paths against their references on CPU: fused logprobs, varlen attention bookkeeping
(context parallel included), grouped experts.

The CUDA kernels themselves (torch's varlen flash attention, ``torch._grouped_mm`` on sm90) cannot run here:
where a test needs one, its CPU stand-in is named (``varlen_reference`` for the flash kernel; torch's own CPU
``_grouped_mm``); tests/gpu/test_gpu_trainer_kernels.py compares the real kernels in bf16 on the GPU.
Model-level checks run in a child process: megatron's parallel state is process-wide.
"""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from tidal.trainer import attention as attention_module
from tidal.trainer.attention import (
    PackedCoreAttention,
    cp_token_positions,
    cp_varlen_layout,
    varlen_reference,
)
from tidal.trainer.experts import RestackInBackward, grouped_linear
from tidal.trainer.fused_logprobs import vocab_parallel_logprobs


def _plain_logprobs(logits, labels, temperature):
    z = logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.fixture
def uncompiled_chunk_fns(monkeypatch):
    """``impl="compiled"`` with the chunk functions run eagerly: their arithmetic, without a CPU compile
    (~30 s here); tests/gpu/test_gpu_trainer_kernels.py runs them compiled on CUDA."""
    from tidal.trainer import fused_logprobs

    monkeypatch.setattr(
        fused_logprobs,
        "_compiled_chunk_fns",
        lambda: (fused_logprobs._shard_stats, fused_logprobs._shard_grad),
    )


@pytest.mark.parametrize("impl", ["fused", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_and_entropy_match_log_softmax_values_and_gradients(
    dtype, temperature, impl, uncompiled_chunk_fns
):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 37, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 37, (10,), generator=gen)
    w_lp, w_h = torch.randn(10, generator=gen), torch.randn(10, generator=gen)

    lp, ent = vocab_parallel_logprobs(
        logits, labels, with_entropy=True, temperature=temperature, chunk_tokens=3, impl=impl
    )
    grad = torch.autograd.grad((lp * w_lp + ent * w_h).sum(), logits)[0]
    ref_lp, ref_ent = _plain_logprobs(logits, labels, temperature)
    ref_grad = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_h).sum(), logits)[0]

    assert lp.dtype == ent.dtype == torch.float32 and grad.dtype == dtype
    # fp32 arithmetic on the same inputs in a different order: rounding-level differences only
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    # the gradient is rounded once to the logits' dtype (bf16: 2**-8 relative)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", ["fused", "compiled"])
def test_fused_logprobs_without_entropy_and_bad_input(impl, uncompiled_chunk_fns):
    logits = torch.randn(4, 9, requires_grad=True)
    labels = torch.tensor([0, 8, 3, 3])
    lp, ent = vocab_parallel_logprobs(logits, labels, impl=impl)
    assert ent is None
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    ref_lp, _ = _plain_logprobs(logits, labels, 1.0)
    (ref_grad,) = torch.autograd.grad(ref_lp.sum(), logits)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="logits must be"):
        vocab_parallel_logprobs(logits[0], labels)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match="impl='triton' must be auto, compiled or fused"):
        vocab_parallel_logprobs(logits, labels, impl="triton")


def _qkv(lengths, heads=4, groups=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return (
        torch.randn(t, heads, dim, generator=gen).requires_grad_(),
        torch.randn(t, groups, dim, generator=gen).requires_grad_(),
        torch.randn(t, groups, dim, generator=gen).requires_grad_(),
    )


def _config() -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2)


def test_flash_path_bookkeeping_equals_the_per_sequence_reference():
    """cp=1: the flash path (kernel replaced by its SDPA reference) against the length-bucketed SDPA path."""
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self").eval()
    attn.varlen_kernel = varlen_reference
    lengths = [3, 5, 3, 1, 6]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv(lengths)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6
    )
    got = attn._forward_flash_thd(q, k, v, params)
    expected = attn._per_sequence(q, k, v, cu.long())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-5)


def test_varlen_reference_aligns_the_causal_diagonal_bottom_right():
    q, k, v = _qkv([2, 5])
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    out = varlen_reference(q[:2], k[:5], v[:5], cu_q, cu_k, 2, 5, 0.5)
    # the last query sees every key: plain (maskless) attention for that row
    kk, vv = k[:5].repeat_interleave(2, 1), v[:5].repeat_interleave(2, 1)
    last = torch.nn.functional.scaled_dot_product_attention(
        q[1:2].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), scale=0.5
    ).transpose(0, 1)
    torch.testing.assert_close(out[1:2], last, rtol=0, atol=1e-6)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_context_parallel_flash_path_equals_full_causal_attention(monkeypatch, cp_size):
    """Each CP rank's flash path (kernel: its SDPA reference; the all-gather: its result) against causal
    attention over the whole packed batch, read at that rank's positions; gradients included."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [4 * cp_size, 2 * cp_size, 6 * cp_size]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv(lengths, seed=1)
    attn = PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self").eval()
    attn.varlen_kernel = varlen_reference
    expected = attn._per_sequence(q, k, v, cu.long())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu)
    rank_positions = [cp_token_positions(cu.long(), cp_size, r) for r in range(cp_size)]

    gathered = {}  # id of a rank's local K or V -> what the all-gather returns: all ranks' rows, rank order
    monkeypatch.setattr(attention_module._GatherSeq, "apply", lambda local, group: gathered[id(local)])
    for rank in range(cp_size):
        monkeypatch.setattr(attention_module.dist, "get_world_size", lambda group=None: cp_size)
        monkeypatch.setattr(attention_module.dist, "get_rank", lambda group=None, r=rank: r)
        attn.cp_group = object()
        pos = rank_positions[rank]
        local_k, local_v = k[pos], v[pos]
        gathered[id(local_k)] = torch.cat([k[p] for p in rank_positions])
        gathered[id(local_v)] = torch.cat([v[p] for p in rank_positions])
        got = attn._forward_flash_thd(q[pos], local_k, local_v, params)
        torch.testing.assert_close(got, expected[pos], rtol=0, atol=1e-6)
        weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(rank))
        grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
        ref_grads = torch.autograd.grad((expected[pos] * weights).sum(), (q, k, v), retain_graph=True)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-5)


def test_cp_varlen_layout_gives_each_chunk_its_sequence_prefix():
    cu = torch.tensor([0, 8, 12], dtype=torch.long)  # cp=2: chunks of 2 and 1 tokens
    cu_q, keys, cu_k, max_q, max_k = cp_varlen_layout(cu, 2, 1)
    assert cu_q.tolist() == [0, 2, 4, 5, 6]
    assert cu_k.tolist() == [0, 4, 10, 12, 15]
    assert keys.tolist() == [0, 1, 2, 3] + list(range(6)) + [8, 9] + [8, 9, 10]
    assert (max_q, max_k) == (2, 6)
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        cp_varlen_layout(torch.tensor([0, 6]), 2, 0)


def test_flash_varlen_forced_off_cuda_says_why():
    attn = PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self", kernel="flash_varlen")
    q, k, v = _qkv([4])
    with pytest.raises(ValueError, match="flash_varlen cannot run here: tensors are on cpu"):
        attn._use_flash(q, k, v)
    assert not PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self")._use_flash(q, k, v)
    with pytest.raises(ValueError, match="trainer.kernels.attention='fast'"):
        PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self", kernel="fast")


def test_torch_grouped_mm_call_equals_the_expert_loop():
    """The kernel path's call convention (weights [G, out, in] transposed, int32 group ends, empty groups)
    checked with torch's CPU implementation of ``_grouped_mm`` against the loop."""
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 8]
    x = torch.randn(sum(counts), 16, generator=gen, requires_grad=True)
    w = torch.randn(4, 24, 16, generator=gen, requires_grad=True)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = grouped_linear(x, w, offsets, None, use_kernel=True)
    expected = grouped_linear(x, w, None, counts, use_kernel=False)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    weights = torch.randn(got.shape, generator=gen)
    grads = torch.autograd.grad((got * weights).sum(), (x, w))
    ref = torch.autograd.grad((expected * weights).sum(), (x, w))
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(grads[1][1]) == 0  # the empty group's weight gets no gradient


_CHILD = textwrap.dedent(
    """
    import json, torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from tidal.model_config import ModelConfig
    from tidal.trainer import attention, experts, models, parallel
    from tidal.trainer.config import KernelConfig
    from tidal.trainer.mesh import MeshConfig

    model = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    mesh = MeshConfig()
    parallel.init_parallel(mesh, model, seed=0)
    tconfig = models.transformer_config(model, mesh)
    lengths = [5, 9, 2, 16]
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=16, max_seqlen_kv=16)

    def run(kernels, force=None):
        net = models.build_model(model, tconfig, seed=3, kernels=kernels)[0]
        for module in net.modules():
            if force == "flash" and isinstance(module, attention.PackedCoreAttention):
                module.varlen_kernel = attention.varlen_reference  # CPU stand-in for the CUDA kernel
                module._use_flash = lambda *a: True
        logits = net(ids, pos, None, packed_seq_params=params)
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
        (logits * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        kinds = sorted({type(m).__name__ for m in net.modules() if "MLP" in type(m).__name__ or "Experts" in type(m).__name__})
        return logits.detach(), grads, kinds

    def rel(a, b):
        return ((a - b).abs().max() / a.abs().max().clamp(min=1e-30)).item()

    def diff(a, b):  # the largest difference relative to the tensor's own scale, logits and every gradient
        la, ga, _ = a
        lb, gb, _ = b
        assert ga.keys() == gb.keys()
        return max([rel(la, lb)] + [rel(ga[n], gb[n]) for n in ga])

    from tidal.trainer import pointwise
    # the experts' MLP (SequentialMLP's and ours: weighted by their routing probabilities), RoPE
    pointwise_calls = {"weighted_bias_swiglu_impl": 0, "rotate": 0}
    for name in pointwise_calls:
        def counting(*args, _f=getattr(pointwise, name), _n=name):
            pointwise_calls[_n] += 1
            return _f(*args)
        setattr(pointwise, name, counting)

    sequential = run(KernelConfig(experts="sequential", attention="sdpa"))
    loop = run(KernelConfig(experts="loop", attention="sdpa"))
    experts.grouped_mm_unsupported = lambda *a: None  # torch's CPU _grouped_mm stands in for the CUDA kernel
    grouped = run(KernelConfig(experts="auto", attention="sdpa"))
    flash = run(KernelConfig(experts="sequential", attention="auto"), force="flash")
    print(json.dumps(dict(
        kinds={"sequential": sequential[2], "loop": loop[2]},
        names_equal=sorted(sequential[1]) == sorted(loop[1]),
        loop=diff(sequential, loop), grouped=diff(sequential, grouped), flash=diff(sequential, flash),
        pointwise_calls=pointwise_calls,
    )))
    parallel.shutdown()
    """
)


@pytest.fixture(scope="module")
def model_level() -> dict:  # ~15 s: megatron's import and three small models in a child process
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_grouped_experts_keep_sequential_mlp_parameters_and_results(model_level):
    assert "GroupedExperts" in model_level["kinds"]["loop"], model_level["kinds"]
    assert "SequentialMLP" in model_level["kinds"]["sequential"], model_level["kinds"]
    assert model_level["names_equal"]
    # fp32, the same matmuls per expert: equal up to summation order in the backward
    assert model_level["loop"] <= 1e-5, model_level
    assert model_level["grouped"] <= 1e-5, model_level


@pytest.mark.slow
def test_model_with_flash_path_equals_model_with_sdpa_path(model_level):
    assert model_level["flash"] <= 1e-5, model_level


@pytest.mark.slow
def test_models_route_swiglu_and_rotary_through_the_pointwise_module(model_level):
    # megatron's MLP (SequentialMLP's experts), GroupedExperts, and the THD RoPE
    assert all(n > 0 for n in model_level["pointwise_calls"].values()), model_level["pointwise_calls"]


def test_foreach_optimizer_helpers_compute_what_megatrons_fallbacks_compute():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from tidal.trainer import fused_optim

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for n in (5, 300, 1, 64)]
    norm, _ = fused_optim.foreach_l2_norm(0, None, [tensors], False)
    expected = torch.norm(torch.tensor([torch.norm(t).item() for t in tensors]))  # megatron's local formula
    torch.testing.assert_close(norm, expected.reshape(1), rtol=1e-6, atol=0)

    dst = [torch.empty_like(t) for t in tensors]
    fused_optim.foreach_scale(0, None, [tensors, dst], 0.25)
    assert all(torch.equal(d, t * 0.25) for d, t in zip(dst, tensors, strict=True))
    fused_optim.foreach_scale(0, None, [dst, dst], 4.0)
    assert all(torch.equal(d, t) for d, t in zip(dst, tensors, strict=True))

    original = clip_grads.l2_norm_impl
    try:
        assert fused_optim.install(True)  # no Apex / TE here: megatron runs on its local fallbacks
        assert clip_grads.l2_norm_impl is fused_optim.foreach_l2_norm
        fused_optim.install(False)
        assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    finally:
        clip_grads.l2_norm_impl = original


def test_fused_adam_is_left_alone_off_cuda():
    from tidal.trainer import fused_optim

    class _Megatron:  # megatron's optimizer wrapper holds the torch optimizer as .optimizer
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])

    assert fused_optim.use_fused_adam(_Megatron()) == 0
    assert not _Megatron.optimizer.param_groups[0]["fused"]


_TP_CHILD = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from tidal.trainer import fused_logprobs
    from tidal.trainer.fused_logprobs import vocab_parallel_logprobs

    rank, port, impl = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    # "compiled" with the chunk functions run eagerly (their arithmetic; CUDA compiles them: GPU suite)
    fused_logprobs._compiled_chunk_fns = lambda: (fused_logprobs._shard_stats, fused_logprobs._shard_grad)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 24, generator=gen) * 4
    labels = torch.randint(0, 24, (7,), generator=gen)
    w_lp, w_h = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    shard = logits[:, 12 * rank : 12 * (rank + 1)].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(shard, labels, with_entropy=True, temperature=0.8, chunk_tokens=3,
                                      group=dist.group.WORLD, vocab_start=12 * rank, impl=impl)
    (grad,) = torch.autograd.grad((lp * w_lp + ent * w_h).sum(), shard)
    full = logits.clone().requires_grad_()
    logp = torch.log_softmax(full / 0.8, -1)
    ref_lp = logp.gather(-1, labels[:, None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_grad,) = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_h).sum(), full)
    ref_grad = ref_grad[:, 12 * rank : 12 * (rank + 1)]
    print(json.dumps({"lp": (lp - ref_lp).abs().max().item(), "ent": (ent - ref_ent).abs().max().item(),
                      "grad": (grad - ref_grad).abs().max().item()}))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["fused", "compiled"])
def test_fused_logprobs_over_a_tensor_parallel_vocabulary_match_the_whole_vocabulary(impl):
    """Two gloo processes, each holding half the vocabulary (what TP=2 gives the loss)."""
    from tidal.procs import free_port

    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TP_CHILD, str(rank), port, impl],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        errors = json.loads(out.strip().splitlines()[-1])
        assert errors["lp"] <= 1e-5 and errors["ent"] <= 1e-5 and errors["grad"] <= 1e-6, errors


def test_equal_length_batches_are_recognised_from_shapes_alone():
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = PackedCoreAttention(_config(), 1, AttnMaskType.causal, "self")
    q = torch.zeros(12, 4, 8)

    def params(cu, longest):
        cu = torch.tensor(cu, dtype=torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest)

    assert attn._equal_length_count(q, params([0, 4, 8, 12], 4)) == 3
    assert attn._equal_length_count(q, params([0, 3, 8, 12], 5)) is None
    assert attn._equal_length_count(q, params([0, 4, 8, 12], None)) is None
    lengths = [4, 4, 4]
    q, k, v = _qkv(lengths)
    got = attn.eval()._batched_sdpa(q, k, v, 3)
    torch.testing.assert_close(got, attn._forward_thd(q, k, v, params([0, 4, 8, 12], 4)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_stacked_expert_weights_are_not_kept_for_backward_and_gradients_are_unchanged(use_kernel):
    """GroupedExperts' saved-tensor hooks: the stacked copy of the experts' weights dies after the forward
    (the products keep the parameters instead and restack them in backward); gradients are bitwise those of
    the products that keep the stack. ``use_kernel`` runs torch's CPU ``_grouped_mm``."""
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 8]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32) if use_kernel else None
    params = [torch.randn(24, 16, generator=gen, requires_grad=True) for _ in counts]
    x = torch.randn(sum(counts), 16, generator=gen, requires_grad=True)
    out_grad = torch.randn(sum(counts), 24, generator=gen)

    def forward(restack: bool):
        stacked = torch.stack(params)
        alive = weakref.ref(stacked)
        hooks = RestackInBackward([(stacked, params)]).hooks() if restack else contextlib.nullcontext()
        with hooks:
            y = grouped_linear(x, stacked, offsets, counts, use_kernel)
        del stacked
        gc.collect()
        return y, alive() is not None

    y_ref, kept_ref = forward(restack=False)
    grads_ref = torch.autograd.grad(y_ref, [x, *params], out_grad)
    y, kept = forward(restack=True)
    grads = torch.autograd.grad(y, [x, *params], out_grad)
    assert kept_ref and not kept  # without the hooks the products hold the stack; with them, nothing does
    assert torch.equal(y, y_ref)
    assert all(torch.equal(g, r) for g, r in zip(grads, grads_ref, strict=True))

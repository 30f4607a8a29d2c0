"""The trainer's torch.compile'd chains on CUDA against their eager versions, in bf16.

``trainer.kernels.logprobs=auto`` and ``trainer.kernels.pointwise=auto`` compile on CUDA for large tensors
(tidal.trainer.fused_logprobs, tidal.trainer.pointwise). Each error is the largest absolute difference from
an fp32 computation on the same bf16 inputs, over the fp32 result's largest magnitude, outputs and
gradients alike; the compiled path must be as accurate as the eager one (within 1.5x its error plus 1e-3:
the compiled kernel keeps intermediates in fp32 where eager rounds them to bf16, so it is usually closer).
These are pure functions: no megatron parallel state, so they run in the test process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

NO_WORSE = 1.5
SLACK = 1e-3


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def _errors(fn, inputs, ref_fn, weights_seed=1) -> float:
    """max error of ``fn`` (output and input gradients) against ``ref_fn`` on fp32 copies of ``inputs``."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    refs = [x.detach().float().requires_grad_(x.is_floating_point()) for x in inputs]
    out, ref = fn(*xs), ref_fn(*refs)
    w = torch.randn(
        ref.shape, device=ref.device, generator=torch.Generator(ref.device).manual_seed(weights_seed)
    )
    grads = torch.autograd.grad((out.float() * w).sum(), [x for x in xs if x.requires_grad])
    ref_grads = torch.autograd.grad((ref * w).sum(), [x for x in refs if x.requires_grad])
    return max([_err(out, ref)] + [_err(g, r) for g, r in zip(grads, ref_grads, strict=True)])


@pytest.mark.parametrize("chain", ["swiglu", "weighted_swiglu", "rotate", "rms_norm"])
def test_compiled_pointwise_chains_are_as_accurate_as_eager(chain):
    from tidal.trainer import pointwise

    gen = torch.Generator("cuda").manual_seed(0)
    tokens = 4096
    if chain == "swiglu":
        inputs = [torch.randn(tokens, 2 * 2048, device="cuda", generator=gen).bfloat16()]

        def ref(x):
            gate, up = torch.chunk(x, 2, dim=-1)
            return F.silu(gate) * up

        call = pointwise.swiglu
    elif chain == "weighted_swiglu":
        inputs = [
            torch.randn(tokens, 2 * 1024, device="cuda", generator=gen).bfloat16(),
            torch.rand(tokens, 1, device="cuda", generator=gen),
        ]

        def ref(x, probs):
            gate, up = torch.chunk(x, 2, dim=-1)
            return F.silu(gate) * up * probs

        def call(x, probs):
            return pointwise.weighted_bias_swiglu_impl(x, None, probs)
    elif chain == "rms_norm":
        inputs = [
            torch.randn(tokens, 1, 2048, device="cuda", generator=gen).bfloat16(),
            (torch.rand(2048, device="cuda", generator=gen) + 0.5).bfloat16(),
        ]

        def ref(x, weight):
            return F.rms_norm(x, (2048,), weight, 1e-6)

        def call(x, weight):
            return pointwise.rms_norm(x, weight, 1e-6, lambda t: F.rms_norm(t, (2048,), weight, 1e-6))
    else:
        angles = torch.rand(tokens, 1, 1, 128, device="cuda", generator=gen) * 6.3
        inputs = [
            torch.randn(tokens, 1, 16, 128, device="cuda", generator=gen).bfloat16(),
            torch.cos(angles).bfloat16(),
            torch.sin(angles).bfloat16(),
        ]

        def ref(t, cos_, sin_):
            return pointwise._rotate(t, cos_, sin_, False)

        def call(t, cos_, sin_):
            return pointwise.rotate(t, cos_, sin_, False)

    assert inputs[0].numel() >= pointwise.COMPILE_MIN_NUMEL
    try:
        pointwise.set_mode("eager")
        eager = _errors(call, inputs, ref)
        pointwise.set_mode("auto")
        assert pointwise.wants_compiled(inputs[0])
        compiled = _errors(call, inputs, ref)
    finally:
        pointwise.set_mode("auto")
    assert compiled <= NO_WORSE * eager + SLACK, (chain, compiled, eager)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_compiled_logprobs_are_as_accurate_as_the_eager_chunks(with_entropy, monkeypatch):
    from tidal.trainer import fused_logprobs

    used = []
    real = fused_logprobs._compiled_chunk_fns
    monkeypatch.setattr(fused_logprobs, "_compiled_chunk_fns", lambda: used.append(1) or real())
    gen = torch.Generator("cuda").manual_seed(0)
    tokens, vocab = 2500, 32768  # the last chunk is shorter: dynamic shapes
    logits = (torch.randn(tokens, vocab, device="cuda", generator=gen) * 3).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    w_lp = torch.randn(tokens, device="cuda", generator=gen)
    w_h = torch.randn(tokens, device="cuda", generator=gen)

    def run(impl):
        x = logits.clone().requires_grad_()
        lp, ent = fused_logprobs.vocab_parallel_logprobs(
            x, labels, with_entropy=with_entropy, temperature=0.7, chunk_tokens=1024, impl=impl
        )
        loss = (lp * w_lp).sum() + ((ent * w_h).sum() if with_entropy else 0.0)
        (grad,) = torch.autograd.grad(loss, x)
        return lp, ent, grad

    full = logits.float().requires_grad_()
    logp = torch.log_softmax(full / 0.7, dim=-1)
    ref_lp = logp.gather(-1, labels[:, None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    loss = (ref_lp * w_lp).sum() + ((ref_ent * w_h).sum() if with_entropy else 0.0)
    (ref_grad,) = torch.autograd.grad(loss, full)

    def error(result):
        lp, ent, grad = result
        errs = [_err(lp, ref_lp), _err(grad, ref_grad)]
        return max(errs + ([_err(ent, ref_ent)] if with_entropy else []))

    eager = error(run("fused"))
    assert not used
    compiled = error(run("auto"))  # CUDA, 1024 x 32768 logits per chunk: compiled
    assert used
    assert compiled <= NO_WORSE * eager + SLACK, (compiled, eager)
    assert compiled <= 1e-2, compiled

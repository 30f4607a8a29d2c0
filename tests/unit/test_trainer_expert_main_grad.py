"""GroupedExperts' stacked weights under megatron's DDP protocol: gradients added straight into main_grad."""

import pytest
import torch

from tidal.trainer import experts
from tidal.trainer.experts import RestackInBackward, grouped_linear, stack_weights

COUNTS = [3, 0, 5, 8, 2]


def _ddp_params(dtype: torch.dtype, with_main_grad: bool, seed: int = 0):
    """Expert weights as megatron's DDP leaves them: an fp32 ``main_grad`` each and a backward hook on the
    gradient accumulator that adds ``param.grad`` unless the layer already did (distributed_data_parallel.py)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(24, 16, generator=gen).to(dtype).requires_grad_() for _ in COUNTS]
    calls = []
    keep = []  # the accumulators must outlive the step, as megatron's grad_accs list keeps them
    for p in params:
        if not with_main_grad:
            continue
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
        acc = p.expand_as(p).grad_fn.next_functions[0][0]

        def hook(*_, p=p):
            calls.append(p)
            if p.grad is not None and not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad.data)
            p.grad = None

        acc.register_hook(hook)
        keep.append(acc)
    return params, calls, keep


def _micro_batches(dtype: torch.dtype, use_kernel: bool, stack, micro_batches: int = 2):
    params, calls, keep = _ddp_params(dtype, with_main_grad=True)
    gen = torch.Generator().manual_seed(1)
    offsets = torch.tensor(COUNTS).cumsum(0).to(torch.int32) if use_kernel else None
    for _ in range(micro_batches):
        x = torch.randn(sum(COUNTS), 16, generator=gen).to(dtype).requires_grad_()
        stacked = stack(params)
        with RestackInBackward([(stacked, params)]).hooks():
            y = grouped_linear(x, stacked, offsets, COUNTS, use_kernel)
        y.backward(torch.randn(y.shape, generator=gen).to(dtype))
    return params, calls, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_main_grads_equal_those_the_ddp_hooks_add(dtype, use_kernel, monkeypatch):
    """Two micro-batches: every expert's main_grad holds bitwise what DDP's per-parameter adds give; the
    hooks still run once per expert and micro-batch (they mark the buckets ready) and leave no grad behind.
    A tiny cast bound makes the backward add the experts in several pieces."""
    reference, ref_calls, ref_xgrad = _micro_batches(dtype, use_kernel, torch.stack)
    monkeypatch.setattr(experts, "MAIN_GRAD_CAST_ELEMENTS", 24 * 16 * 2)
    params, calls, xgrad = _micro_batches(dtype, use_kernel, stack_weights)
    for p, r in zip(params, reference, strict=True):
        assert torch.equal(p.main_grad, r.main_grad)
        assert p.grad is None
    assert len(calls) == len(ref_calls) == 2 * len(COUNTS)
    assert torch.equal(xgrad, ref_xgrad)
    assert any(p.main_grad.abs().sum() > 0 for p in params)


def test_weights_without_main_grad_get_plain_autograd_gradients():
    params, _, _ = _ddp_params(torch.float32, with_main_grad=False)
    assert not experts.adds_into_main_grad(params)
    stacked = stack_weights(params)
    assert stacked.grad_fn.name().startswith("Stack")
    stacked.sum().backward()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)


def test_mixed_main_grad_dtypes_or_a_missing_flag_keep_torch_stack():
    params, _, _ = _ddp_params(torch.float32, with_main_grad=True)
    assert experts.adds_into_main_grad(params)
    params[1].main_grad = params[1].main_grad.to(torch.bfloat16)
    assert not experts.adds_into_main_grad(params)
    params, _, _ = _ddp_params(torch.float32, with_main_grad=True)
    del params[0].grad_added_to_main_grad
    assert not experts.adds_into_main_grad(params)
    with torch.no_grad():
        assert stack_weights(params).grad_fn is None

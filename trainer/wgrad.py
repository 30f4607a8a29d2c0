"""megatron-core's gradient-accumulation fusion without Apex: weight gradients summed into ``main_grad``
by the matrix product itself.

Without the fusion megatron's linear layers compute each weight gradient as a bf16 tensor and the DDP hook
adds it to the fp32 ``main_grad`` (an extra read and write of every weight's gradient, ~6 ms of a 1.1B
model's step on the H200, and a bf16 rounding of the product). With it, ``linear_with_grad_accumulation``
calls ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output, main_grad)``, an Apex
extension that is not on our machines. :func:`install` puts these two functions in its place: the fp32
one is ``torch.addmm`` with an fp32 output dtype (cuBLAS accumulates the bf16 product into the fp32 buffer
in place, CUDA only), the fp16/bf16 one a plain in-place ``addmm_``.
"""

from __future__ import annotations

import sys
import types

import torch


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
    """``main_grad[out, in] += grad_output[t, out]^T @ total_input[t, in]`` with an fp32 ``main_grad``."""
    torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
    """The same with a ``main_grad`` of the inputs' dtype."""
    main_grad.addmm_(grad_output.t(), total_input)


def install() -> None:
    """Make megatron's linear layers accept ``gradient_accumulation_fusion=True``; idempotent."""
    from megatron.core.tensor_parallel import layers

    module = sys.modules.get("fused_weight_gradient_mlp_cuda")
    if module is None:
        module = types.ModuleType("fused_weight_gradient_mlp_cuda")
        module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
        module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
        sys.modules["fused_weight_gradient_mlp_cuda"] = module
    layers.fused_weight_gradient_mlp_cuda = module
    layers._grad_accum_fusion_available = True
    if not getattr(layers.linear_with_grad_accumulation_and_async_allreduce, "_tidal", False):
        layers.linear_with_grad_accumulation_and_async_allreduce = _only_with_main_grad(
            layers.linear_with_grad_accumulation_and_async_allreduce
        )


def _only_with_main_grad(linear):
    """megatron's linear function, with the fusion off for a weight that has no ``main_grad`` (a model used
    outside megatron's DDP wrapper: its backward would otherwise fail on ``main_grad.dtype``)."""

    def call(input, weight, *args, gradient_accumulation_fusion=False, **kwargs):
        if gradient_accumulation_fusion and getattr(weight, "main_grad", None) is None:
            gradient_accumulation_fusion = False
        return linear(
            input, weight, *args, gradient_accumulation_fusion=gradient_accumulation_fusion, **kwargs
        )

    call._tidal = True
    call.warned = getattr(linear, "warned", False)  # megatron's body reads and sets it on the global name
    return call


def wanted(setting: str, device: torch.device, params_dtype: torch.dtype) -> bool:
    """Whether ``trainer.kernels.wgrad=setting`` means the fused accumulation for this model."""
    if setting == "megatron":
        return False
    reason = None
    if device.type != "cuda":
        reason = f"the model is on {device.type} (the fp32-output product needs CUDA)"
    elif params_dtype not in (torch.bfloat16, torch.float16):
        reason = f"parameters are {params_dtype} (the fusion is for bf16/fp16 weights)"
    if reason is not None and setting == "accumulate":
        raise ValueError(f"trainer.kernels.wgrad=accumulate cannot run here: {reason}; use auto or megatron")
    return reason is None

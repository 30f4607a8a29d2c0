"""trainer/pointwise.py: the elementwise chains give megatron-core's values, and the model routes through them.

The compiled versions run on CUDA (tests/gpu/test_gpu_trainer_kernels.py); here the dispatch rules and the
eager arithmetic, which is what CPU runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from tidal.trainer import pointwise


@pytest.fixture(autouse=True)
def _restore_mode():
    before = pointwise.get_mode()
    yield
    pointwise.set_mode(before)


def test_swiglu_is_megatrons_gated_linear_unit():
    x = torch.randn(5, 3, 16, requires_grad=True)
    gate, up = torch.chunk(x, 2, dim=-1)
    torch.testing.assert_close(pointwise.swiglu(x), F.silu(gate) * up, rtol=0, atol=0)
    bias = torch.randn(16)
    torch.testing.assert_close(pointwise.bias_swiglu_impl(x, bias), pointwise.swiglu(x + bias))
    # an expert's MLP weighted by routing probabilities (fp32) returns the activations' dtype
    h = torch.randn(6, 16, dtype=torch.bfloat16)
    probs = torch.rand(6, 1)
    weighted = pointwise.weighted_bias_swiglu_impl(h, None, probs)
    g, u = torch.chunk(h, 2, dim=-1)
    assert weighted.dtype == torch.bfloat16
    torch.testing.assert_close(weighted, ((F.silu(g) * u) * probs).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotate_is_megatrons_bshd_rotation(interleaved):
    t = torch.randn(6, 1, 4, 8)
    freqs = torch.randn(6, 1, 1, 8)
    expected = _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    got = pointwise.rotate(t, torch.cos(freqs), torch.sin(freqs), interleaved)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_rms_norm_is_torchs_unless_compiled_and_its_arithmetic_matches(monkeypatch):
    x = torch.randn(7, 3, 32)
    weight = torch.rand(32) + 0.5
    eager = torch.nn.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        eager.weight.copy_(weight)
    pointwise.set_mode("auto")  # CPU: torch's own kernel
    assert torch.equal(pointwise.rms_norm(x, weight, 1e-6, eager), eager(x))
    monkeypatch.setattr(pointwise, "compiled", lambda fn: fn)  # the compiled function's arithmetic, eagerly
    pointwise.set_mode("compiled")
    torch.testing.assert_close(pointwise.rms_norm(x, weight, 1e-6, eager), eager(x), rtol=1e-6, atol=1e-6)


def test_compiled_only_where_it_pays_unless_asked():
    small, big_cpu = torch.zeros(8), torch.zeros(pointwise.COMPILE_MIN_NUMEL)
    pointwise.set_mode("auto")
    assert not pointwise.wants_compiled(small) and not pointwise.wants_compiled(big_cpu)  # CPU: eager
    pointwise.set_mode("compiled")
    assert pointwise.wants_compiled(small)
    pointwise.set_mode("eager")
    assert not pointwise.wants_compiled(big_cpu)
    with pytest.raises(ValueError, match="trainer.kernels.pointwise='fast': must be auto, compiled or eager"):
        pointwise.set_mode("fast")


def test_mode_compiled_routes_through_torch_compile(monkeypatch):
    calls = []

    def fake_compiled(fn):
        calls.append(fn.__name__)
        return fn

    monkeypatch.setattr(pointwise, "compiled", fake_compiled)
    pointwise.set_mode("compiled")
    x = torch.randn(2, 8)
    pointwise.swiglu(x)
    pointwise.rotate(x, x, x, False)
    assert calls == ["_swiglu", "_rotate"]

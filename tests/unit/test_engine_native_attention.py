"""The native CPU decode attention (rollout/embedded/native_attention.py) against PyTorch's arithmetic.

The kernel is compiled with the machine's C compiler on first use; where it cannot be built (no AVX2, no
compiler) these tests skip saying why, and the engine runs PyTorch's matmuls (covered by the engine tests
with ``cpu_attention="torch"``).
"""

from __future__ import annotations

import pytest
import torch

from tidal.rollout.embedded import native_attention
from tidal.rollout.embedded.kv_cache import KVPool
from tidal.rollout.embedded.lean import LeanDecoder
from tidal.rollout.embedded.model import build_model
from tidal.rollout.embedded.testing import tiny_config

KERNEL, HOW = native_attention.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"native decode attention unavailable: {HOW}")


def test_loading_the_kernel_leaves_the_processs_floating_point_mode_alone():
    # a library built with -ffast-math sets flush-to-zero / denormals-are-zero for the whole process when
    # it loads (hypothesis' float strategies then refuse to run, and every float op of the engine changes)
    tiny = 5e-324  # the smallest subnormal double
    assert tiny * 1.0 > 0.0
    assert float(torch.tensor([1e-40], dtype=torch.float32) * 1.0) > 0.0


def reference_attention(q, keys, values, lengths, scaling):
    """Plain PyTorch: each row's query heads over its first ``lengths[r]`` keys (GQA by repeating K/V)."""
    rows, heads, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(rows, heads * dim, dtype=torch.float64)
    for r in range(rows):
        n = int(lengths[r])
        k = keys[r, :, :n].double().repeat_interleave(group, dim=0)  # [heads, n, dim]
        v = values[r, :, :n].double().repeat_interleave(group, dim=0)
        probs = torch.softmax(torch.einsum("hd,hnd->hn", q[r].double(), k) * scaling, dim=-1)
        out[r] = torch.einsum("hn,hnd->hd", probs, v).reshape(-1)
    return out


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    # groups of 2, 1, 4, 2; 3 (no code of its own: one head at a time); 16 (two calls of eight heads)
    [(4, 2, 16), (4, 2, 32), (8, 8, 64), (8, 2, 128), (2, 1, 256), (6, 2, 32), (16, 1, 64)],
)
def test_native_decode_attention_matches_reference_for_any_row_lengths(heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(dim + heads)
    slots, max_len, rows = 6, 45, 5
    keys = torch.randn(slots, kv_heads, max_len, dim, generator=gen)
    values = torch.randn(slots, kv_heads, max_len, dim, generator=gen)
    # lengths below, at and above multiples of 8 (the kernel's key blocks), and a single key
    lengths = torch.tensor([1, 7, 8, 17, 45])
    # the query heads as the lean forward hands them: a slice of a wider per-row block (row stride > heads*dim)
    block = torch.randn(rows, heads + kv_heads, dim, generator=gen)
    q = block[:, :heads]
    attend = native_attention.NativeDecodeAttention(KERNEL, heads, kv_heads, dim, max_len, dim**-0.5)
    out = attend(q, keys, values, lengths)
    expected = reference_attention(q, keys, values, lengths, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_native_decode_attention_refuses_layouts_it_cannot_read():
    attend = native_attention.NativeDecodeAttention(KERNEL, 4, 2, 16, 8, 0.25)
    keys = torch.zeros(2, 2, 8, 16)
    with pytest.raises(ValueError, match="exceed the pool"):
        attend(torch.zeros(3, 4, 16), keys, keys, torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="layout"):
        attend(torch.zeros(2, 16, 4).transpose(1, 2), keys, keys, torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="head_dim 24"):
        native_attention.NativeDecodeAttention(KERNEL, 4, 2, 24, 8, 0.25)


def test_lean_decoder_says_which_attention_it_runs_and_refuses_native_where_it_cannot():
    fp32 = build_model(tiny_config("qwen3"), seed=3, device="cpu", dtype="float32")
    pool = KVPool(fp32.config.num_hidden_layers, 2, 16, "cpu")
    assert LeanDecoder(fp32, pool, cpu_attention="torch").attention == "torch (asked for)"
    auto = LeanDecoder(fp32, pool)
    assert auto.attention.startswith("native" if KERNEL is not None else "torch (")
    bf16 = build_model(tiny_config("qwen3"), seed=3, device="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="cpu_attention='native' is not available: .*fp32"):
        LeanDecoder(bf16, KVPool(2, 2, 16, "cpu"), cpu_attention="native")
    assert LeanDecoder(bf16, KVPool(2, 2, 16, "cpu")).attention.startswith(
        "torch (the native decode attention is fp32"
    )
    with pytest.raises(ValueError, match="choose one of"):
        LeanDecoder(fp32, pool, cpu_attention="fast")


@needs_kernel
def test_lean_step_with_native_attention_equals_the_torch_attention_step():
    """Rows at different positions (a masked step): the whole forward's logits agree to fp32 rounding."""
    lm = build_model(tiny_config("qwen3_moe"), seed=4, device="cpu", dtype="float32")
    logits = {}
    for attention in ("native", "torch"):
        pool = KVPool(lm.config.num_hidden_layers, 4, 32, "cpu")
        decoder = LeanDecoder(lm, pool, cpu_attention=attention)
        gen = torch.Generator().manual_seed(0)
        for layer in range(lm.config.num_hidden_layers):
            pool.keys[layer].copy_(torch.randn(pool.keys[layer].shape, generator=gen))
            pool.values[layer].copy_(torch.randn(pool.values[layer].shape, generator=gen))
        with torch.inference_mode():
            logits[attention] = decoder(torch.tensor([3, 9, 27]), torch.tensor([4, 20, 11]), 21, masked=True)
    torch.testing.assert_close(logits["native"], logits["torch"], atol=1e-5, rtol=0)

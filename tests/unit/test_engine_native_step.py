"""The native CPU step (rollout/embedded/native_step.py): one C call per decode or prefill step.

Checked against the lean forward's PyTorch ops (which the engine tests check against transformers): logits
and the keys and values written, for decode rows at different positions, prefill rows of several slots,
both families, and both builds (AVX-512 where the CPU has it, AVX2). The engine-level tests (greedy tokens
equal to transformers', logprobs within 1e-4) run with the native step in test_engine_generation.py and
test_engine_decode.py. Where the kernels cannot be built these tests skip saying why, and the engine runs
PyTorch's ops; the fallback itself is tested here by hiding the compiler.
"""

from __future__ import annotations

import pytest
import torch

from tidal.rollout.embedded import native_build, native_step
from tidal.rollout.embedded.kv_cache import KVPool
from tidal.rollout.embedded.lean import LeanDecoder
from tidal.rollout.embedded.model import build_model
from tidal.rollout.embedded.prefill import LeanPrefill
from tidal.rollout.embedded.testing import tiny_config

LIB, HOW = native_step.load()
needs_native = pytest.mark.skipif(LIB is None, reason=f"native step unavailable: {HOW}")
BUILDS = [
    pytest.param(
        isa, marks=pytest.mark.skipif(native_step.load(isa)[0] is None, reason=native_step.load(isa)[1])
    )
    for isa in ("avx512", "avx2")
]


def decoder_pair(family: str, seed: int, slots: int, max_len: int, isa: str | None = None, **shape):
    """Two lean decoders of one model over two pools filled with the same random cache: (native, torch)."""
    lm = build_model(tiny_config(family, **shape), seed=seed, device="cpu", dtype="float32")
    decoders = []
    for _ in range(2):
        pool = KVPool(lm.config.num_hidden_layers, slots, max_len, "cpu")
        decoders.append(LeanDecoder(lm, pool, cpu_step="torch", cpu_attention="torch"))
        gen = torch.Generator().manual_seed(seed)
        for layer in range(lm.config.num_hidden_layers):
            pool.keys[layer].copy_(torch.randn(pool.keys[layer].shape, generator=gen))
            pool.values[layer].copy_(torch.randn(pool.values[layer].shape, generator=gen))
    native, torch_ops = decoders
    lib, _ = native_step.load(isa)
    native.native_step = native_step.NativeStep(native, lib)
    return native, torch_ops


def assert_same_cache(a: LeanDecoder, b: LeanDecoder) -> None:
    for layer in range(len(a.layers)):
        torch.testing.assert_close(a.pool.keys[layer], b.pool.keys[layer], atol=5e-6, rtol=1e-5)
        torch.testing.assert_close(a.pool.values[layer], b.pool.values[layer], atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_native_decode_step_equals_the_pytorch_step(family, isa):
    """37 rows (a partial last vector of rows) at positions 0..30: the logits and the written keys and
    values agree with PyTorch's ops to fp32 rounding."""
    native, torch_ops = decoder_pair(family, seed=4, slots=40, max_len=32, isa=isa)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (37,), generator=gen)
    positions = torch.randint(0, 31, (37,), generator=gen)
    positions[0] = 0  # a row whose only key is its own
    with torch.inference_mode():
        got = native(ids, positions, int(positions.max()) + 1, masked=True)
        expected = torch_ops(ids, positions, int(positions.max()) + 1, masked=True)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    assert_same_cache(native, torch_ops)


@needs_native
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (4, 1)])
def test_native_step_reads_every_head_of_the_grouped_qkv_where_it_lies(heads, kv_heads):
    """The fused Q/K/V rows are in megatron's grouped order (fused.py): the native step finds each query,
    key and value head there (its own index arithmetic) as PyTorch's path does through ``qkv_order``, for
    one query head per KV head, four, and a single KV head."""
    native, torch_ops = decoder_pair(
        "qwen3", seed=6, slots=8, max_len=16, num_attention_heads=heads, num_key_value_heads=kv_heads
    )
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (8,), generator=gen)
    positions = torch.randint(0, 15, (8,), generator=gen)
    with torch.inference_mode():
        got = native(ids, positions, int(positions.max()) + 1, masked=True)
        expected = torch_ops(ids, positions, int(positions.max()) + 1, masked=True)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    assert_same_cache(native, torch_ops)


@needs_native
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_native_prefill_equals_the_pytorch_prefill(family):
    """Prompts of different lengths into slots out of order: the last tokens' logits and every prompt
    position's keys and values (the padding positions of PyTorch's padded prefill are not compared)."""
    native, torch_ops = decoder_pair(family, seed=5, slots=8, max_len=40)
    gen = torch.Generator().manual_seed(2)
    lengths, slots = [9, 33, 1, 20], [5, 0, 7, 2]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, 96, (n,), generator=gen)
    with torch.inference_mode():
        got = LeanPrefill(native)(ids, lengths, slots)
        expected = LeanPrefill(torch_ops)(ids, lengths, slots)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    for layer in range(len(native.layers)):
        for slot, n in zip(slots, lengths, strict=True):
            for buffers in ("keys", "values"):
                a = getattr(native.pool, buffers)[layer][slot, :, :n]
                b = getattr(torch_ops.pool, buffers)[layer][slot, :, :n]
                torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5)


@needs_native
def test_native_step_sees_weights_written_in_place_and_a_moved_storage():
    """Pointers are read at every call: an in-place weight write and a storage given back and retaken (a
    woken engine's weights may come back at another address) both show in the next step."""
    native, torch_ops = decoder_pair("qwen3_moe", seed=6, slots=4, max_len=16)
    ids, positions = torch.tensor([3, 4]), torch.tensor([5, 9])
    weight = native.layers[1].experts_gate_up  # shared by both decoders: one model
    with torch.inference_mode():
        before = native(ids, positions, 10, masked=True)
        weight.mul_(1.5)
        storage = native.lm_head.untyped_storage()
        saved = native.lm_head.clone()
        storage.resize_(0)
        storage.resize_(saved.nbytes)
        native.lm_head.copy_(saved)
        after = native(ids, positions, 10, masked=True)
        expected = torch_ops(ids, positions, 10, masked=True)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, atol=2e-5, rtol=0)


def test_cpu_step_choice_and_errors(monkeypatch):
    fp32 = build_model(tiny_config("qwen3"), seed=3, device="cpu", dtype="float32")
    pool = KVPool(fp32.config.num_hidden_layers, 2, 16, "cpu")
    assert LeanDecoder(fp32, pool, cpu_step="torch").step == "torch (asked for)"
    with pytest.raises(ValueError, match="choose one of"):
        LeanDecoder(fp32, pool, cpu_step="fast")
    bf16 = build_model(tiny_config("qwen3"), seed=3, device="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="cpu_step='native' is not available: .*fp32"):
        LeanDecoder(bf16, KVPool(2, 2, 16, "cpu"), cpu_step="native")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = LeanDecoder(fp32, pool)
        assert two.native_step is None and "2 intra-op threads" in two.step
        torch.set_num_threads(1)
        one = LeanDecoder(fp32, pool)
        assert (one.native_step is not None) == (LIB is not None)
        assert one.step.startswith("native" if LIB is not None else "torch (")
    finally:
        torch.set_num_threads(threads)


def test_without_a_compiler_the_step_falls_back_to_pytorch_and_says_why(monkeypatch, tmp_path):
    """No compiler and no cached build: auto runs PyTorch's ops (the reason in ``step``), native is refused
    naming the cause, and the PyTorch step still runs."""
    monkeypatch.setenv("TIDAL_KERNEL_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    native_step.load.cache_clear()
    try:
        lm = build_model(tiny_config("qwen3"), seed=3, device="cpu", dtype="float32")
        pool = KVPool(lm.config.num_hidden_layers, 2, 16, "cpu")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            auto = LeanDecoder(lm, pool, cpu_attention="torch")
        finally:
            torch.set_num_threads(threads)
        assert auto.native_step is None and "no C compiler" in auto.step
        with pytest.raises(ValueError, match="cpu_step='native' is not available: no C compiler"):
            LeanDecoder(lm, pool, cpu_step="native")
        with torch.inference_mode():
            logits = auto(torch.tensor([1, 2]), torch.tensor([0, 0]), 1, masked=False)
        assert logits.shape == (2, 96) and torch.isfinite(logits).all()
    finally:
        native_step.load.cache_clear()


@needs_native
def test_loading_the_step_library_leaves_the_processs_floating_point_mode_alone():
    # built with -ffast-math at compile only: a library linked with it would set flush-to-zero /
    # denormals-are-zero for the whole process when it loads
    assert native_step.load()[0] is not None
    assert 5e-324 * 1.0 > 0.0
    assert float(torch.tensor([1e-40], dtype=torch.float32) * 1.0) > 0.0


@needs_native
def test_native_step_refuses_rows_outside_the_model_or_the_pool():
    native, _ = decoder_pair("qwen3", seed=7, slots=2, max_len=8)
    step = native.native_step
    ok_ids, ok_pos = torch.tensor([1, 2]), torch.tensor([0, 3])
    cases = [
        (dict(ids=torch.tensor([1, 96]), positions=ok_pos), "token id outside the vocabulary"),
        (dict(ids=ok_ids, positions=torch.tensor([0, 8])), "position outside"),
        (dict(ids=ok_ids, positions=ok_pos, slots=torch.tensor([0, 2])), "KV slot outside the pool"),
        (dict(ids=torch.tensor([1, 2, 3]), positions=torch.tensor([0, 1, 2])), "KV slot outside the pool"),
        (dict(ids=ok_ids, positions=ok_pos, out_rows=torch.tensor([2])), "output row outside"),
    ]
    with torch.inference_mode():
        for kwargs, message in cases:
            with pytest.raises(ValueError, match=message):
                step(**kwargs)
        assert step(ok_ids, ok_pos).shape == (2, 96)


@needs_native
@pytest.mark.parametrize("rows", [3, 21])
def test_native_step_reads_no_scratch_it_did_not_write(rows):
    """The scratch memory is reused without zeroing (padding columns included): filled with NaN between
    steps, the next step's logits are unchanged (the dot-product path for few rows, the tiles for more)."""
    native, _ = decoder_pair("qwen3_moe", seed=8, slots=24, max_len=16)
    gen = torch.Generator().manual_seed(3)
    ids, positions = (
        torch.randint(0, 96, (rows,), generator=gen),
        torch.randint(0, 15, (rows,), generator=gen),
    )
    with torch.inference_mode():
        first = native(ids, positions, 16, masked=True)
        native.native_step.scratch.fill_(float("nan"))
        again = native(ids, positions, 16, masked=True)
    assert torch.isfinite(first).all()
    torch.testing.assert_close(again, first, atol=0, rtol=0)


@pytest.mark.skipif(
    native_build.host_isa()[0] != "avx512",
    reason="the fallback is from the AVX-512 build, not the one picked here (the CPU, or TIDAL_NATIVE_ISA)",
)
def test_a_failed_avx512_build_falls_back_to_the_avx2_build(monkeypatch):
    real = native_build._load.__wrapped__

    def avx512_fails(source, isa, cc):
        if isa == "avx512":
            return None, "building or loading the native kernels failed: simulated"
        return real(source, isa, cc)

    monkeypatch.setattr(native_build, "_load", avx512_fails)
    lib, how = native_build.load(native_step.SOURCE)
    assert lib is not None and how.startswith("avx2 build") and "simulated" in how


@needs_native
def test_native_greedy_step_picks_what_sampling_the_logits_picks():
    """All rows greedy: the kernel's argmax tokens and log-softmax equal sampling.sample on its logits."""
    from tidal.rollout.embedded.sampling import SamplingParams, sample

    native, _ = decoder_pair("qwen3_moe", seed=9, slots=12, max_len=24)
    gen = torch.Generator().manual_seed(4)
    ids, positions = torch.randint(0, 96, (11,), generator=gen), torch.randint(0, 23, (11,), generator=gen)
    with torch.inference_mode():
        logits = native(ids, positions, 24, masked=True)
        tokens, logprobs = native.native_step.greedy(ids, positions)
        expected_tokens, expected_logprobs = sample(logits, [SamplingParams(temperature=0)] * 11, [None] * 11)
    assert tokens.tolist() == expected_tokens.tolist()
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-6, rtol=0)

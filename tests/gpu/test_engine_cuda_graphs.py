"""The embedded engine's CUDA-graph decode on CUDA: equal to transformers, sees weight loads, falls back.

The graphs replay the lean forward padded to (batch, length) buckets (rollout/embedded/decode_step.py);
tests/unit/test_engine_decode.py checks the same padding eagerly on CPU. Here the graphs themselves run:
fp32 greedy tokens equal transformers' greedy ``generate`` on CUDA and logprobs equal a teacher-forced
forward within 1e-4; bf16 tokens are the teacher-forced argmax within bf16 rounding; an in-place weight load
changes what the captured graphs compute; a failing capture leaves a working eager engine.
"""

from __future__ import annotations

import threading
import time

import pytest

from tidal.rollout.embedded.testing import PROMPTS, tiny_config

pytestmark = pytest.mark.gpu

FAMILIES = ["qwen3", "qwen3_moe"]
# 16 experts, top-2: buckets of 1-4 rows gather their experts, 8 and more run every expert
MOE_EXPERTS = {"qwen3_moe": dict(num_experts=16)}
LENGTHS = [40, 6, 40, 17]  # one finishes early (compaction), lengths cross the 32 and 48 buckets
BF16_LOGPROB_ATOL = 2e-2  # as in test_gpu_engine.py: bf16 rounding may turn a near-tie


def build(family: str, dtype: str, seed: int = 1):
    from tidal.rollout.embedded.model import build_model

    cfg = tiny_config(family, **MOE_EXPERTS.get(family, {}))
    return build_model(cfg, seed=seed, device="cuda", dtype=dtype)


def reference(lm, attention: str):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_config(lm.config.__class__(**lm.config.to_dict()))
    ref.config._attn_implementation = attention
    ref.load_state_dict(lm.state_dict())
    return ref.to(device=lm.device, dtype=lm.dtype).eval()


def scheduler(lm, max_batch_size: int = 8):
    from tidal.rollout.embedded.scheduler import Scheduler

    sched = Scheduler(
        lm,
        max_batch_size=max_batch_size,
        max_seq_len=96,
        max_prefill_tokens=4096,
        device="cuda",
        eos_token_ids=[],
        decode="cuda_graphs",
    )
    sched.start()
    return sched


def generate(sched, prompts, lengths, join_after: int = 3):
    """Greedy; all but the first request arrive once the first has ``join_after`` tokens."""
    from tidal.rollout.embedded.sampling import SamplingParams
    from tidal.rollout.embedded.scheduler import Request

    done: dict[str, object] = {}
    finished = threading.Event()

    def on_done(req) -> None:
        done[req.rid] = req
        if len(done) == len(prompts):
            finished.set()

    reqs = [
        Request(
            input_ids=p, params=SamplingParams(max_new_tokens=n, temperature=0), rid=str(i), on_done=on_done
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    sched.submit(reqs[0])
    deadline = time.monotonic() + 120  # the graphs are captured before the first step
    while len(reqs[0].output_ids) < join_after and time.monotonic() < deadline:
        time.sleep(0.001)
    for req in reqs[1:]:
        sched.submit(req)
    assert finished.wait(180), f"only {len(done)}/{len(prompts)} requests finished"
    return [done[str(i)] for i in range(len(prompts))]


def assert_fp32_transformers(ref, prompts, done) -> None:
    import torch

    for prompt, req in zip(prompts, done, strict=True):
        ids = torch.tensor([prompt], device=ref.device)
        n = len(req.output_ids)
        out = ref.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert req.output_ids == out[0, len(prompt) :].tolist(), f"prompt {prompt}"
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + req.output_ids], device=ref.device)).logits[0].float()
        teacher = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].cpu()
        chosen = teacher.gather(1, torch.tensor(req.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(req.output_logprobs), chosen, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_graph_replay_equals_transformers(family):
    from tidal.rollout.embedded.decode_step import DecodeGraphs

    lm = build(family, "float32")
    sched = scheduler(lm)
    try:
        done = generate(sched, PROMPTS, LENGTHS)
        graphs = sched._lean_step
        assert sched.decode_mode == "cuda_graphs", sched.decode_reason
        assert isinstance(graphs, DecodeGraphs) and graphs.failure is None
        assert len(graphs.graphs) == len(graphs.rows_buckets) * len(graphs.len_buckets)
    finally:
        sched.stop()
    for req, n in zip(done, LENGTHS, strict=True):
        assert req.finish_reason == {"type": "length", "length": n}
    assert_fp32_transformers(reference(lm, "eager"), PROMPTS, done)


def test_captured_graphs_see_in_place_weight_loads():
    import torch

    from tidal.rollout.embedded.model import NamedTensorLoader

    lm = build("qwen3_moe", "float32", seed=2)
    sched = scheduler(lm)
    try:
        before = generate(sched, PROMPTS[:2], [12, 12], join_after=0)
        loader = NamedTensorLoader(lm)
        gen = torch.Generator().manual_seed(0)
        names = [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.mlp.experts.5.down_proj.weight",
            "model.layers.1.mlp.gate.weight",
        ]
        update = [(n, torch.randn(loader.read(n).shape, generator=gen).cuda()) for n in names]
        sched.call(lambda: loader.load(update), drain=True).result(60)
        after = generate(sched, PROMPTS[:2], [12, 12], join_after=0)
        assert sched.decode_mode == "cuda_graphs", sched.decode_reason
    finally:
        sched.stop()
    assert [r.output_ids for r in before] != [r.output_ids for r in after]
    assert_fp32_transformers(reference(lm, "eager"), PROMPTS[:2], after)


def test_failed_capture_falls_back_to_the_eager_lean_forward(monkeypatch):
    import torch

    from tidal.rollout.embedded.decode_step import DecodeGraphs

    forward = DecodeGraphs._forward

    def refusing_capture(self, rows, length):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("simulated: an op that cannot be captured")
        return forward(self, rows, length)

    monkeypatch.setattr(DecodeGraphs, "_forward", refusing_capture)
    lm = build("qwen3", "float32", seed=3)
    sched = scheduler(lm)
    try:
        done = generate(sched, PROMPTS, LENGTHS)
        assert sched.decode_mode == "lean"
        assert "capture failed" in sched.decode_reason and "simulated" in sched.decode_reason
    finally:
        sched.stop()
    assert_fp32_transformers(reference(lm, "eager"), PROMPTS, done)


def test_bf16_graphs_over_many_rows_give_the_teacher_forced_argmax():
    import torch

    lm = build("qwen3_moe", "bfloat16", seed=4)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 96, (int(n),), generator=gen).tolist()
        for n in torch.randint(3, 20, (24,), generator=gen)
    ]
    lengths = [int(n) for n in torch.randint(8, 60, (24,), generator=gen)]
    sched = scheduler(lm, max_batch_size=32)
    try:
        done = generate(sched, prompts, lengths, join_after=2)
        assert sched.decode_mode == "cuda_graphs", sched.decode_reason
    finally:
        sched.stop()
    ref = reference(lm, "sdpa")
    for prompt, req, n in zip(prompts, done, lengths, strict=True):
        assert len(req.output_ids) == n
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + req.output_ids], device="cuda")).logits[0].float()
        teacher = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].cpu()
        chosen = teacher.gather(1, torch.tensor(req.output_ids)[:, None]).squeeze(1)
        gap = teacher.max(dim=1).values - chosen
        assert gap.max().item() <= BF16_LOGPROB_ATOL, (prompt, gap.tolist())
        torch.testing.assert_close(torch.tensor(req.output_logprobs), chosen, atol=BF16_LOGPROB_ATOL, rtol=0)

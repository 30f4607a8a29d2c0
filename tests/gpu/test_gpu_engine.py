"""The embedded engine on CUDA: greedy output equal to transformers' greedy ``generate`` on CUDA.

In process: the continuous-batching scheduler with requests joining a running batch, for each family
(fp32: equal tokens, logprobs equal to a teacher-forced forward within 1e-4), and in bf16 (each greedy
token is the teacher-forced argmax up to bf16 rounding). As a process: ``tidal serve`` on CUDA driven by
the production HTTP client (SGLang's protocol), compared with transformers on CUDA.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tidal.rollout.embedded.testing import PROMPTS, TINY_QWEN3, TINY_SHAPES, tiny_config
from tidal.rollout.embedded.testing import served_engine as engine_process

pytestmark = pytest.mark.gpu

FAMILIES = list(TINY_SHAPES)
MAX_NEW = 24
# bf16 logits carry 8 mantissa bits; the engine (batched, padded, its own attention) and transformers
# (one row, SDPA) round differently, so a greedy token may be a near-tie of the reference's argmax
BF16_LOGPROB_ATOL = 2e-2


def model_config(family: str):

    return tiny_config(family)


def reference(lm, attention: str):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_config(lm.config.__class__(**lm.config.to_dict()))
    ref.config._attn_implementation = attention
    ref.load_state_dict(lm.state_dict())
    return ref.to(device=lm.device, dtype=lm.dtype).eval()


def greedy(ref, prompt: list[int], max_new: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt], device=ref.device)
    out = ref.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def teacher_logprobs(ref, prompt: list[int], output: list[int]):
    """[len(output), vocab] log-probabilities of a teacher-forced forward (fp32 log_softmax)."""
    import torch

    with torch.no_grad():
        logits = ref(torch.tensor([prompt + output], device=ref.device)).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].cpu()


def generate_joining(lm, prompts: list[list[int]], max_new: int) -> dict[str, object]:
    """Run the engine's scheduler on CUDA; all but the first request arrive while the first decodes."""
    from tidal.rollout.embedded.sampling import SamplingParams
    from tidal.rollout.embedded.scheduler import Request, Scheduler

    done: dict[str, Request] = {}
    finished = threading.Event()

    def on_done(req: Request) -> None:
        done[req.rid] = req
        if len(done) == len(prompts):
            finished.set()

    sched = Scheduler(
        lm, max_batch_size=8, max_seq_len=96, max_prefill_tokens=4096, device="cuda", eos_token_ids=[]
    )
    sched.start()
    try:

        def submit(i: int) -> Request:
            req = Request(
                input_ids=prompts[i], params=SamplingParams(max_new_tokens=max_new, temperature=0), rid=str(i)
            )
            req.on_done = on_done
            sched.submit(req)
            return req

        first = submit(0)
        deadline = time.monotonic() + 60
        while len(first.output_ids) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert 3 <= len(first.output_ids) < max_new, "the first request must be decoding when others join"
        for i in range(1, len(prompts)):
            submit(i)
        assert finished.wait(120), f"only {len(done)}/{len(prompts)} requests finished"
        assert sched.steps < len(prompts) * max_new, "requests did not share decode steps"
        return done
    finally:
        sched.stop()


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_on_cuda_equals_transformers(family):
    import torch

    from tidal.rollout.embedded.model import build_model

    lm = build_model(model_config(family), seed=1, device="cuda", dtype="float32")
    ref = reference(lm, "eager")
    done = generate_joining(lm, PROMPTS, MAX_NEW)
    for i, prompt in enumerate(PROMPTS):
        req = done[str(i)]
        assert req.output_ids == greedy(ref, prompt, MAX_NEW), f"prompt {i}"
        teacher = teacher_logprobs(ref, prompt, req.output_ids).gather(
            1, torch.tensor(req.output_ids)[:, None]
        )
        torch.testing.assert_close(torch.tensor(req.output_logprobs), teacher.squeeze(1), atol=1e-4, rtol=0)
        assert req.finish_reason == {"type": "length", "length": MAX_NEW}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_bf16_greedy_on_cuda_is_the_teacher_forced_argmax(family):
    import torch

    from tidal.rollout.embedded.model import build_model

    lm = build_model(model_config(family), seed=1, device="cuda", dtype="bfloat16")
    ref = reference(lm, "sdpa")
    done = generate_joining(lm, PROMPTS, MAX_NEW)
    for i, prompt in enumerate(PROMPTS):
        req = done[str(i)]
        teacher = teacher_logprobs(ref, prompt, req.output_ids)
        chosen = teacher.gather(1, torch.tensor(req.output_ids)[:, None]).squeeze(1)
        # every emitted token is the reference's argmax, or within bf16 rounding of it
        gap = teacher.max(dim=1).values - chosen
        assert gap.max().item() <= BF16_LOGPROB_ATOL, (i, gap.tolist())
        torch.testing.assert_close(torch.tensor(req.output_logprobs), chosen, atol=BF16_LOGPROB_ATOL, rtol=0)


SERVED = TINY_QWEN3
SERVED_SEED = 7


@pytest.fixture(scope="module")
def served_engine(tmp_path_factory):
    with engine_process(
        SERVED,
        f"seed={SERVED_SEED}",
        "rollout.engine.device=cuda",
        "rollout.engine.dtype=float32",
        "rollout.engine.max_batch_size=8",
        "rollout.engine.max_seq_len=96",
        log_path=tmp_path_factory.mktemp("engine") / "serve.log",
        start_timeout_s=240,
    ) as proc:
        yield proc


def test_served_engine_on_cuda_generates_transformers_greedy(served_engine):
    import torch

    from tidal.model_config import ModelConfig
    from tidal.rollout.embedded.model import build_model
    from tidal.rollout.http_client import SGLangClient

    async def go():
        client = SGLangClient(served_engine.url)
        try:
            results = await asyncio.gather(
                *[client.generate(p, {"max_new_tokens": 16, "temperature": 0.0}) for p in PROMPTS]
            )
            return results, await client.model_info()
        finally:
            await client.close()

    results, info = asyncio.run(go())
    assert info["model_type"] == "qwen3"
    # the same config and seed build the same random model on any device
    lm = build_model(ModelConfig(**SERVED), seed=SERVED_SEED, device="cuda", dtype="float32")
    ref = reference(lm, "eager")
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.output_ids == greedy(ref, prompt, 16)
        teacher = teacher_logprobs(ref, prompt, res.output_ids).gather(
            1, torch.tensor(res.output_ids)[:, None]
        )
        torch.testing.assert_close(torch.tensor(res.output_logprobs), teacher.squeeze(1), atol=1e-4, rtol=0)

"""The embedded engine serves the tiny Qwen3.5 (Gated DeltaNet state per slot) and refuses GLM-5 by name.

Greedy generation of the continuous-batching scheduler equals transformers' greedy ``generate`` token for
token, and the returned logprobs equal a teacher-forced forward within 1e-4 (fp32, CPU, the acceptance of
tests/unit/test_engine_generation.py), with requests joining a running batch and one finishing early, so
that the scheduler moves running requests (and their recurrent state) between slots.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import transformers
import yaml

from tidal.model_config import ModelConfig
from tidal.rollout.embedded.model import build_model
from tidal.rollout.embedded.sampling import SamplingParams
from tidal.rollout.embedded.scheduler import Request, Scheduler

TINY = "configs/tiny/{}.yaml"
PROMPTS = [[3, 17, 5, 9, 12], [8, 1, 30, 2, 2, 7, 19, 4, 11], [25, 6], [13, 14, 15, 16, 20, 21, 22]]
LENGTHS = [20, 4, 20, 20]  # request 1 finishes early: the scheduler compacts the others into lower slots


def tiny(preset: str) -> ModelConfig:
    with open(TINY.format(preset)) as f:
        return ModelConfig(**yaml.safe_load(f)["model"])


def test_qwen3_5_greedy_generation_matches_transformers():
    lm = build_model(tiny("qwen3_5_35b_a3b"), seed=1, device="cpu", dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_config(lm.config.__class__(**lm.config.to_dict()))
    ref.load_state_dict(lm.state_dict())
    ref.eval()
    sched = Scheduler(
        lm, max_batch_size=4, max_seq_len=64, max_prefill_tokens=4096, device="cpu", eos_token_ids=[]
    )
    sched.start()
    done: dict[str, Request] = {}
    finished = threading.Event()

    def collect(req: Request) -> None:
        done[req.rid] = req
        if len(done) == len(PROMPTS):
            finished.set()

    try:
        first = Request(
            input_ids=PROMPTS[0], params=SamplingParams(max_new_tokens=LENGTHS[0], temperature=0), rid="0"
        )
        first.on_done = collect
        sched.submit(first)
        deadline = time.monotonic() + 60
        while len(first.output_ids) < 3 and first.finish_reason is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert 3 <= len(first.output_ids) < LENGTHS[0], first.finish_reason
        for i, prompt in enumerate(PROMPTS[1:], start=1):
            req = Request(
                input_ids=prompt, params=SamplingParams(max_new_tokens=LENGTHS[i], temperature=0), rid=str(i)
            )
            req.on_done = collect
            sched.submit(req)
        assert finished.wait(120), f"only {len(done)}/{len(PROMPTS)} requests finished"
    finally:
        sched.stop()
    for i, prompt in enumerate(PROMPTS):
        req = done[str(i)]
        expected = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=LENGTHS[i],
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert req.output_ids == expected, i
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + req.output_ids])).logits[0].float()
        teacher = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
            1, torch.tensor(req.output_ids)[:, None]
        )
        assert torch.allclose(torch.tensor(req.output_logprobs), teacher[:, 0], atol=1e-4, rtol=0), i


def test_glm5_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="cannot serve model.family=glm_moe_dsa.*indexer.*SGLang"):
        build_model(tiny("glm_5_1"), seed=1, device="cpu", dtype="float32")

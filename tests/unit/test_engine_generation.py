"""The embedded engine's scheduler against transformers: greedy tokens, logprobs, batching, pauses.

Acceptance: greedy generation equals transformers' greedy ``generate`` token for token and the returned
logprobs equal a teacher-forced forward within 1e-4 (fp32, CPU), for every family, with requests that
join a running batch and requests retracted or paused mid-generation.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import transformers

from tidal.model_config import ModelConfig
from tidal.rollout.embedded import native_step
from tidal.rollout.embedded.model import build_model
from tidal.rollout.embedded.sampling import SamplingParams
from tidal.rollout.embedded.scheduler import Request, Scheduler
from tidal.rollout.embedded.testing import PROMPTS, TINY_SHAPES, tiny_config

FAMILIES = list(TINY_SHAPES)
NATIVE_LIB, NATIVE_HOW = native_step.load()
NATIVE = pytest.param(
    "native", marks=pytest.mark.skipif(NATIVE_LIB is None, reason=f"native step unavailable: {NATIVE_HOW}")
)
# the lean families run once per CPU step (the native kernel, PyTorch's ops); DeepSeek-V3 decodes through
# transformers' modules, where the step setting does not apply
FAMILY_STEPS = [
    *[pytest.param(f, "native", marks=NATIVE.marks, id=f"{f}-native") for f in ("qwen3", "qwen3_moe")],
    *[pytest.param(f, "torch", id=f"{f}-torch") for f in FAMILIES],
]


def model_config(family: str) -> ModelConfig:
    return tiny_config(family)


def reference(lm) -> torch.nn.Module:
    ref = transformers.AutoModelForCausalLM.from_config(lm.config.__class__(**lm.config.to_dict()))
    ref.config._attn_implementation = "eager"
    ref.load_state_dict(lm.state_dict())
    return ref.eval()


class Collector:
    def __init__(self, n: int):
        self.done: dict[str, Request] = {}
        self.n = n
        self.event = threading.Event()

    def __call__(self, req: Request) -> None:
        self.done[req.rid] = req
        if len(self.done) == self.n:
            self.event.set()

    def wait(self, timeout_s: float = 120) -> dict[str, Request]:
        assert self.event.wait(timeout_s), f"only {len(self.done)}/{self.n} requests finished"
        return self.done


def make_scheduler(lm, *, paced: bool = False, **kw) -> Scheduler:
    """A started scheduler; ``paced``: each decode step takes at least 2 ms, so that a pause or abort sent
    after a request's first few tokens lands before its last one, however fast the step (the native step
    runs a tiny model's decode step in tens of microseconds)."""
    args = dict(max_batch_size=8, max_seq_len=96, max_prefill_tokens=4096, device="cpu", eos_token_ids=[])
    args.update(kw)
    sched = Scheduler(lm, **args)
    if paced and sched._lean_step is not None:
        step = sched._lean_step

        def paced_step(*step_args):
            time.sleep(0.002)
            return step(*step_args)

        sched._lean_step = paced_step
    sched.start()
    return sched


def check_against_reference(ref, prompt: list[int], req: Request, max_new: int) -> None:
    expected = ref.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert req.output_ids == expected
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + req.output_ids])).logits[0].float()
    teacher = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(
        1, torch.tensor(req.output_ids)[:, None]
    )
    assert torch.allclose(torch.tensor(req.output_logprobs), teacher.squeeze(1), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("family", "cpu_step"), FAMILY_STEPS)
def test_greedy_matches_transformers_with_requests_joining_a_running_batch(family, cpu_step):
    lm = build_model(model_config(family), seed=1, device="cpu", dtype="float32")
    ref = reference(lm)
    sched = make_scheduler(lm, paced=True, cpu_step=cpu_step)
    try:
        collect = Collector(len(PROMPTS))
        # request 1 stops early, leaving slots 0, 2, 3: a decode batch over non-adjacent slots
        lengths = [80, 6, 24, 24]
        first = Request(
            input_ids=PROMPTS[0], params=SamplingParams(max_new_tokens=lengths[0], temperature=0), rid="0"
        )
        first.on_done = collect
        sched.submit(first)
        # the others arrive while the first one is decoding: they must join its batch. The first is held
        # (paused in place) while they are queued, so that it cannot finish first on a fast step
        deadline = time.monotonic() + 60
        while len(first.output_ids) < 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        sched.call(lambda: sched.pause("in_place")).result(timeout=60)
        assert 3 <= len(first.output_ids) < lengths[0]
        for i, prompt in enumerate(PROMPTS[1:], start=1):
            req = Request(
                input_ids=prompt, params=SamplingParams(max_new_tokens=lengths[i], temperature=0), rid=str(i)
            )
            req.on_done = collect
            sched.submit(req)
        sched.call(sched.resume).result(timeout=60)
        done = collect.wait()
        for i, prompt in enumerate(PROMPTS):
            check_against_reference(ref, prompt, done[str(i)], lengths[i])
            assert done[str(i)].finish_reason == {"type": "length", "length": lengths[i]}
        # fewer steps than running the requests one after another: they shared decode steps
        assert sched.steps < sum(lengths)
    finally:
        sched.stop()


@pytest.mark.parametrize("cpu_step", [NATIVE, "torch"])
@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_a_prompt_repeated_in_one_prefill_runs_once_and_matches_transformers(family, cpu_step):
    lm = build_model(model_config(family), seed=3, device="cpu", dtype="float32")
    ref = reference(lm)
    sched = make_scheduler(lm, cpu_step=cpu_step)
    try:
        assert sched.prefill_mode == "lean", sched.prefill_reason
        sched.call(lambda: sched.pause("in_place")).result(30)  # queue them all: one prefill takes them
        prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[0], PROMPTS[2]]
        collect = Collector(len(prompts))
        for i, prompt in enumerate(prompts):
            req = Request(
                input_ids=prompt, params=SamplingParams(max_new_tokens=8, temperature=0), rid=str(i)
            )
            req.on_done = collect
            sched.submit(req)
        sched.call(sched.resume).result(30)
        done = collect.wait()
        assert sched.prefill_rows == 2  # the two distinct prompts; the copies took their keys and values
        for i, prompt in enumerate(prompts):
            check_against_reference(ref, prompt, done[str(i)], 8)
    finally:
        sched.stop()


@pytest.mark.parametrize("cpu_step", [NATIVE, "torch"])
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_mid_generation_keeps_greedy_output(mode, cpu_step):
    lm = build_model(model_config("qwen3"), seed=2, device="cpu", dtype="float32")
    ref = reference(lm)
    sched = make_scheduler(lm, paced=True, cpu_step=cpu_step)
    try:
        collect = Collector(2)
        reqs = []
        for i, prompt in enumerate(PROMPTS[:2]):
            req = Request(
                input_ids=prompt, params=SamplingParams(max_new_tokens=30, temperature=0), rid=str(i)
            )
            req.on_done = collect
            reqs.append(req)
            sched.submit(req)
        while len(reqs[0].output_ids) < 4:
            time.sleep(0.002)
        sched.call(lambda: sched.pause(mode)).result(30)
        partial = len(reqs[0].output_ids)
        time.sleep(0.1)
        assert len(reqs[0].output_ids) == partial, "generation went on while paused"
        if mode == "retract":
            assert sched.pool.free_slots == sched.max_batch_size
        sched.call(lambda: sched.set_version("v1")).result(30)
        sched.call(sched.resume).result(30)
        done = collect.wait()
        for i, prompt in enumerate(PROMPTS[:2]):
            check_against_reference(ref, prompt, done[str(i)], 30)
        spans = done["0"].version_spans
        assert spans == [
            {"version": "default", "start": 0, "end": partial},
            {"version": "v1", "start": partial, "end": 30},
        ]
        assert done["0"].weight_version == "v1"
    finally:
        sched.stop()


def test_pause_abort_and_abort_request_finish_with_partial_output():
    lm = build_model(model_config("qwen3"), seed=3, device="cpu", dtype="float32")
    sched = make_scheduler(lm, paced=True)
    try:
        collect = Collector(3)
        reqs = []
        for i, prompt in enumerate(PROMPTS[:3]):
            req = Request(
                input_ids=prompt, params=SamplingParams(max_new_tokens=80, temperature=0), rid=str(i)
            )
            req.on_done = collect
            reqs.append(req)
            sched.submit(req)
        while len(reqs[0].output_ids) < 2:
            time.sleep(0.002)
        assert sched.call(lambda: sched.abort("1", False)).result(30) == 1
        sched.call(lambda: sched.pause("abort")).result(30)
        done = collect.wait()
        for req in done.values():
            assert req.finish_reason["type"] == "abort"
            assert len(req.output_ids) < 80
            assert len(req.output_logprobs) == len(req.output_ids)
        assert sched.pool.free_slots == sched.max_batch_size
        # new requests wait while paused and run after continue
        late = Collector(1)
        req = Request(
            input_ids=[5, 6], params=SamplingParams(max_new_tokens=3, temperature=0), rid="late", on_done=late
        )
        sched.submit(req)
        time.sleep(0.1)
        assert req.output_ids == []
        sched.call(sched.resume).result(30)
        assert late.wait()["late"].finish_reason == {"type": "length", "length": 3}
    finally:
        sched.stop()


@pytest.mark.parametrize("cpu_step", [NATIVE, "torch"])
def test_stop_tokens_eos_and_context_length_end_generation(cpu_step):
    lm = build_model(model_config("qwen3"), seed=4, device="cpu", dtype="float32")
    ref = reference(lm)
    greedy = ref.generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    stop_at = greedy[0, len(PROMPTS[0]) + 3].item()
    sched = make_scheduler(lm, max_seq_len=12, eos_token_ids=[stop_at], cpu_step=cpu_step)
    try:
        collect = Collector(3)
        cases = [
            Request(
                input_ids=PROMPTS[0],
                params=SamplingParams(max_new_tokens=50, temperature=0, stop_token_ids=[stop_at]),
                rid="stop",
            ),
            Request(input_ids=PROMPTS[0], params=SamplingParams(max_new_tokens=50, temperature=0), rid="eos"),
            Request(
                input_ids=PROMPTS[0],
                params=SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True),
                rid="ctx",
            ),
        ]
        for req in cases:
            req.on_done = collect
            sched.submit(req)
        done = collect.wait()
        first_stop = greedy[0, len(PROMPTS[0]) :].tolist().index(stop_at)
        for rid in ("stop", "eos"):
            assert done[rid].finish_reason == {"type": "stop", "matched": stop_at}
            assert done[rid].output_ids[-1] == stop_at and len(done[rid].output_ids) == first_stop + 1
        assert done["ctx"].finish_reason == {"type": "length", "length": 12 - len(PROMPTS[0])}
    finally:
        sched.stop()


@pytest.mark.parametrize("cpu_step", [NATIVE, "torch"])
def test_seeded_sampling_is_reproducible_and_respects_top_k(cpu_step):
    lm = build_model(model_config("qwen3"), seed=5, device="cpu", dtype="float32")
    sched = make_scheduler(lm, cpu_step=cpu_step)
    try:
        collect = Collector(3)
        params = dict(max_new_tokens=20, temperature=1.0, top_k=3, sampling_seed=1234)
        for rid in ("a", "b"):
            sched.submit(
                Request(input_ids=PROMPTS[1], params=SamplingParams(**params), rid=rid, on_done=collect)
            )
        sched.submit(
            Request(
                input_ids=PROMPTS[1],
                params=SamplingParams(**{**params, "sampling_seed": 99}),
                rid="c",
                on_done=collect,
            )
        )
        done = collect.wait()
        assert done["a"].output_ids == done["b"].output_ids
        assert done["a"].output_ids != done["c"].output_ids
        ids = PROMPTS[1] + done["a"].output_ids
        with torch.no_grad():
            logits = lm(torch.tensor([ids])).logits[0]
        for j, tok in enumerate(done["a"].output_ids):
            top3 = torch.topk(logits[len(PROMPTS[1]) - 1 + j], 3).indices.tolist()
            assert tok in top3
    finally:
        sched.stop()

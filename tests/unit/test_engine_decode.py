"""The engine's decode paths: the lean forward, its bucket padding (what CUDA graphs replay), compaction.

Every path is checked against transformers (greedy tokens equal, logprobs within 1e-4 of a teacher-forced
forward, fp32 CPU). ``bucketed`` runs the CUDA-graph path's padding and static-shape MoE eagerly, which is
how it is checked without a GPU; tests/gpu/test_engine_cuda_graphs.py replays the graphs themselves.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import transformers

from tidal.rollout.embedded import native_step
from tidal.rollout.embedded.decode_step import DecodeGraphs, EagerDecode, batch_buckets, length_buckets
from tidal.rollout.embedded.kv_cache import KVPool
from tidal.rollout.embedded.lean import LeanDecoder
from tidal.rollout.embedded.model import NamedTensorLoader, build_model
from tidal.rollout.embedded.sampling import SamplingParams
from tidal.rollout.embedded.scheduler import Request, Scheduler
from tidal.rollout.embedded.testing import PROMPTS, tiny_config

FAMILIES = ["qwen3", "qwen3_moe"]
NATIVE_LIB, NATIVE_HOW = native_step.load()
NATIVE = pytest.param(
    "native", marks=pytest.mark.skipif(NATIVE_LIB is None, reason=f"native step unavailable: {NATIVE_HOW}")
)


def model(family: str, seed: int):
    cfg = tiny_config(family)
    return build_model(cfg, seed=seed, device="cpu", dtype="float32")


def reference(lm) -> torch.nn.Module:
    ref = transformers.AutoModelForCausalLM.from_config(lm.config.__class__(**lm.config.to_dict()))
    ref.config._attn_implementation = "eager"
    ref.load_state_dict(lm.state_dict())
    return ref.eval()


def assert_transformers_greedy(ref, prompt: list[int], req: Request) -> None:
    n = len(req.output_ids)
    expected = ref.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert req.output_ids == expected
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + req.output_ids])).logits[0]
    teacher = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(
        1, torch.tensor(req.output_ids)[:, None]
    )
    torch.testing.assert_close(torch.tensor(req.output_logprobs), teacher.squeeze(1), atol=1e-4, rtol=0)


def run(sched: Scheduler, prompts: list[list[int]], lengths: list[int], *, join_after: int = 0):
    """Generate greedily; with ``join_after``, all but the first request arrive once it has that many tokens."""
    done: dict[str, Request] = {}
    finished = threading.Event()

    def on_done(req: Request) -> None:
        done[req.rid] = req
        if len(done) == len(prompts):
            finished.set()

    reqs = [
        Request(
            input_ids=p, params=SamplingParams(max_new_tokens=n, temperature=0), rid=str(i), on_done=on_done
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    if join_after:
        # each decode step takes at least 2 ms, so the first request cannot finish before the others join
        # however fast the step is or however busy the host (the test's thread polls its tokens)
        step = sched._lean_step

        def paced_step(*step_args):
            time.sleep(0.002)
            return step(*step_args)

        sched._lean_step = paced_step
    sched.submit(reqs[0])
    deadline = time.monotonic() + 60
    while len(reqs[0].output_ids) < join_after and time.monotonic() < deadline:
        time.sleep(0.002)
    assert len(reqs[0].output_ids) < lengths[0], "the first request finished before the others joined"
    for req in reqs[1:]:
        sched.submit(req)
    assert finished.wait(120), f"only {len(done)}/{len(prompts)} finished"
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_bucket_decode_equals_transformers_with_joins_and_finishes(family):
    """The CUDA-graph step's padding (rows to 1/2/4/8, cache to 32/48/...) run eagerly: bucket 1 while one
    request decodes (MoE: top-k experts gathered), then 4 rows (MoE: all experts, router-weighted), rows
    that finish early (their slots are compacted), and lengths that cross a length bucket."""
    lm = model(family, seed=11)
    sched = Scheduler(
        lm,
        max_batch_size=8,
        max_seq_len=96,
        max_prefill_tokens=4096,
        device="cpu",
        eos_token_ids=[],
        decode="bucketed",
    )
    assert sched.decode_mode == "bucketed"
    # the CUDA attention (SDPA, query heads grouped per K/V head) for one family, the CPU one for the other
    sched._lean_step.decoder.sdpa_attention = family == "qwen3_moe"
    sched.start()
    try:
        lengths = [40, 6, 40, 17]
        done = run(sched, PROMPTS, lengths, join_after=3)
    finally:
        sched.stop()
    ref = reference(lm)
    for prompt, req, n in zip(PROMPTS, done, lengths, strict=True):
        assert req.finish_reason == {"type": "length", "length": n}
        assert_transformers_greedy(ref, prompt, req)
    assert sched.pool.free_slots == 8


def test_finished_rows_are_compacted_so_the_running_batch_is_slots_zero_to_n():
    lm = model("qwen3", seed=12)
    sched = Scheduler(
        lm, max_batch_size=8, max_seq_len=96, max_prefill_tokens=4096, device="cpu", eos_token_ids=[]
    )
    seen: list[list[int]] = []  # the running requests' slots as each decode step runs them
    compact = sched._compact

    def recording_compact() -> None:
        compact()
        seen.append([r.slot for r in sched.running])

    sched._compact = recording_compact
    sched.start()
    try:
        # all admitted in one prefill (slots 0..3); 1 and 2 finish first, leaving holes below slot 3
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
        lengths = [30, 4, 8, 30]
        done = run(sched, prompts, lengths)
    finally:
        sched.stop()
    assert seen and all(slots == list(range(len(slots))) for slots in seen)
    assert any(len(slots) == 2 for slots in seen), "requests 1 and 2 should have left two running"
    ref = reference(lm)
    for prompt, req in zip(prompts, done, strict=True):
        assert_transformers_greedy(ref, prompt, req)


def test_pool_move_and_take():
    pool = KVPool(num_layers=2, num_slots=4, max_seq_len=8, device="cpu")
    for layer in range(2):
        pool.preallocate(layer, (2, 3), (2, 5), torch.float32)
        pool.keys[layer][3, :, :6] = torch.randn(2, 6, 3)
        pool.values[layer][3, :, :6] = torch.randn(2, 6, 5)
    slots = [pool.allocate() for _ in range(4)]
    assert slots == [0, 1, 2, 3]
    pool.release(1)
    pool.move(3, 1, 6)
    for layer in range(2):
        assert torch.equal(pool.keys[layer][1, :, :6], pool.keys[layer][3, :, :6])
        assert torch.equal(pool.values[layer][1, :, :6], pool.values[layer][3, :, :6])
    pool.take(1)
    pool.release(3)
    assert pool.free_slots == 1 and pool.allocate() == 3


@pytest.mark.parametrize("cpu_step", [NATIVE, "torch"])
def test_lean_decode_sees_weight_loads_by_checkpoint_name(cpu_step):
    """The lean forward reads the model's tensors in place: loads by name (fused Q/K/V views, per-expert
    slices, embeddings) change its output exactly as they change transformers', PyTorch's ops and the
    native step alike."""
    lm = model("qwen3_moe", seed=13)
    sched = Scheduler(
        lm,
        max_batch_size=4,
        max_seq_len=64,
        max_prefill_tokens=4096,
        device="cpu",
        eos_token_ids=[],
        cpu_step=cpu_step,
    )
    assert sched.decode_mode == "lean" and sched.step.startswith(cpu_step)
    sched.start()
    try:
        before = run(sched, PROMPTS[:2], [12, 12])
        gen = torch.Generator().manual_seed(0)
        loader = NamedTensorLoader(lm)
        names = [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.mlp.experts.2.up_proj.weight",
            "model.layers.1.mlp.gate.weight",
            "model.norm.weight",
        ]
        update = [(n, torch.randn(loader.read(n).shape, generator=gen)) for n in names]
        sched.call(lambda: loader.load(update), drain=True).result(30)
        after = run(sched, PROMPTS[:2], [12, 12])
    finally:
        sched.stop()
    assert [r.output_ids for r in before] != [r.output_ids for r in after]
    ref = reference(lm)  # built from the updated weights
    for prompt, req in zip(PROMPTS[:2], after, strict=True):
        assert_transformers_greedy(ref, prompt, req)


def test_decode_mode_choice_and_errors():
    qwen = model("qwen3", seed=14)
    args = dict(max_batch_size=2, max_seq_len=32, max_prefill_tokens=64, device="cpu", eos_token_ids=[])
    assert Scheduler(qwen, **args).decode_mode == "lean"
    assert Scheduler(qwen, **args, decode="transformers").decode_mode == "transformers"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Scheduler(qwen, **args, decode="cuda_graphs")
    with pytest.raises(ValueError, match="choose one of"):
        Scheduler(qwen, **args, decode="fast")
    unfused = build_model(
        tiny_config("qwen3"),
        seed=14,
        device="cpu",
        dtype="float32",
        fuse=False,
    )
    with pytest.raises(ValueError, match="fuse_projections"):
        Scheduler(unfused, **args, decode="lean")
    auto = Scheduler(unfused, **args)
    assert auto.decode_mode == "transformers" and "fuse_projections" in auto.decode_reason


def test_buckets_cover_every_size_with_bounded_padding():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(1) == [1]
    for max_len in (8, 32, 321, 4096):
        buckets = length_buckets(max_len)
        assert buckets[-1] == max_len and buckets == sorted(set(buckets))
        for small, large in zip(buckets, buckets[1:], strict=False):
            assert large <= small * 3 // 2
        assert buckets[0] == min(32, max_len)


def test_graph_capture_that_fails_is_reported_and_the_padded_step_still_runs():
    """Without CUDA every capture fails: the failure is recorded and the step runs eagerly, still correct."""
    lm = model("qwen3", seed=15)
    pool = KVPool(lm.config.num_hidden_layers, num_slots=4, max_seq_len=40, device="cpu")
    graphs = DecodeGraphs(LeanDecoder(lm, pool), max_rows=4, max_seq_len=40, capture=True)
    graphs.capture_all()
    assert graphs.failure is not None and not graphs.graphs
    eager = EagerDecode(LeanDecoder(lm, KVPool(lm.config.num_hidden_layers, 4, 40, "cpu")))
    ids, positions = torch.tensor([5, 9, 2]), torch.tensor([0, 0, 0])
    torch.testing.assert_close(
        graphs(ids, positions, 0, True), eager(ids, positions, 0, True), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    ("cpu_step", "attention"),
    [pytest.param(*NATIVE.values, "auto", marks=NATIVE.marks), ("torch", "auto"), ("torch", "torch")],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_bursts_equal_transformers_and_a_stop_token_ends_its_row_mid_burst(
    family, cpu_step, attention
):
    """Several lean decode steps per scheduler iteration (tokens read by the host once per burst): a row whose
    stop token comes in the middle of a burst ends exactly there, the others go on, and every row still equals
    transformers' greedy tokens and teacher-forced logprobs; with the native step, and with PyTorch's ops with
    the native CPU attention where it builds (auto) and with PyTorch's matmuls."""
    # seeds whose greedy output has a first-time token inside the first burst (random tiny models repeat)
    lm = model(family, seed={"qwen3": 17, "qwen3_moe": 16}[family])
    ref = reference(lm)
    greedy = ref.generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(PROMPTS[0]) :].tolist()
    # token 0 comes from the prefill, tokens 1..8 from the first burst: stop on one inside it
    stop_index = next(j for j in range(2, 8) if greedy[j] not in greedy[:j])
    sched = Scheduler(
        lm,
        max_batch_size=4,
        max_seq_len=96,
        max_prefill_tokens=4096,
        device="cpu",
        eos_token_ids=[],
        decode_burst=8,
        cpu_attention=attention,
        cpu_step=cpu_step,
    )
    assert sched.step.startswith(cpu_step)
    assert sched.attention.startswith("torch" if attention == "torch" else ("native", "torch"))
    appended: list[int] = []  # tokens handed to the requests per scheduler iteration
    append = sched._append

    def recording_append(reqs, tokens, logprobs) -> None:
        appended.append(len(tokens[0]))
        append(reqs, tokens, logprobs)

    sched._append = recording_append
    done: dict[str, Request] = {}
    finished = threading.Event()

    def on_done(req: Request) -> None:
        done[req.rid] = req
        if len(done) == 2:
            finished.set()

    stopping = Request(
        input_ids=PROMPTS[0],
        params=SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=[greedy[stop_index]]),
        rid="stop",
        on_done=on_done,
    )
    running_on = Request(
        input_ids=PROMPTS[1],
        params=SamplingParams(max_new_tokens=30, temperature=0),
        rid="on",
        on_done=on_done,
    )
    sched.submit(stopping)  # both wait before the thread starts: one prefill, then bursts
    sched.submit(running_on)
    sched.start()
    try:
        assert finished.wait(60)
    finally:
        sched.stop()
    assert done["stop"].output_ids == greedy[: stop_index + 1]
    assert done["stop"].finish_reason == {"type": "stop", "matched": greedy[stop_index]}
    assert len(done["stop"].output_logprobs) == stop_index + 1
    assert done["on"].finish_reason == {"type": "length", "length": 30}
    assert_transformers_greedy(ref, PROMPTS[0], done["stop"])
    assert_transformers_greedy(ref, PROMPTS[1], done["on"])
    # one prefill token, then bursts of 8 up to the length limit (29 = 8 + 8 + 8 + 5)
    assert appended == [1, 8, 8, 8, 5]
    assert sched.steps == 30 and sched.pool.free_slots == 4


def test_decode_burst_must_be_positive():
    with pytest.raises(ValueError, match="decode_burst=0 must be >= 1"):
        Scheduler(
            model("qwen3", seed=17),
            max_batch_size=2,
            max_seq_len=32,
            max_prefill_tokens=64,
            device="cpu",
            eos_token_ids=[],
            decode_burst=0,
        )

"""The engine's weight relayout (rollout/embedded/arena.py) and the decode paths after it.

Runs of checkpoint names become back to back in one arena (what a weight sync needs to receive a run with one
broadcast), values stay bitwise equal, tensor objects and the fused views stay what they were, runs that
cannot be laid out are skipped with a reason, and a scheduler (lean decode with PyTorch's ops or the native
step, and the bucketed padding of the CUDA-graph step) generates the same tokens after
``Scheduler.weights_moved()`` and sees later weight loads, which land in the arena. CUDA graphs themselves
are checked only as far as a CPU allows: that they are dropped and captured again when the pool is free.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tidal.rollout.embedded import native_step
from tidal.rollout.embedded.arena import relayout
from tidal.rollout.embedded.decode_step import DecodeGraphs
from tidal.rollout.embedded.model import NamedTensorLoader, build_model
from tidal.rollout.embedded.sampling import SamplingParams
from tidal.rollout.embedded.scheduler import Request, Scheduler
from tidal.rollout.embedded.testing import PROMPTS, tiny_config
from tidal.weights_sync.receiver import byte_span

NATIVE_LIB, NATIVE_HOW = native_step.load()
NEEDS_NATIVE = pytest.mark.skipif(NATIVE_LIB is None, reason=f"native step unavailable: {NATIVE_HOW}")
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]])


def model(family: str = "qwen3", seed: int = 0, **overrides):
    return build_model(tiny_config(family, **overrides), seed=seed, device="cpu", dtype="float32")


def layer_run(lm, i: int) -> list[str]:
    """One layer's checkpoint names in a sync's order: several parameters, the fused Q/K/V whole (megatron's
    grouped rows, as tidal's sender sends them) and gate/up (MoE: the experts' per-expert slices, gate and
    up of each expert in turn, then each expert's down)."""
    p = f"model.layers.{i}."
    names = [p + "input_layernorm.weight"]
    names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight"]
    names += [
        p + "self_attn.q_norm.weight",
        p + "self_attn.k_norm.weight",
        p + "post_attention_layernorm.weight",
    ]
    experts = getattr(lm.config, "num_experts", 0)
    if not experts:
        return names + [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    names.append(p + "mlp.gate.weight")
    for e in range(experts):
        names += [p + f"mlp.experts.{e}.gate_proj.weight", p + f"mlp.experts.{e}.up_proj.weight"]
    return names + [p + f"mlp.experts.{e}.down_proj.weight" for e in range(experts)]


def all_runs(lm) -> list[list[str]]:
    layers = [layer_run(lm, i) for i in range(lm.config.num_hidden_layers)]
    return [*layers, ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]]


def spans(loader: NamedTensorLoader, runs: list[list[str]]) -> list[bool]:
    return [byte_span([loader.resolve(n) for n in run]) is not None for run in runs]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_runs_become_back_to_back_with_values_objects_and_views_kept(family):
    lm = model(family)
    loader = NamedTensorLoader(lm)
    runs = all_runs(lm)
    assert spans(loader, runs) == [False] * len(runs)
    state = {k: v.clone() for k, v in lm.state_dict().items()}
    params = dict(lm.named_parameters())
    attn = lm.model.layers[0].self_attn
    qkv = attn.qkv_weight
    with torch.no_grad():
        logits = lm(IDS).logits

    report = relayout(lm, runs, loader.resolve)

    assert report.skipped == [] and report.laid == runs, str(report)
    assert spans(loader, runs) == [True] * len(runs)
    total = sum(p.numel() * p.element_size() for p in lm.parameters())
    assert report.bytes_relocated == total and report.old_bytes_still_referenced == 0
    # one arena for the lot: named_parameters reports it
    assert len({p.untyped_storage().data_ptr() for p in lm.parameters()}) == 1
    after = lm.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(state[k], after[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(lm(IDS).logits, logits)
    assert all(p is params[n] for n, p in lm.named_parameters())
    assert attn.qkv_weight is qkv and attn.q_proj.weight is params["model.layers.0.self_attn.q_proj.weight"]
    # the views still alias the fused matrix (grouped rows: per KV group its q rows, k rows, v rows): a
    # load by name writes it
    groups, q_rows, hidden = attn.q_proj.weight.shape
    grouped = qkv.view(groups, -1, hidden)
    assert attn.k_proj.weight.data_ptr() == grouped[:, q_rows:].data_ptr()
    name = "model.layers.0.self_attn.k_proj.weight"
    new = torch.randn(loader.read(name).shape)
    loader.load([(name, new)])
    k_rows = attn.k_proj.weight.shape[1]
    assert torch.equal(grouped[:, q_rows : q_rows + k_rows].reshape(new.shape), new)


def test_runs_that_cannot_be_laid_out_are_skipped_with_reasons():
    lm = model()
    loader = NamedTensorLoader(lm)
    attn = "model.layers.0.self_attn."
    mlp = "model.layers.1.mlp."

    def resolve(name: str) -> torch.Tensor:  # one target seen transposed: not contiguous
        t = loader.resolve(name.removesuffix(".T"))
        return t.t() if name.endswith(".T") else t

    runs = [
        [mlp + "gate_proj.weight"],  # up missing: part of gate_up_weight
        # HF's q/k/v are strided views of the grouped fused rows (a sync sends the fused matrix whole)
        [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"],
        [mlp + "up_proj.weight", mlp + "gate_proj.weight"],  # wrong order
        [attn + "o_proj.weight.T"],
        ["model.layers.9.mlp.up_proj.weight"],  # no such layer
        [mlp + "gate_proj.weight", mlp + "up_proj.weight"],  # fine
        [mlp + "down_proj.weight", mlp + "gate_proj.weight", mlp + "up_proj.weight"],  # gate_up taken
        [],
    ]
    before = {n: p.data_ptr() for n, p in lm.named_parameters()}
    report = relayout(lm, runs, resolve)
    assert report.laid == [runs[5]]
    reasons = dict((tuple(names), why) for names, why in report.skipped)
    assert len(reasons) == 7, str(report)
    assert "used up to" in reasons[tuple(runs[0])]
    assert "not contiguous" in reasons[tuple(runs[1])]
    assert "partial coverage" in reasons[tuple(runs[2])]
    assert "not contiguous" in reasons[tuple(runs[3])]
    assert "cannot resolve" in reasons[tuple(runs[4])]
    assert "already laid out" in reasons[tuple(runs[6])]
    assert "empty" in reasons[()]
    assert "skipped" in str(report)
    moved = {n for n, p in lm.named_parameters() if p.data_ptr() != before[n]}
    assert moved == {mlp + "gate_proj.weight", mlp + "up_proj.weight"}


def test_a_partial_fused_run_in_the_middle_and_mixed_dtypes_are_skipped():
    lm = model()
    lm.model.norm.to(torch.bfloat16)
    loader = NamedTensorLoader(lm)
    attn = "model.layers.0.self_attn."
    runs = [
        [attn + "o_proj.weight", "model.layers.0.mlp.gate_proj.weight", attn + "q_norm.weight"],
        ["model.layers.1.input_layernorm.weight", "model.norm.weight"],
    ]
    report = relayout(lm, runs, loader.resolve)
    assert report.laid == []
    assert "uncovered" in report.skipped[0][1]
    assert "mixed dtypes" in report.skipped[1][1]


def test_tied_embeddings_stay_tied():
    lm = model(tie_word_embeddings=True)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    loader = NamedTensorLoader(lm)
    with torch.no_grad():
        logits = lm(IDS).logits
    runs = [
        ["model.embed_tokens.weight", "lm_head.weight"],  # one tensor twice: not back to back
        ["model.embed_tokens.weight", "model.norm.weight"],
    ]
    report = relayout(lm, runs, loader.resolve)
    assert report.laid == [runs[1]] and "does not follow" in report.skipped[0][1]
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    assert lm.lm_head.weight.data_ptr() + lm.lm_head.weight.nbytes == lm.model.norm.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(lm(IDS).logits, logits)


def test_extra_tensors_that_alias_weights_are_re_pointed():
    lm = model()
    loader = NamedTensorLoader(lm)
    qkv = lm.model.layers[0].self_attn.qkv_weight
    scratch = {"rows": qkv[4:8], "outside": torch.zeros(3)}
    expected = scratch["rows"].clone()
    runs = [["model.layers.0.self_attn." + f"{x}_proj.weight" for x in ("qkv", "o")]]
    report = relayout(lm, runs, loader.resolve, extra=scratch.values())
    assert report.laid == runs and report.old_bytes_still_referenced == 0, str(report)
    assert scratch["rows"].data_ptr() == qkv[4:8].data_ptr() and torch.equal(scratch["rows"], expected)


def test_without_extra_a_kept_view_holds_its_old_storage_and_the_report_says_so():
    lm = model()
    loader = NamedTensorLoader(lm)
    kept = lm.model.norm.weight[:8]  # a view the caller did not pass: it keeps the old storage alive
    report = relayout(lm, [["model.norm.weight", "lm_head.weight"]], loader.resolve)
    assert report.old_bytes_still_referenced == lm.model.norm.weight.nbytes
    assert kept.data_ptr() != lm.model.norm.weight.data_ptr()
    assert "still referenced" in str(report)


# ---------------------------------------------------------------- the scheduler after a relayout


def generate(sched: Scheduler, prompts: list[list[int]], n: int) -> list[list[int]]:
    done: dict[str, Request] = {}
    finished = threading.Event()

    def on_done(req: Request) -> None:
        done[req.rid] = req
        if len(done) == len(prompts):
            finished.set()

    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=n, temperature=0)
        sched.submit(Request(input_ids=prompt, params=params, rid=str(i), on_done=on_done))
    assert finished.wait(120), f"only {len(done)}/{len(prompts)} finished"
    return [done[str(i)].output_ids for i in range(len(prompts))]


def scheduler(lm, decode: str, cpu_step: str) -> Scheduler:
    return Scheduler(
        lm,
        max_batch_size=4,
        max_seq_len=64,
        max_prefill_tokens=4096,
        device="cpu",
        eos_token_ids=[],
        decode=decode,
        cpu_step=cpu_step,
    )


UPDATE = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.mlp.experts.2.up_proj.weight",
    "model.layers.1.mlp.gate.weight",
    "model.layers.0.mlp.experts.0.down_proj.weight",
    "model.norm.weight",
]


def new_weights(loader: NamedTensorLoader) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(n, torch.randn(loader.read(n).shape, generator=gen)) for n in UPDATE]


@pytest.mark.parametrize(
    ("decode", "cpu_step"),
    [pytest.param("lean", "native", marks=NEEDS_NATIVE), ("lean", "torch"), ("bucketed", "torch")],
)
def test_scheduler_generates_the_same_after_relayout_and_sees_later_loads(decode, cpu_step):
    """Same greedy tokens before and after relayout + weights_moved; then a load by name (into the arena)
    changes them exactly as it changes an engine whose weights never moved."""
    lm = model("qwen3_moe", seed=3)
    sched = scheduler(lm, decode, cpu_step)
    assert sched.decode_mode == decode and sched.step.startswith(cpu_step)
    loader = NamedTensorLoader(lm)
    sched.start()
    try:
        before = generate(sched, PROMPTS, 10)
        moved = sched.call(lambda: relayout(lm, all_runs(lm), loader.resolve), drain=True).result(60)
        sched.call(sched.weights_moved).result(30)
        assert moved.skipped == [] and moved.old_bytes_still_referenced == 0, str(moved)
        assert generate(sched, PROMPTS, 10) == before
        sched.call(lambda: loader.load(new_weights(loader)), drain=True).result(30)
        updated = generate(sched, PROMPTS, 10)
    finally:
        sched.stop()
    assert sched.step.startswith(cpu_step)
    assert updated != before
    control = model("qwen3_moe", seed=3)  # the same model and load, without a relayout
    control_loader = NamedTensorLoader(control)
    control_loader.load(new_weights(control_loader))
    other = scheduler(control, decode, cpu_step)
    other.start()
    try:
        assert generate(other, PROMPTS, 10) == updated
    finally:
        other.stop()


def test_weights_moved_drops_cuda_graphs_and_captures_again_once_the_pool_is_free(monkeypatch):
    """CPU stand-in for CUDA graphs: a graph entry is dropped by weights_moved, and the scheduler captures
    again before its next step, once no request holds a KV slot."""
    lm = model()
    sched = scheduler(lm, "bucketed", "torch")
    step = sched._lean_step
    assert isinstance(step, DecodeGraphs)
    captured = []
    monkeypatch.setattr(step, "capture", True)  # as on CUDA; capture_all itself is replaced
    monkeypatch.setattr(
        step, "capture_all", lambda: (captured.append(sched.pool.free_slots), setattr(step, "stale", False))
    )
    step.graphs[(1, 32)] = object()  # a graph over the old addresses; never replayed here
    sched.start()
    try:
        sched.call(lambda: sched.pause("in_place")).result(30)
        assert captured == [4]  # at start
        sched.call(sched.weights_moved).result(30)
        assert step.graphs == {} and step.stale  # paused: not captured yet
        slot = sched.call(sched.pool.allocate).result(30)
        assert not sched._graphs_stale()  # a capture would write padding rows over a held slot's cache
        sched.call(lambda: sched.pool.release(slot)).result(30)
        sched.call(sched.resume).result(30)
        assert generate(sched, PROMPTS[:2], 4)
    finally:
        sched.stop()
    assert captured == [4, 4] and not step.stale

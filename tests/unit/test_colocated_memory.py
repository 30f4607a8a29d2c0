"""Sleep / wake of the embedded engine on CPU: storages really shrink to zero bytes, generation waits while
memory is released, and a woken engine's greedy output equals what it produced before sleeping.

The same code frees CUDA memory on a GPU (tests/gpu/test_gpu_colocated.py checks torch.cuda.memory_allocated);
CUDA graphs are exercised there only.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tidal.model_config import ModelConfig
from tidal.rollout.config import EmbeddedEngineConfig
from tidal.rollout.embedded.memory import TAGS, MemoryStateError, check_tags
from tidal.rollout.embedded.memory_routes import engine_memory, memory_released, release_memory, resume_memory
from tidal.rollout.embedded.sampling import SamplingParams
from tidal.rollout.embedded.service import EmbeddedEngine, GenerateInput

MODEL = ModelConfig(
    family="qwen3_moe",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)
PROMPTS = [[1, 2, 3], [5, 7, 11, 13], [4]]


def _greedy(engine: EmbeddedEngine) -> list[list[int]]:
    async def go():
        inputs = [
            GenerateInput(
                input_ids=p, params=SamplingParams(max_new_tokens=8, temperature=0), return_logprob=False
            )
            for p in PROMPTS
        ]
        return [r.output_ids for r in await engine.generate(inputs)]

    return asyncio.run(go())


@pytest.fixture
def engine():
    eng = EmbeddedEngine(MODEL, EmbeddedEngineConfig(max_batch_size=4, max_seq_len=32), seed=3)
    eng.start()
    yield eng
    eng.close()


def _stored_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_release_frees_weights_and_kv_and_resume_restores_greedy_output(engine):
    before = _greedy(engine)
    params = [p for _, p in engine.lm.named_parameters()]
    pool = engine.scheduler.pool
    kv = [t for t in (*pool.keys, *pool.values) if t is not None]
    weight_bytes, kv_bytes = _stored_bytes(params), _stored_bytes(kv)
    assert weight_bytes > 0 and kv_bytes > 0

    freed = asyncio.run(release_memory(engine, None))
    assert freed == {"kv_cache": kv_bytes, "weights": weight_bytes, "cuda_graph": 0}
    assert _stored_bytes(params) == 0 and _stored_bytes(kv) == 0
    assert engine.scheduler.paused == "released"
    assert "resume_memory_occupation" in memory_released(engine)

    # a request sent while asleep waits; it runs once the engine wakes
    async def asleep_then_wake():
        inp = GenerateInput(
            input_ids=PROMPTS[0], params=SamplingParams(max_new_tokens=8, temperature=0), return_logprob=False
        )
        task = asyncio.ensure_future(engine.generate([inp]))
        await asyncio.sleep(0.3)
        assert not task.done(), "the engine generated with its memory released"
        await resume_memory(engine, ["weights"])
        assert engine.scheduler.paused == "released"  # the KV cache is still released
        await asyncio.sleep(0.2)
        assert not task.done()
        await resume_memory(engine, ["kv_cache", "cuda_graph"])
        return (await asyncio.wait_for(task, 60))[0].output_ids

    assert asyncio.run(asleep_then_wake()) == before[0]
    assert engine.scheduler.paused is None and memory_released(engine) is None
    assert _stored_bytes(params) == weight_bytes and _stored_bytes(kv) == kv_bytes
    assert _greedy(engine) == before


def test_release_keeps_a_pause_that_was_there_and_refuses_running_requests(engine):
    memory = engine_memory(engine)
    asyncio.run(engine.pause("retract"))
    asyncio.run(release_memory(engine, ["kv_cache"]))
    asyncio.run(resume_memory(engine, ["kv_cache"]))
    assert engine.scheduler.paused == "retract"  # the caller's pause outlives the sleep
    asyncio.run(engine.resume())

    engine.scheduler.running.append(object())  # as if a request were decoding
    try:
        with pytest.raises(MemoryStateError, match="pause_generation with mode='retract'"):
            memory.release(["kv_cache"])
    finally:
        engine.scheduler.running.clear()
    assert not memory.released


def test_tags_are_checked():
    assert check_tags(None) == list(TAGS) and check_tags([]) == list(TAGS)
    assert check_tags(["weights", "weights"]) == ["weights"]
    with pytest.raises(MemoryStateError, match=r"unknown memory tag\(s\) \['kv'\]"):
        check_tags(["kv"])


def test_weights_written_while_awake_survive_a_sleep(engine):
    name = "model.layers.0.self_attn.o_proj.weight"
    target = engine.loader.resolve(name)
    new = torch.randn_like(target)
    asyncio.run(engine._call(lambda: engine.loader.load([(name, new)]), drain=True))
    asyncio.run(release_memory(engine, ["weights"]))
    asyncio.run(resume_memory(engine, None))
    assert torch.equal(engine.loader.resolve(name), new)

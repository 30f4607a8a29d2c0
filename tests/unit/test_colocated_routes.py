"""The colocated routes of a real ``tidal serve`` process on CPU: sleep / wake over HTTP, and the clear
refusal of CUDA IPC updates by a CPU engine (the GPU suite runs the IPC path itself)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tidal.rollout.embedded.testing import served_engine
from tidal.weights_sync import bucket
from tidal.weights_sync.colocated import serialize_bucket

pytestmark = pytest.mark.slow

MODEL = dict(
    family="qwen3",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=48,
)
GREEDY = {"input_ids": [3, 5, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_engine(
        MODEL,
        "seed=2",
        "rollout.engine.max_batch_size=4",
        "rollout.engine.max_seq_len=32",
        "rollout.engine.num_threads=1",
        log_path=tmp_path_factory.mktemp("colocated_routes") / "serve.log",
        start_timeout_s=120,
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def engine(served):
    return served.url


def test_the_served_engine_helper_closes_the_http_session_its_start_opened(served):
    # opened by the health probes on a loop that is gone once the engine is up: left open, the GC
    # reports it ("Unclosed client session") in whichever test happens to collect it
    session = served.client._session
    assert session is not None and session.closed


def test_cpu_engine_refuses_cuda_ipc_updates_with_the_way_out(engine):
    import torch

    buf, spec = bucket.pack([("model.norm.weight", torch.ones(32))])
    body = {"serialized_named_tensors": [serialize_bucket(buf, spec)], "load_format": "flattened_bucket"}
    resp = httpx.post(f"{engine}/update_weights_from_tensor", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert "needs a CUDA engine; this engine runs on cpu" in resp.json()["message"]
    assert "update_weights_from_distributed" in resp.json()["message"]
    missing = httpx.post(f"{engine}/update_weights_from_tensor", json={"load_format": None}, timeout=30)
    assert missing.status_code == 400 and "serialized_named_tensors" in missing.text
    assert httpx.get(f"{engine}/server_info", timeout=30).json()["gpu_uuid"] is None


def test_sleep_and_wake_over_http_keep_greedy_output(engine):
    http = httpx.Client(base_url=engine, timeout=60)
    before = http.post("/generate", json=GREEDY).json()["output_ids"]

    bad = http.post("/release_memory_occupation", json={"tags": ["kv"]})
    assert bad.status_code == 400 and "unknown memory tag(s) ['kv']" in bad.json()["error"]["message"]
    assert http.post("/release_memory_occupation", json={"tags": None}).status_code == 200
    refused = http.post("/continue_generation", json={})
    assert refused.status_code == 400 and "/resume_memory_occupation" in refused.json()["error"]["message"]

    done: dict = {}
    waiting = threading.Thread(
        target=lambda: done.update(out=httpx.post(f"{engine}/generate", json=GREEDY, timeout=60).json())
    )
    waiting.start()
    time.sleep(0.5)
    assert not done, "the engine generated while its memory was released"
    assert http.post("/resume_memory_occupation", json={}).status_code == 200
    waiting.join(60)
    assert done["out"]["output_ids"] == before
    assert http.post("/generate", json=GREEDY).json()["output_ids"] == before
    http.close()


def test_sender_puts_engines_to_sleep_for_a_step_and_wakes_them_for_the_sync(engine):
    """The trainer side's orchestration over HTTP (no bucket is sent: CUDA IPC needs a GPU, so the
    sender is given a CUDA device name it never touches and an empty source)."""
    import torch

    from tidal.weights_sync.colocated import ColocatedSender
    from tidal.weights_sync.config import WeightSyncConfig
    from tidal.weights_sync.engine_api import EngineEndpoint

    http = httpx.Client(base_url=engine, timeout=60)
    before = http.post("/generate", json=GREEDY).json()["output_ids"]
    sender = ColocatedSender(WeightSyncConfig(), [EngineEndpoint(engine)], device=torch.device("cuda", 0))
    try:
        assert sender.sleep() == [] and sender.asleep == {engine}
        state = http.get("/server_info").json()["internal_states"][0]
        assert state["paused"] == "retract"  # retracted, then released
        assert http.post("/continue_generation", json={}).status_code == 400

        done: dict = {}
        waiting = threading.Thread(
            target=lambda: done.update(out=httpx.post(f"{engine}/generate", json=GREEDY, timeout=60).json())
        )
        waiting.start()
        time.sleep(0.5)
        assert not done, "an asleep engine generated"
        report = sender.sync(lambda: iter([]), version=5)  # wakes, pauses in place, loads nothing, continues
        assert report.ok and report.buckets == 0 and not sender.asleep
        waiting.join(60)
        assert done["out"]["output_ids"] == before
        assert http.get("/server_info").json()["internal_states"][0]["paused"] is None

        sender.sleep()
        assert sender.wake() == [] and not sender.asleep
        assert http.post("/generate", json=GREEDY).json()["output_ids"] == before
    finally:
        sender.close()
        http.close()

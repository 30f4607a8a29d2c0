"""The colocated-sync benchmark's engine stand-in takes SGLang's ``/update_weights_from_tensor`` body.

The benchmark itself needs CUDA (IPC handles); its routes do not. A body the route's model cannot see (a
postponed annotation FastAPI cannot resolve turns ``body`` into a query parameter) made every request a 422
that the trainer only saw as a dropped engine, on the H200; here the route must reach its handler.
"""

import sys
from pathlib import Path

import torch
from fastapi.testclient import TestClient

from tidal.rollout.embedded.model import NamedTensorLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from colocated_sync import engine_app  # noqa: E402


def client() -> tuple[TestClient, dict]:
    loader = NamedTensorLoader(torch.nn.Linear(2, 2))
    stats = {"decode_s": 0.0, "load_s": 0.0, "bytes": 0, "requests": 0}
    return TestClient(engine_app(loader, stats)), stats


def test_update_body_reaches_the_handler_and_a_bad_payload_is_a_400_naming_why():
    http, stats = client()
    body = {
        "serialized_named_tensors": ["not a payload"],
        "load_format": "flattened_bucket",
        "flush_cache": True,
        "weight_version": "1",
    }
    reply = http.post("/update_weights_from_tensor", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["success"] is False and reply.json()["message"]
    assert stats["requests"] == 0


def test_weight_update_routes_and_stats_answer():
    http, _ = client()
    for route in ("/begin_weight_update", "/end_weight_update", "/pause_generation", "/continue_generation"):
        assert http.post(route).json()["success"] is True
    assert http.post("/tidal/stats").json() == {"decode_s": 0.0, "load_s": 0.0, "bytes": 0, "requests": 0}

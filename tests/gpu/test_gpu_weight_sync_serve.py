"""A trainer-shaped sender on GPU 0 syncs `tidal serve` on GPU 1 over NCCL: the first update announced,
the next ones replayed (weights_sync/replay.py) with megatron's fused QKV sent whole (grouped_qkv), every
engine tensor bitwise equal to the trainer's, and generation afterwards equal to an engine that kept its
own layout (``relayout_weights=false``) when the weights moved into one arena (``true``: CUDA graphs recaptured).
"""

from __future__ import annotations

import math

import pytest
import torch

from tidal.model_config import ModelConfig
from tidal.procs import free_port, python_cmd, spawn, stop, wait_for_tcp
from tidal.rollout.embedded.model import build_model
from tidal.rollout.embedded.testing import TINY_QWEN3, served_greedy, served_weight
from tidal.weights_sync.config import WeightSyncConfig
from tidal.weights_sync.engine_api import EngineEndpoint
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.sender import WeightSender

pytestmark = pytest.mark.gpu

MODEL = dict(TINY_QWEN3, num_hidden_layers=3)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _need_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(
            f"the sender and the engine need a GPU each (NCCL refuses two ranks of one group on one GPU); "
            f"this host has {torch.cuda.device_count()}"
        )


def _trainer_state(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """HF weights of seed ``seed`` (bf16) and their megatron tensors in one DDP-like CUDA buffer, last first."""
    lm = build_model(ModelConfig(**MODEL), seed=seed, device="cpu", dtype="bfloat16", fuse=False)
    hf = {n: p.detach().clone() for n, p in lm.named_parameters()}
    full = dict(mapping_for(ModelConfig(**MODEL)).to_megatron(hf))
    sizes = {n: math.ceil(t.numel() / 64) * 64 for n, t in full.items()}
    buffer = torch.zeros(sum(sizes.values()), dtype=torch.bfloat16, device="cuda:0")
    state, end = {}, buffer.numel()
    for name, t in full.items():
        end -= sizes[name]
        state[name] = buffer[end : end + t.numel()].view(t.shape)
        state[name].copy_(t)
    return hf, state


def _served(url: str, name: str) -> torch.Tensor:
    return served_weight(url, name, truncate_size=1 << 22, timeout_s=60)


def _greedy(url: str) -> list[int]:
    return served_greedy(url, PROMPT, max_new_tokens=12, timeout_s=120)


def _sync_three_times(relayout: str, tmp_path) -> tuple[list[int], str]:
    port = free_port()
    cmd = python_cmd(
        "serve",
        *[f"model.{k}={v}" for k, v in MODEL.items()],
        "rollout.engine.device=cuda",
        "rollout.engine.dtype=bfloat16",
        "rollout.engine.max_batch_size=4",
        "rollout.engine.max_seq_len=64",
        "rollout.engine.weight_update_timeout_s=60",
        f"rollout.engine.relayout_weights={relayout}",
        "--port",
        str(port),
    )
    log = tmp_path / f"serve_{relayout}.log"
    proc = spawn(cmd, log, env={"CUDA_VISIBLE_DEVICES": "1"})
    url = f"http://127.0.0.1:{port}"
    mapping = mapping_for(ModelConfig(**MODEL))
    sender = None
    try:
        wait_for_tcp("127.0.0.1", port, timeout_s=300, proc=proc)
        config = WeightSyncConfig(timeout_s=60, own_broadcast_bytes=8 << 10)
        sender = WeightSender(config, [EngineEndpoint(url)], backend="nccl", device="cuda:0")
        for version, seed in [(1, 41), (2, 42), (3, 43)]:
            hf, state = _trainer_state(seed)

            def source(state=state):
                for name, t in state.items():
                    yield from mapping.to_hf(name, t, packable=True)

            report = sender.sync(source, version=version)
            assert report.ok and report.replayed == (version > 1), report
            differ = [n for n, t in hf.items() if not torch.equal(_served(url, n), t.float())]
            assert not differ, f"relayout={relayout} version {version}: not bitwise: {differ[:5]}"
        return _greedy(url), log.read_text()
    finally:
        if sender is not None:
            sender.close()
        stop(proc, timeout_s=10)


def test_replayed_nccl_syncs_land_bitwise_and_a_relaid_engine_generates_the_same(tmp_path):
    _need_two_gpus()
    kept, _ = _sync_three_times("false", tmp_path)
    relaid, log = _sync_three_times("true", tmp_path)
    assert "weights laid out for in-place updates" in log
    assert relaid == kept

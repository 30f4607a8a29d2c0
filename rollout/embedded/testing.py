"""Tiny engine models shared by the engine's tests (CPU and GPU): shapes per family, and prompts."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from pathlib import Path

from tidal.model_config import ModelConfig

_GQA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)

TINY_SHAPES: dict[str, dict] = {
    "qwen3": dict(**_GQA, intermediate_size=96),
    "qwen3_moe": dict(**_GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    # MLA caches one latent "head"; HF's DeepseekV3 needs kv heads == heads and head_dim == rope dim
    "deepseek_v3": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=96,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
}

# different lengths, so that batched rows are padded and finish apart
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3, 1, 4, 1, 5, 9, 2]]


def tiny_config(family: str, **overrides) -> ModelConfig:
    """A two-layer, 96-token-vocabulary model of ``family`` (fields of ``overrides`` replace the shape's)."""
    return ModelConfig(family=family, vocab_size=96, num_hidden_layers=2, **(TINY_SHAPES[family] | overrides))


# the qwen3 model above as ModelConfig fields, for `tidal serve model.KEY=VALUE` overrides
TINY_QWEN3 = dict(family="qwen3", vocab_size=96, num_hidden_layers=2, **TINY_SHAPES["qwen3"])


def served_greedy(url: str, prompt: list[int], max_new_tokens: int, timeout_s: float = 60.0) -> list[int]:
    """A `tidal serve` engine's greedy continuation of ``prompt`` (token ids; EOS ignored)."""
    import httpx

    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    resp = httpx.post(f"{url}/generate", json=body, timeout=timeout_s)
    resp.raise_for_status()
    return resp.json()["output_ids"]


def served_weight(url: str, name: str, truncate_size: int, timeout_s: float = 30.0):
    """A `tidal serve` engine's tensor ``name`` (flattened, its first ``truncate_size`` values) as fp32;
    exact for fp32 and bf16 weights (fp32 -> JSON double -> fp32)."""
    import httpx
    import torch

    body = {"name": name, "truncate_size": truncate_size}
    resp = httpx.post(f"{url}/get_weights_by_name", json=body, timeout=timeout_s)
    resp.raise_for_status()
    return torch.tensor(resp.json(), dtype=torch.float32)


@contextmanager
def served_engine(model: dict, *overrides: str, log_path: Path, start_timeout_s: float = 180.0):
    """A `tidal serve` process of ``model`` (ModelConfig fields) with config ``overrides``, started and
    healthy on a free port; killed on exit."""
    from tidal.procs import free_port, python_cmd
    from tidal.rollout.sglang_launcher import EngineProcess

    port = free_port()
    args = [f"model.{k}={v}" for k, v in model.items()] + list(overrides)
    proc = EngineProcess(
        python_cmd("serve", *args, "--port", str(port)),
        f"http://127.0.0.1:{port}",
        log_path=log_path,
        start_timeout_s=start_timeout_s,
    )

    async def start() -> None:
        await proc.start()
        # its HTTP session belongs to this short-lived loop: closed here, not left for the GC to report
        await proc.client.close()

    asyncio.run(start())
    try:
        yield proc
    finally:
        proc.kill()

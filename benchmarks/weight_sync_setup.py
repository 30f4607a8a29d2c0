"""What a weight-sync benchmark run syncs, and into what (benchmarks/weight_sync.py): Qwen3 models by size
and the fixed-cost ones, their megatron-core tensors as the sender's source (one rank holding them whole,
or a real model on a TP mesh under torchrun), and the engine processes that receive them.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from tidal.model_config import ModelConfig
from tidal.procs import free_port, python_cmd, spawn, stop, wait_for_tcp
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.gather import GatherTimes
from tidal.weights_sync.tiny_models import megatron_shapes


def model_for_bytes(target: int, dtype_bytes: int) -> ModelConfig:
    """A Qwen3 architecture whose weights take about ``target`` bytes."""
    if target <= 64 << 20:
        hidden, vocab = 256, 2048
    elif target <= 512 << 20:
        hidden, vocab = 512, 8192
    elif target <= 8 << 30:
        hidden, vocab = 1024, 8192
    else:  # tens of GB (GPU runs): fewer, larger tensors, as real models of that size have
        hidden, vocab = 4096, 32768
    inter, head_dim = 3 * hidden, 64
    heads, kv = hidden // head_dim, max(1, hidden // head_dim // 2)
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inter + 2 * hidden + 2 * head_dim
    layers = max(1, round((target / dtype_bytes - 2 * vocab * hidden) / per_layer))
    return ModelConfig(
        family="qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
    )


# megatron's DDP with the distributed optimizer starts each parameter at a multiple of 64 elements
_DDP_ALIGN = 64


def megatron_state(
    model: ModelConfig, dtype: torch.dtype, device: str, layout: str = "ddp"
) -> dict[str, torch.Tensor]:
    """Full megatron-core tensors of ``model`` (values are irrelevant to throughput: constant fill).

    ``layout="ddp"``: views into one buffer, as the trainer's parameters are under megatron's
    DistributedDataParallel with the distributed optimizer (tidal's default): the last parameter first, each
    starting at a multiple of 64 elements. ``"separate"``: one allocation per tensor."""
    mapping = mapping_for(model)
    shapes = megatron_shapes(model)
    for name in shapes:
        mapping.rule_for(name)  # every benchmark tensor is one the mapping knows
    if layout == "separate":
        return {n: torch.full(s, 0.5, dtype=dtype, device=device) for n, s in shapes.items()}
    offsets, end = {}, 0
    for name in reversed(shapes):
        offsets[name] = end
        end += -(-math.prod(shapes[name]) // _DDP_ALIGN) * _DDP_ALIGN
    buffer = torch.full((end,), 0.5, dtype=dtype, device=device)
    return {n: buffer[offsets[n] : offsets[n] + math.prod(s)].view(s) for n, s in shapes.items()}


def start_receivers(
    n: int, logdir: Path, args, model: ModelConfig | None = None, first_gpu: int | None = None
):
    """``n`` engine processes: stand-ins, or ``tidal serve`` engines of ``model`` (``--engine serve``).
    With ``first_gpu``, engine i sees only GPU first_gpu + i (NCCL refuses two ranks of one group on the
    same GPU, so the sender keeps GPU 0)."""
    procs, urls = [], []
    for i in range(n):
        port = free_port()
        if args.engine == "serve":
            assert model is not None
            # every field, so that nothing of the default job's model (the CLI's base config) leaks in
            fields = {
                k: v for k, v in model.model_dump().items() if v is not None and not isinstance(v, list)
            }
            cmd = python_cmd(
                "serve",
                *[f"model.{k}={v}" for k, v in fields.items()],
                "rollout.engine.max_batch_size=1",
                "rollout.engine.max_seq_len=64",  # its KV cache stays small beside the weights
                f"rollout.engine.dtype={args.dtype}",
                f"rollout.engine.device={'cuda' if first_gpu is not None else 'cpu'}",
                f"rollout.engine.num_threads={args.threads}",
                "rollout.engine.weight_update_timeout_s=600",
                *[f"rollout.engine.{kv}" for kv in getattr(args, "engine_set", None) or []],
                "--port",
                str(port),
            )
        else:
            cmd = [sys.executable, "-m", "tidal.weights_sync.receiver_server", "--port", str(port)]
            cmd += ["--timeout-s", "600"]
        env = {"OMP_NUM_THREADS": str(args.threads)}
        if first_gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(first_gpu + i)
        procs.append(spawn(cmd, logdir / f"{args.engine}{i}.log", env=env))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for proc, url in zip(procs, urls, strict=True):
            wait_for_tcp("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout_s=600, proc=proc)
    except BaseException:
        for proc in procs:
            stop(proc, timeout_s=5)
        raise
    return procs, urls


def local_source(model: ModelConfig, args):
    """One trainer rank holding full megatron-core tensors: the sync converts them (no gather)."""
    mapping = mapping_for(model)
    state = megatron_state(model, getattr(torch, args.dtype), args.device, args.trainer_layout)

    def make(times: GatherTimes):
        for name, tensor in state.items():
            t0 = time.perf_counter()
            converted = mapping.to_hf(name, tensor, packable=True)
            times.convert_s += time.perf_counter() - t0
            yield from converted

    return make


def megatron_source(model: ModelConfig, args):
    """A real megatron-core model on a TP mesh (under torchrun): the sync all-gathers its shards."""
    from tidal.trainer import models, parallel
    from tidal.trainer.mesh import MeshConfig
    from tidal.weights_sync.gather import Groups, iter_hf

    mesh = MeshConfig(tp=args.tp)
    parallel.init_parallel(mesh, model)
    tconfig = models.transformer_config(model, mesh, bf16=args.dtype == "bfloat16")
    chunks = models.build_model(model, tconfig, seed=0)
    mapping = mapping_for(model)
    return lambda times: iter_hf(chunks, mapping, Groups.from_megatron(), times, packable=True)


# --fixed-cost: Qwen3 models of hidden 64 whose bytes take next to no time to move: with one layer (14
# tensors) a sync costs what every sync pays (the control calls, one announcement, the replies); 36 layers
# (~400 tensors, as many as the 1 GB model) add what each tensor costs (convert, pack, announce, check, load)
FIXED_COST_LAYERS = (1, 36)


def tiny_model(layers: int) -> ModelConfig:
    return ModelConfig(
        family="qwen3",
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=192,
    )


def model_bytes(model: ModelConfig, dtype_bytes: int) -> int:
    return sum(math.prod(s) for s in megatron_shapes(model).values()) * dtype_bytes

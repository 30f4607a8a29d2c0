"""Start torch.distributed and megatron-core's parallel state from the trainer's mesh.

gloo on CPU (with :mod:`tidal.trainer.cpu_support` enabled), NCCL on GPU. Works under torchrun (reads
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT) and in a plain single process (world size 1).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tidal.model_config import ModelConfig
from tidal.trainer import cpu_support
from tidal.trainer.mesh import MeshConfig, MeshLayout, resolve_mesh


def device() -> torch.device:
    """The device this rank computes on."""
    if torch.cuda.is_available() and not cpu_support.enabled():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group (idempotent); returns (rank, world size)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_support.enable()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "MASTER_ADDR" not in os.environ:
        if world != 1:
            raise RuntimeError(
                f"WORLD_SIZE={world} but MASTER_ADDR is not set: launch the trainer with torchrun"
            )
        from tidal.procs import free_port

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return rank, world


def init_parallel(mesh: MeshConfig, model: ModelConfig | None = None, seed: int = 0) -> MeshLayout:
    """Initialise torch.distributed and megatron's parallel state for ``mesh``; returns the layout.

    The mesh is checked against the world size (and model) first, naming the rule it breaks.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    _, world = init_distributed()
    layout = resolve_mesh(mesh, world, model)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    model_parallel_cuda_manual_seed(seed)
    return layout


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

"""Wrap model chunks for data parallelism and build the optimizer and its learning-rate schedule.

``dist_opt``: megatron-core's DistributedDataParallel (contiguous fp32 gradient buffers) with its
distributed optimizer (Adam states and fp32 master weights sharded over the data-parallel group; dense
parameters over dp x cp, experts over edp). ``fsdp2`` is not built yet and fails with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.trainer.config import OptimizerConfig


@dataclass
class TrainState:
    """The model chunks (DDP-wrapped), optimizer and schedule of one trainer rank."""

    chunks: list[torch.nn.Module]
    optimizer: object  # megatron.core.optimizer.MegatronOptimizer
    scheduler: object  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler


def wrap_ddp(chunks: list[torch.nn.Module], tconfig) -> list[torch.nn.Module]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=True,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(
            DistributedDataParallel(
                config=tconfig,
                ddp_config=ddp_config,
                module=chunk,
                # Only the first chunk buckets: megatron's rule for interleaved pipelines.
                disable_bucketing=i > 0,
            )
        )
    return wrapped


def build_train_state(
    chunks: list[torch.nn.Module], tconfig, config: OptimizerConfig, total_steps: int
) -> TrainState:
    """DDP-wrap ``chunks`` and build the optimizer and schedule for ``total_steps`` optimizer steps."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if config.kind != "dist_opt":
        raise ValueError(
            f"trainer.optimizer.kind={config.kind!r} is not implemented yet; use trainer.optimizer.kind=dist_opt"
        )
    wrapped = wrap_ddp(chunks, tconfig)
    opt_config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        clip_grad=config.clip_grad,
        bf16=tconfig.bf16,
        params_dtype=tconfig.params_dtype,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(opt_config, wrapped)
    decay_steps = max(total_steps, config.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if config.warmup_steps else config.lr,
        max_lr=config.lr,
        min_lr=config.min_lr if config.schedule != "constant" else config.lr,
        lr_warmup_steps=config.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=config.schedule,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return TrainState(chunks=wrapped, optimizer=optimizer, scheduler=scheduler)

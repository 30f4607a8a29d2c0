"""Wrap model chunks for data parallelism and build the optimizer and its learning-rate schedule.

``dist_opt``: megatron-core's DistributedDataParallel (contiguous fp32 gradient buffers) with its
distributed optimizer (Adam states and fp32 master weights sharded over the data-parallel group; dense
parameters over dp x cp, experts over edp); every rank keeps full weights and full gradients.

``fsdp2``: fully sharded -- weights, gradients and optimizer states -- through megatron-core's
Megatron-FSDP (``use_megatron_fsdp``, strategy ``optim_grads_params``): dense parameters over dp x cp,
experts over edp, each transformer layer's weights all-gathered just in time for its forward and backward
and its gradients reduce-scattered after. The same distributed optimizer and schedule step the shards.
docs/trainer.md ("Decisions") says why this and not megatron's torch-FSDP2 wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.trainer.config import OptimizerConfig, check_fsdp2_mesh


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


def wrap_fsdp(chunks: list[torch.nn.Module], tconfig) -> list[torch.nn.Module]:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from tidal.trainer import cpu_support, parallel

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        check_for_nan_in_grad=False,
        bucket_size=None,
        # fp32 gradients however the model computes (as dist_opt's grad_reduce_in_fp32)
        megatron_fsdp_main_grads_dtype=torch.float32,
    )
    device = parallel.device()
    with cpu_support.cuda_device_ordinals():
        return [
            FullyShardedDataParallel(
                config=tconfig, ddp_config=ddp_config, module=chunk, device=device, disable_bucketing=i > 0
            )
            for i, chunk in enumerate(chunks)
        ]


def is_fsdp(chunk: torch.nn.Module) -> bool:
    return bool(getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False))


def gather_full_weights(chunks: list[torch.nn.Module]) -> None:
    """Make every rank's model parameters hold full (unsharded) values (collective; no-op for dist_opt).

    Under ``fsdp2`` a parameter outside a forward/backward pass may be released; call this before reading
    weights directly (export, weight sync). The next forward pass reshards as usual.
    """
    for chunk in chunks:
        if is_fsdp(chunk):
            # all-gathers every bucket into the raw (full) parameters, but leaves the module holding the
            # optimizer's sharded DTensors; put the raw ones back, as a forward pass would
            chunk.start_param_sync(force_sync=True)
            chunk.module._replace_param_with_raw_if_needed()


def build_train_state(
    chunks: list[torch.nn.Module], tconfig, config: OptimizerConfig, total_steps: int
) -> TrainState:
    """DDP-wrap ``chunks`` and build the optimizer and schedule for ``total_steps`` optimizer steps."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    check_fsdp2_mesh(config.kind, tconfig.pipeline_model_parallel_size)
    wrapped = wrap_fsdp(chunks, tconfig) if config.kind == "fsdp2" else wrap_ddp(chunks, tconfig)
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

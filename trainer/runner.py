"""One trainer rank: mesh, model, optimizer, packing and the step, shared by ``tidal train`` and ``tidal sft``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from tidal.config import RunConfig
from tidal.trainer import checkpoint, models, parallel, reference
from tidal.trainer.optimizer import build_train_state, gather_full_weights
from tidal.trainer.packing import MinibatchPlan, SequenceItem, plan_minibatch
from tidal.trainer.step import LossFn, StepResult, policy_logprobs, train_step


def hf_dir(path: str | Path) -> Path:
    """A Hugging Face model directory: ``path`` itself or its ``hf/`` (what ``tidal sft`` writes)."""
    path = Path(path)
    for candidate in (path, path / "hf"):
        if (candidate / "config.json").exists():
            return candidate
    raise FileNotFoundError(
        f"{path}: no config.json here or in {path / 'hf'}; pass a Hugging Face model directory"
    )


def _tokenizer_dir(path: str | Path) -> Path | None:
    path = Path(path)
    for candidate in (path, path / "hf"):
        if (candidate / "tokenizer.json").exists() or (candidate / "tokenizer_config.json").exists():
            return candidate
    return None


class TrainerRank:
    """One rank's trainer.

    ``init_hf``: a Hugging Face checkpoint, the initial weights: loaded into the policy (unless
    ``load_init`` is False, e.g. when a checkpoint will be resumed) before it is wrapped for data
    parallelism (under ``fsdp2`` the weights are sharded after that), and into the reference model when the
    loss has a KL term (``trainer.loss.kl_coef > 0``).
    """

    def __init__(
        self,
        config: RunConfig,
        total_steps: int,
        init_hf: str | Path | None = None,
        load_init: bool = True,
    ):
        self.config = config
        self.model_config = config.model.resolved()
        tc = config.trainer
        if tc.deterministic:
            torch.use_deterministic_algorithms(True)
        self.layout = parallel.init_parallel(tc.mesh, self.model_config, seed=tc.seed)
        self.tconfig = models.transformer_config(
            self.model_config,
            tc.mesh,
            bf16=tc.bf16,
            deterministic=tc.deterministic,
            moe_dispatcher=tc.moe_dispatcher,
            expert_bias_update_rate=tc.expert_bias_update_rate,
        )
        chunks = models.build_model(self.model_config, self.tconfig, seed=tc.seed, kernels=tc.kernels)
        if init_hf is not None and load_init:
            reference.load_hf(chunks, self.model_config, init_hf)
        self.reference: list[torch.nn.Module] | None = None
        if tc.loss.kind == "grpo" and tc.loss.kl_coef > 0:
            self.reference = reference.build_reference(
                self.model_config, self.tconfig, seed=tc.seed, init_hf=init_hf
            )
        self.state = build_train_state(chunks, self.tconfig, tc.optimizer, total_steps)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    # ------------------------------------------------------------------ data and step

    def plan(self, items: Sequence[SequenceItem], mask_truncated: bool = False) -> MinibatchPlan:
        # context parallel needs 2*cp per sequence, sequence parallel a multiple of tp per micro-batch
        pad = 2 * self.layout.cp * self.layout.tp if (self.layout.cp > 1 or self.layout.tp > 1) else 1
        return plan_minibatch(
            items,
            dp_size=self.layout.dp,
            max_tokens=-(-self.config.trainer.micro_batch_tokens // pad) * pad,
            pad_multiple=pad,
            mask_truncated=mask_truncated,
        )

    def proximal(self, plan: MinibatchPlan, temperature: float = 1.0) -> list[torch.Tensor | None] | None:
        """The proximal logprobs of ``plan`` (current weights, no grad) when the loss recomputes them,
        else None. Call for every minibatch of a batch before the batch's first step."""
        loss = self.config.trainer.loss
        if loss.kind != "grpo" or not loss.recompute_proximal_logprobs:
            return None
        return policy_logprobs(self.state, plan.micro_batches(self.dp_rank), temperature)

    def step(
        self,
        plan: MinibatchPlan,
        loss_fn: LossFn,
        with_entropy: bool = False,
        temperature: float = 1.0,
        proximal: list[torch.Tensor | None] | None = None,
    ) -> StepResult:
        return train_step(
            self.state,
            plan.micro_batches(self.dp_rank),
            loss_fn,
            with_entropy=with_entropy,
            temperature=temperature,
            proximal_logprobs=proximal,
            reference_chunks=self.reference,
        )

    # ------------------------------------------------------------------ weights in and out

    def export_hf(self, directory: str | Path, tokenizer_from: str | Path | None = None) -> None:
        """Write the model as a Hugging Face directory from global rank 0 (collective)."""
        from megatron.core import parallel_state as ps

        from tidal.weights_sync.families import mapping_for
        from tidal.weights_sync.gather import Groups, iter_hf
        from tidal.weights_sync.hf_io import copy_side_files, save

        gather_full_weights(self.state.chunks)
        chunks = [models.unwrap(c) for c in self.state.chunks]
        tensors = {
            n: t.detach().float().cpu()
            for n, t in iter_hf(chunks, mapping_for(self.model_config), Groups.from_megatron())
        }
        holder = (
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0
        )
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, tensors if holder else {})
        if self.rank == 0:
            merged = {k: v for part in parts for k, v in part.items()}
            save(directory, merged, self.model_config)
            source = _tokenizer_dir(tokenizer_from) if tokenizer_from is not None else None
            if source is not None:  # its tokenizer, chat template and generation defaults
                copy_side_files(source, directory)
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints

    def save(self, run_dir: str | Path, progress: checkpoint.Progress) -> Path:
        return checkpoint.save(self.state, run_dir, progress)

    def resume(self, run_dir: str | Path) -> checkpoint.Progress | None:
        path = checkpoint.latest(run_dir)
        return None if path is None else checkpoint.load(self.state, path)

    def close(self) -> None:
        parallel.shutdown()

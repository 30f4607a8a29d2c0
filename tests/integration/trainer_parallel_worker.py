"""Train a tiny model for a few steps on the fixed synthetic batch under several meshes; rank 0 writes JSON.

Run under torchrun by tests/integration/test_trainer_parallel.py:
    torchrun --nproc-per-node N trainer_parallel_worker.py OUT.json STEPS CASE [CASE ...]
A CASE is ``name:family:key=value,key=value`` with mesh fields (tp, pp, vpp, cp, ep, etp) and
dispatcher=alltoall|allgather, loss=grpo|sft, prox=1 (recompute proximal logprobs before each step, with
token-level TIS), kl=1 (KL to a frozen reference model built like the policy), save=RUN_DIR with save_after=N (checkpoint after N steps),
kill=1 (SIGKILL every rank right after that checkpoint), resume=RUN_DIR (continue from its latest checkpoint),
deterministic=1 (torch deterministic algorithms and megatron's deterministic mode), opt=dist_opt|fsdp2 (the
optimizer kind), bf16=1 (bf16 parameters and activations; the GPU suite's runs). Rank 0 rewrites OUT after
every case. The cases of one launch share its process group (megatron's
parallel state is rebuilt per case), which saves a process start per case on a small machine.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from tidal.model_config import ModelConfig
from tidal.trainer import checkpoint, models, parallel
from tidal.trainer.config import LossConfig, OptimizerConfig
from tidal.trainer.mesh import MeshConfig
from tidal.trainer.optimizer import build_train_state, gather_full_weights
from tidal.trainer.reference import build_reference
from tidal.trainer.step import policy_logprobs, train_step
from tidal.trainer.synthetic import make_loss, plan, synthetic_groups

FAMILIES = {
    "qwen3": dict(family="qwen3"),
    "qwen3_moe": dict(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v3": dict(
        family="deepseek_v3",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
}


def run_case(family: str, opts: dict[str, str], steps: int, on_kill) -> dict:
    from megatron.core import parallel_state as ps

    mesh = MeshConfig(**{k: int(v) for k, v in opts.items() if k in MeshConfig.model_fields})
    model = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        **FAMILIES[family],
    )
    deterministic = opts.get("deterministic") == "1"
    torch.use_deterministic_algorithms(deterministic)
    layout = parallel.init_parallel(mesh, model, seed=0)
    tconfig = models.transformer_config(
        model,
        mesh,
        moe_dispatcher=opts.get("dispatcher", "alltoall"),
        deterministic=deterministic,
        bf16=opts.get("bf16") == "1",
    )
    chunks = models.build_model(model, tconfig, seed=1)
    optimizer = OptimizerConfig(kind=opts.get("opt", "dist_opt"), lr=1e-3, clip_grad=1.0)
    state = build_train_state(chunks, tconfig, optimizer, total_steps=steps)
    groups = synthetic_groups(vocab_size=model.vocab_size, groups=4, group_size=4, seed=0)
    minibatch = plan(groups, dp_size=layout.dp, max_tokens=64, pad_multiple=2 * layout.cp * layout.tp)
    micro_batches = minibatch.micro_batches(ps.get_data_parallel_rank())
    recompute, with_kl = opts.get("prox") == "1", opts.get("kl") == "1"
    loss_config = LossConfig(
        tis="token" if recompute else "off",
        recompute_proximal_logprobs=recompute,
        kl_coef=0.1 if with_kl else 0.0,
    )
    reference = build_reference(model, tconfig, seed=1) if with_kl else None
    losses, norms, stats = [], [], []
    first = 0
    if "resume" in opts:
        first = checkpoint.load(state, checkpoint.latest(opts["resume"])).step
    for version in range(first, steps):
        loss_fn = make_loss(opts.get("loss", "grpo"), loss_config, minibatch.normalizer, version)
        proximal = policy_logprobs(state, micro_batches) if recompute else None
        result = train_step(
            state,
            micro_batches,
            with_input_checks(loss_fn),
            proximal_logprobs=proximal,
            reference_chunks=reference,
        )
        losses.append(result.loss)
        norms.append(result.grad_norm)
        stats.append(result.stats)
        if "save" in opts and version + 1 == int(opts["save_after"]):
            checkpoint.save(state, opts["save"], checkpoint.Progress(step=version + 1))
            if opts.get("kill") == "1":
                on_kill(dict(losses=losses, grad_norms=norms, layout=layout.describe(), first_step=first))
    return dict(
        losses=losses,
        grad_norms=norms,
        stats=stats,
        weights_l1=_weights_l1(state.chunks),
        expert_bias_l1=_expert_bias_l1(state.chunks),
        layout=layout.describe(),
        first_step=first,
    )


def _expert_bias_l1(chunks) -> float:
    """Sum of |bias| over the routers' expert biases (aux-loss-free balancing) on this rank."""
    return sum(
        float(b.abs().sum())
        for c in chunks
        for n, b in models.unwrap(c).named_buffers()
        if n.endswith("router.expert_bias")
    )


def _weights_l1(chunks) -> float:
    """Sum of |w| over this rank's model parameters as export and weight sync read them (full, unsharded)."""
    gather_full_weights(chunks)
    with torch.no_grad():
        return sum(float(p.detach().abs().sum()) for c in chunks for p in models.unwrap(c).parameters())


def with_input_checks(loss_fn):
    """``loss_fn``, also reporting max |proximal - current| and max |reference - current| logprob on loss
    tokens (``check/...`` statistics), from the tensors the loss itself receives."""

    def checked(logprobs, entropy, mb, seq_reduce):
        result = loss_fn(logprobs, entropy, mb, seq_reduce)
        on_loss = mb.loss_mask > 0
        for name, other in (("proximal", mb.proximal_logprobs), ("reference", mb.ref_logprobs)):
            if other is not None and bool(on_loss.any()):
                gap = (other - logprobs.detach())[on_loss].abs().max()
                result.stats.add_max(f"check/{name}_minus_current_abs_max", gap)
        return result

    return checked


def main() -> None:
    faulthandler.enable()  # a native crash shows the Python stacks in the launch's log
    out, steps, *cases = sys.argv[1:]
    results = {}
    first_rank = os.environ.get("RANK", "0") == "0"  # the process group starts in the first case

    def write() -> None:
        if first_rank:
            with open(out + ".tmp", "w") as f:
                json.dump(results, f)
            os.replace(out + ".tmp", out)

    for case in cases:
        name, family, spec = (case.split(":") + [""])[:3]
        opts = dict(p.split("=", 1) for p in spec.split(",") if p)

        def on_kill(partial: dict, name=name) -> None:
            # kill=1: every rank dies by SIGKILL right after the checkpoint, as a crashed trainer would
            results[name] = partial
            write()
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)

        # a launch that runs past its time limit shows in its log which case it was in, and how long
        # the ones before took (the GPU suite's launches have no other trace when they time out)
        if first_rank:
            print(f"case {name}: started", flush=True)
        t0 = time.perf_counter()
        results[name] = run_case(family, opts, int(steps), on_kill)
        results[name]["seconds"] = round(time.perf_counter() - t0, 2)
        write()
        dist.barrier()
        if first_rank:
            print(f"case {name}: done in {results[name]['seconds']} s", flush=True)
    parallel.shutdown()


if __name__ == "__main__":
    main()

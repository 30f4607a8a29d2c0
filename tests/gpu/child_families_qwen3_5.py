"""The tiny Qwen3.5 on CUDA with flash-linear-attention: logits vs transformers, one train step, export.

    python child_families_qwen3_5.py WORK_DIR

One process, world size 1. A random Hugging Face checkpoint of configs/tiny/qwen3_5_35b_a3b.yaml's model is
loaded into tidal's megatron-core Qwen3.5 (Gated DeltaNet on fla's kernels) in fp32 and in bf16; logits of
a batch and of two sequences packed in one THD row (the trainer's layout, fla's varlen path) are compared
with transformers' (fp32 and bf16). The bf16 model then trains one GRPO step with the distributed optimizer,
its weights are exported through the weight mapping (what weights_sync sends) and loaded into a
transformers model with the embedded engine's loader, whose logits must again match megatron-core's.
Prints one JSON line of measurements; tests/gpu/test_gpu_qwen3_5.py judges them.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import yaml

from tidal.model_config import ModelConfig
from tidal.trainer import models, parallel
from tidal.trainer.config import LossConfig, OptimizerConfig
from tidal.trainer.mesh import MeshConfig
from tidal.trainer.optimizer import build_train_state
from tidal.trainer.step import train_step
from tidal.trainer.synthetic import make_loss, plan, synthetic_groups
from tidal.weights_sync import hf_io
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.gather import Groups, iter_hf, load_hf_into_chunks
from tidal.weights_sync.tiny_models import save_random_hf

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny" / "qwen3_5_35b_a3b.yaml"
LENGTHS = (20, 28)  # two sequences, packed into one row for the THD comparison


_START = time.monotonic()


def _phase(name: str) -> None:
    """Progress on stderr: the first run on a machine compiles and tunes fla's Triton kernels (minutes)."""
    print(f"[{time.monotonic() - _START:7.1f} s] {name}", file=sys.stderr, flush=True)


def _transformers(directory: Path, dtype: torch.dtype, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()


def _megatron(model: ModelConfig, hf: dict, dtype: torch.dtype, device):
    tconfig = models.transformer_config(model, MeshConfig(), bf16=dtype == torch.bfloat16)
    chunks = models.build_model(model, tconfig, seed=1)
    mapping = mapping_for(model)
    loaded = load_hf_into_chunks(
        chunks, {n: t.to(device=device, dtype=dtype) for n, t in hf.items()}, mapping, Groups.from_megatron()
    )
    return chunks, tconfig, mapping, loaded


class _Routes:
    """Every MoE layer's chosen experts per token in one forward pass: [layers, tokens, experts] booleans.

    Hooks on megatron-core's ``TopKRouter`` (its routing map; tokens sequence-major) and transformers'
    ``Qwen3_5MoeTopKRouter`` (its top-k indices; tokens batch-major).
    """

    def __init__(self, *models) -> None:
        self.maps: list[torch.Tensor] = []
        self.handles = [
            module.register_forward_hook(self._hook)
            for model in models
            for module in model.modules()
            if type(module).__name__ in ("TopKRouter", "Qwen3_5MoeTopKRouter")
        ]

    def _hook(self, module, args, output) -> None:
        if type(module).__name__ == "TopKRouter":
            self.maps.append(output[1].detach().bool())
        else:
            indices = output[2].detach()
            experts = output[0].shape[-1]
            chosen = torch.zeros(indices.shape[0], experts, dtype=torch.bool, device=indices.device)
            self.maps.append(chosen.scatter_(1, indices, True))

    def take(self) -> torch.Tensor:
        maps, self.maps = torch.stack(self.maps), []
        return maps

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def _logits(chunk, ref, ids: torch.Tensor, device) -> dict:
    """Batch logits, and packed-THD logits of the two sequences, from megatron-core and transformers, with
    each token's experts in every layer (``*_routes``; tokens batch-major, as the logits)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    batch = ids[:, : min(LENGTHS)]
    positions = torch.arange(batch.shape[1], device=device)[None].expand_as(batch)
    seqs = [ids[i, :n] for i, n in enumerate(LENGTHS)]
    cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32, device=device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(LENGTHS),
        max_seqlen_kv=max(LENGTHS),
    )
    packed_ids = torch.cat(seqs)[None]
    packed_pos = torch.cat([torch.arange(n, device=device) for n in LENGTHS])[None]
    routes = _Routes(chunk, ref)
    out = dict(megatron_batch=chunk(batch, positions, None))
    layers, _, experts = (maps := routes.take()).shape
    b, s = batch.shape  # megatron's tokens are sequence-major
    out["megatron_batch_routes"] = (
        maps.view(layers, s, b, experts).transpose(1, 2).reshape(layers, b * s, experts)
    )
    out["megatron_packed"] = chunk(packed_ids, packed_pos, None, packed_seq_params=params)[0]
    out["megatron_packed_routes"] = routes.take()
    out["ref_batch"] = ref(batch).logits
    out["ref_batch_routes"] = routes.take()
    ref_packed, ref_packed_routes = [], []
    for seq in seqs:  # transformers' reference: each sequence on its own
        ref_packed.append(ref(seq[None]).logits[0])
        ref_packed_routes.append(routes.take())
    out["ref_packed"] = torch.cat(ref_packed)
    out["ref_packed_routes"] = torch.cat(ref_packed_routes, dim=1)
    routes.close()
    return out


def _compare(got: dict, want: dict, got_key: str, want_key: str) -> dict:
    """Error of logits ``got[got_key]`` against ``want[want_key]``: over all tokens, and over the comparable
    ones, with the fraction of tokens whose experts differ from the reference's in some layer.

    A token whose router scores nearly tie can pick another expert once activations are rounded to bf16: a
    discrete change of its hidden state, which attention and the Gated DeltaNet's recurrence carry to every
    later token of its sequence. A token is comparable when it and every earlier token of its sequence
    chose the reference's experts in every layer.
    """
    a, b = got[got_key].float(), want[want_key].float()
    per_token = ((a - b).abs().amax(-1) / b.abs().max()).reshape(-1)
    agree = (got[f"{got_key}_routes"] == want[f"{want_key}_routes"]).all(-1).all(0)
    lengths = [min(LENGTHS)] * len(LENGTHS) if got_key.endswith("batch") else list(LENGTHS)
    comparable = torch.cat([seq.int().cumprod(0).bool() for seq in agree.split(lengths)])
    return dict(
        all=float(per_token.max()),
        comparable=float(per_token[comparable].max()) if bool(comparable.any()) else math.nan,
        comparable_fraction=float(comparable.float().mean()),
        flipped=float(1 - agree.float().mean()),
        worst_token_comparable=bool(comparable[per_token.argmax()]),
    )


def main() -> None:
    work = Path(sys.argv[1])
    device = parallel.device()
    with open(TINY) as f:
        spec = ModelConfig(**yaml.safe_load(f)["model"])
    directory = save_random_hf(spec, work / "hf", seed=0)
    model = hf_io.load_config(directory)
    hf = hf_io.load_tensors(directory)
    parallel.init_parallel(MeshConfig(), model, seed=0)
    ids = torch.randint(0, model.vocab_size, (2, max(LENGTHS)), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    from megatron.core.ssm.gated_delta_net import common

    result: dict = dict(device=str(device), fla=common.HAVE_FLA, checkpoint_names=len(hf))
    ref32 = _transformers(directory, torch.float32, device)
    ref16 = _transformers(directory, torch.bfloat16, device)

    # fp32: megatron-core (fla) vs transformers
    _phase("fp32 logits")
    chunks32, _, mapping, loaded = _megatron(model, hf, torch.float32, device)
    full = {n for n, _ in mapping.to_megatron(hf)}
    result["not_loaded"] = sorted(full - loaded)
    from tidal.trainer.families.gated_delta_rule import fla_backward_refusal, installed

    result["gated_delta_rule"] = installed(chunks32)
    result["fla_backward_refusal"] = fla_backward_refusal()
    out = _logits(chunks32[0], ref32, ids, device)
    for layout in ("batch", "packed"):
        result[f"fp32_{layout}"] = _compare(out, out, f"megatron_{layout}", f"ref_{layout}")
    del chunks32

    # bf16: megatron-core vs fp32 transformers, next to transformers' own bf16 error
    _phase("bf16 logits")
    chunks, tconfig, mapping, _ = _megatron(model, hf, torch.bfloat16, device)
    out = _logits(chunks[0], ref32, ids, device)
    out16 = _logits(chunks[0], ref16, ids, device)
    for layout in ("batch", "packed"):
        result[f"bf16_{layout}"] = _compare(out, out, f"megatron_{layout}", f"ref_{layout}")
        result[f"transformers_bf16_{layout}"] = _compare(out16, out, f"ref_{layout}", f"ref_{layout}")

    # one GRPO step in bf16 with the distributed optimizer, on packed sequences
    _phase("one GRPO step")
    before = {n: p.detach().float().clone() for n, p in chunks[0].named_parameters()}
    state = build_train_state(chunks, tconfig, OptimizerConfig(lr=1e-3, clip_grad=1.0), total_steps=1)
    groups = synthetic_groups(vocab_size=model.vocab_size, groups=4, group_size=4, seed=0)
    minibatch = plan(groups, dp_size=1, max_tokens=256, pad_multiple=1)
    step = train_step(
        state, minibatch.micro_batches(0), make_loss("grpo", LossConfig(), minibatch.normalizer, 0)
    )
    torch.cuda.synchronize()
    after = dict(chunks[0].named_parameters())
    unchanged = sorted(n for n, p in before.items() if torch.equal(p, after[n].detach().float()))
    result.update(
        step_loss=step.loss,
        step_grad_norm=step.grad_norm,
        step_finite=math.isfinite(step.loss) and math.isfinite(step.grad_norm),
        step_update_successful=step.update_successful,
        params=sorted(before),
        params_unchanged=unchanged,
    )

    # export (weights_sync's conversion) into a transformers model through the embedded engine's loader
    _phase("export and reload")
    from transformers import AutoModelForCausalLM

    from tidal.rollout.embedded.model import NamedTensorLoader

    exported = [(n, t.detach().float().cpu()) for n, t in iter_hf(chunks, mapping, Groups.from_megatron())]
    result["exported_names_match"] = sorted(n for n, _ in exported) == sorted(hf)
    engine = AutoModelForCausalLM.from_config(model.to_hf_config(), dtype=torch.float32).eval()
    NamedTensorLoader(engine).load(exported)
    engine = engine.to(device)
    engine16 = AutoModelForCausalLM.from_config(model.to_hf_config(), dtype=torch.bfloat16).eval()
    NamedTensorLoader(engine16).load([(n, t.bfloat16()) for n, t in exported])
    engine16 = engine16.to(device)
    out = _logits(chunks[0], engine, ids, device)
    out16 = _logits(chunks[0], engine16, ids, device)
    result["synced_bf16"] = _compare(out, out, "megatron_batch", "ref_batch")
    result["synced_transformers_bf16"] = _compare(out16, out, "ref_batch", "ref_batch")
    # what was exported is what was trained: the export mapped back equals every trained parameter bitwise
    trained = {n.removeprefix("module."): p for n, p in chunks[0].named_parameters()}
    back = dict(mapping.to_megatron(dict(exported)))
    compared = sorted(set(back) & set(trained))
    result["reimport_compared"] = len(compared)
    result["reimport_trained_params"] = len(trained)
    result["reimport_mismatch"] = [
        n for n in compared if not torch.equal(trained[n].detach().float().cpu(), back[n].float())
    ]
    # and in fp32 (no bf16 rounding, so no flipped experts): a fresh megatron-core model of the export
    synced32, _, _, _ = _megatron(model, dict(exported), torch.float32, device)
    out32 = _logits(synced32[0], engine, ids, device)
    result["synced_fp32"] = _compare(out32, out32, "megatron_batch", "ref_batch")
    parallel.shutdown()
    _phase("done")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

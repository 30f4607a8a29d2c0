"""Hugging Face checkpoints through megatron-core models on CUDA: load, export, logits; writes results to DIR.

    python child_weights.py DIR HF_DIR [HF_DIR ...]

For each tiny checkpoint, in fp32 and in bf16: the HF tensors are moved to the device, converted to
megatron-core's layout and loaded into a model built by ``tidal.trainer.models`` (weights_sync's
``load_hf_into_chunks``), then exported back (``iter_hf``). ``DIR/<family>_<dtype>.pt`` holds the source
tensors, the exported ones, and (fp32) the logits of the megatron-core model and of transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tidal.trainer import models, parallel
from tidal.trainer.mesh import MeshConfig
from tidal.weights_sync import hf_io
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.gather import Groups, iter_hf, load_hf_into_chunks


def run(directory: str, dtype: torch.dtype, out_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    device = parallel.device()
    model = hf_io.load_config(directory)
    mesh = MeshConfig()
    parallel.init_parallel(mesh, model, seed=0)
    tconfig = models.transformer_config(model, mesh, bf16=dtype == torch.bfloat16)
    if model.family == "deepseek_v3":
        # DeepSeek-V3 routes with e_score_correction_bias (megatron's expert bias); as in
        # tests/integration/test_weights_megatron.py, switched on here until the builder does it
        tconfig.moe_router_enable_expert_bias = True
    chunks = models.build_model(model, tconfig, seed=1)
    hf = {n: t.to(device=device, dtype=dtype) for n, t in hf_io.load_tensors(directory).items()}
    mapping = mapping_for(model)
    loaded = load_hf_into_chunks(chunks, hf, mapping, Groups.from_megatron())
    exported = {n: t.detach().clone() for n, t in iter_hf(chunks, mapping, Groups.from_megatron())}
    record = dict(
        source={n: t.cpu() for n, t in hf.items()},
        exported={n: t.cpu() for n, t in exported.items()},
        param_device=next(chunks[0].parameters()).device.type,
        export_devices=sorted({t.device.type for t in exported.values()}),
    )
    if dtype == torch.float32:
        ids = torch.randint(0, model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(
            device
        )
        ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
        with torch.no_grad():
            record["megatron_logits"] = chunks[0](ids, torch.arange(16, device=device)[None], None).cpu()
            record["transformers_logits"] = ref(ids).logits.cpu()
    name = f"{model.family}_{str(dtype).removeprefix('torch.')}"
    torch.save(record, out_dir / f"{name}.pt")
    full = {n for n, _ in mapping.to_megatron(hf)}
    return {name: dict(not_loaded=sorted(full - loaded), file=str(out_dir / f"{name}.pt"))}


def main() -> None:
    out_dir = Path(sys.argv[1])
    results = {}
    for directory in sys.argv[2:]:
        for dtype in (torch.float32, torch.bfloat16):
            results.update(run(directory, dtype, out_dir))
    parallel.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main()

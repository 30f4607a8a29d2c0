"""The trainer side of a colocated sync on one GPU: a bf16 megatron-core model sends its weights by CUDA IPC.

    python child_colocated_sync.py ENGINE_URL MODEL_JSON

Builds the model of MODEL_JSON (a ModelConfig) with ``tidal.trainer.models`` on CUDA in bf16, then runs the
trainer's own ``TrainerWeightSync`` (``weights_sync.transport='auto'``, small buckets so that both staging
buffers are reused many times) to the engine serving that model on the same GPU, twice: once with the
initial weights, once after perturbing every parameter. After each sync every exported tensor
(``iter_hf`` in bf16, the trainer's export) is compared with what the engine holds (``/get_weights_by_name``,
float32 values, which represent bf16 exactly). Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import httpx
import torch

from tidal.model_config import ModelConfig
from tidal.trainer import models, parallel
from tidal.trainer.mesh import MeshConfig
from tidal.weights_sync.config import WeightSyncConfig
from tidal.weights_sync.engine_api import EngineEndpoint
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.gather import Groups, iter_hf
from tidal.weights_sync.trainer_sync import TrainerWeightSync


def mismatches(url: str, chunks, mapping) -> tuple[list[str], int]:
    bad, checked = [], 0
    with httpx.Client(base_url=url, timeout=60) as http:
        for name, tensor in iter_hf(chunks, mapping, Groups.from_megatron(), dtype=torch.bfloat16):
            resp = http.post("/get_weights_by_name", json={"name": name, "truncate_size": tensor.shape[0]})
            resp.raise_for_status()
            held = torch.tensor(resp.json(), dtype=torch.float32)
            checked += 1
            if held.shape != tensor.shape or not torch.equal(held, tensor.detach().float().cpu()):
                bad.append(name)
    return bad, checked


def main() -> None:
    url, model = sys.argv[1], ModelConfig(**json.loads(sys.argv[2]))
    mesh = MeshConfig()
    parallel.init_parallel(mesh, model, seed=0)
    chunks = models.build_model(model, models.transformer_config(model, mesh, bf16=True), seed=5)
    mapping = mapping_for(model.resolved())
    config = WeightSyncConfig(transport="auto", bucket_bytes=64 << 10, first_bucket_bytes=16 << 10)
    # bf16 export: the engine serves bf16, so every tensor crosses as the exact bytes the engine keeps
    sync = TrainerWeightSync(config, model, chunks, [EngineEndpoint(url)], export_dtype=torch.bfloat16)
    result: dict = {"transport": sync.transport, "syncs": []}
    try:
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for p in chunks[0].parameters():
                        p.add_(torch.randn_like(p) * 0.01)
            report = sync.sync(version)
            bad, checked = mismatches(url, chunks, mapping)
            info = httpx.get(f"{url}/model_info", timeout=30).json()
            result["syncs"].append(
                dict(
                    ok=report.ok,
                    buckets=report.buckets,
                    bytes=report.bytes,
                    wall_s=report.wall_s,
                    dropped=report.dropped,
                    mismatched=bad,
                    checked=checked,
                    weight_version=info["weight_version"],
                )
            )
    finally:
        sync.close()
        parallel.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

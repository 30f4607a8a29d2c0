"""Hugging Face checkpoints through real megatron-core models (CPU, gloo): load, logits, export.

Each case runs in child processes (megatron's parallel state and the CPU support module are
process-wide). The builder is ``tidal.trainer.models``; the loading and export are weights_sync's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tidal.procs import free_port, spawn, stop, wait_for_tcp
from tidal.weights_sync import hf_io
from tidal.weights_sync.megatron_io import Mesh, save_megatron
from tidal.weights_sync.tiny_models import TINY, save_random_hf

# Shared by both children: build the model for a mesh and load a HF directory into it.
_BUILD = """
import json, os, sys, torch
import torch.distributed as dist
from tidal.weights_sync import hf_io
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.gather import Groups, iter_hf, load_hf_into_chunks
from tidal.trainer import models, parallel
from tidal.trainer.mesh import MeshConfig

def build(directory, **mesh):
    model = hf_io.load_config(directory)
    mesh = MeshConfig(**mesh)
    parallel.init_parallel(mesh, model, seed=0)
    tconfig = models.transformer_config(model, mesh, training=False)  # export and forward only
    chunks = models.build_model(model, tconfig, seed=1)
    hf = hf_io.load_tensors(directory)
    mapping = mapping_for(model)
    loaded = load_hf_into_chunks(chunks, hf, mapping, Groups.from_megatron())
    return model, mapping, chunks, hf, loaded

def tokens(model):
    return torch.randint(0, model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
"""

_WORLD4 = _BUILD + textwrap.dedent(
    """
    from safetensors.torch import save_file
    from megatron.core import parallel_state as ps

    def pipeline_logits(chunks, tconfig, ids):
        # forward through every (virtual) stage in order, hidden states passed point to point
        seq = ids.shape[1] // (ps.get_tensor_model_parallel_world_size() if tconfig.sequence_parallel else 1)
        pp, me, hidden = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(), None
        for v, chunk in enumerate(chunks):
            for p in range(pp):
                if p != me:
                    continue
                first, last = v == 0 and p == 0, v == len(chunks) - 1 and p == pp - 1
                if not first:
                    hidden = torch.empty(seq, 1, tconfig.hidden_size)
                    dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
                    chunk.set_input_tensor(hidden)
                out = chunk(ids, torch.arange(ids.shape[1])[None], None)
                if last:
                    return out
                dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
        return None

    out_dir = sys.argv[1]
    for d in sys.argv[2:]:
        family = hf_io.load_config(d).family
        mesh = {"tp": 2, "pp": 2} | ({"ep": 2} if family != "qwen3" else {"vpp": 2})
        model, mapping, chunks, hf, loaded = build(d, **mesh)
        exported = dict(iter_hf(chunks, mapping, Groups.from_megatron()))
        # the same weights from the directory `tidal convert` wrote for this mesh
        from tidal.weights_sync.megatron_io import load_into_chunks
        before = [{n: t.clone() for n, t in c.state_dict().items() if torch.is_tensor(t)} for c in chunks]
        for c in chunks:
            for p in c.parameters():
                p.data.zero_()
        load_into_chunks(chunks, d + "_megatron")
        converted_equal = all(
            torch.equal(t, c.state_dict()[n]) for b, c in zip(before, chunks) for n, t in b.items()
        )
        all_loaded = [None] * dist.get_world_size()
        dist.all_gather_object(all_loaded, sorted(loaded))
        tp0 = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        stage = ps.get_pipeline_model_parallel_rank()
        if tp0:
            save_file({n: t.contiguous() for n, t in exported.items()}, f"{out_dir}/{family}_stage{stage}.safetensors")
        engines = os.environ.get("TIDAL_TEST_ENGINES")
        if engines and family == "qwen3_moe":
            from tidal.weights_sync.config import WeightSyncConfig
            from tidal.weights_sync.engine_api import EngineEndpoint
            from tidal.weights_sync.trainer_sync import TrainerWeightSync

            config = WeightSyncConfig(bucket_bytes=128 << 10, timeout_s=60, master_address="127.0.0.1")
            sync = TrainerWeightSync(config, model, chunks, [EngineEndpoint(u) for u in engines.split(",")])
            report = sync.after_step(step=1, version=1)
            sync.close()
            if tp0:
                with open(f"{out_dir}/sync_stage{stage}.json", "w") as f:
                    json.dump({"ok": report.ok, "buckets": report.buckets, "bytes": report.bytes,
                               "dropped": report.dropped}, f)
        with torch.no_grad():
            shard = pipeline_logits(chunks, chunks[0].config, tokens(model))
        if shard is not None:
            parts = [torch.empty_like(shard) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, shard.contiguous(), group=ps.get_tensor_model_parallel_group())
            if tp0:
                torch.save(torch.cat(parts, dim=-1), f"{out_dir}/{family}_logits.pt")
        if dist.get_rank() == 0:
            full = sorted(n for n, _ in mapping.to_megatron(hf))
            loaded_anywhere = set().union(*map(set, all_loaded))
            with open(f"{out_dir}/{family}_not_loaded.json", "w") as f:
                json.dump(sorted(set(full) - loaded_anywhere), f)
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, converted_equal)
        if dist.get_rank() == 0:
            with open(f"{out_dir}/{family}_converted_equal.json", "w") as f:
                json.dump(flags, f)
    parallel.shutdown()
    """
)


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
    assert proc.returncode == 0, "\n".join(errors[-20:]) + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: save_random_hf(model, root / family, seed=7) for family, model in TINY.items()}


PROMPT = [3, 14, 15, 92, 65, 35]


def _generate(url: str) -> dict:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
        "return_logprob": True,
    }
    resp = httpx.post(f"{url}/generate", json=body, timeout=60)
    resp.raise_for_status()
    return resp.json()


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    """Embedded engines (``tidal serve``): two start from other weights and are synced by the trainer;
    one ("fresh") loads the qwen3_moe checkpoint itself."""
    root = tmp_path_factory.mktemp("engines")
    stale = save_random_hf(TINY["qwen3_moe"], root / "stale", seed=8)
    procs, urls = {}, {}
    try:
        for name, path in (("a", stale), ("b", stale), ("fresh", checkpoints["qwen3_moe"])):
            port = free_port()
            cmd = [sys.executable, "-m", "tidal.cli", "serve", f"model.path={path}", "--port", str(port)]
            procs[name] = spawn(cmd, root / f"{name}.log", env={"OMP_NUM_THREADS": "1"})
            urls[name] = f"http://127.0.0.1:{port}"
        for name, proc in procs.items():
            wait_for_tcp("127.0.0.1", int(urls[name].rsplit(":", 1)[1]), timeout_s=180, proc=proc)
        yield urls, {name: _generate(url) for name, url in urls.items()}
    finally:
        for proc in procs.values():
            stop(proc, timeout_s=5)


@pytest.fixture(scope="module")
def world4(checkpoints, engines, tmp_path_factory) -> Path:
    urls, _ = engines
    out = tmp_path_factory.mktemp("world4")
    for family, directory in checkpoints.items():  # what `tidal convert --to megatron` writes for the mesh
        mesh = Mesh(tp=2, pp=2, ep=2) if TINY[family].is_moe else Mesh(tp=2, pp=2, vpp=2)
        model = hf_io.load_config(directory)
        save_megatron(f"{directory}_megatron", hf_io.load_tensors(directory), model, mesh, model.vocab_size)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", "--no-python", sys.executable, "-c", _WORLD4,
        str(out), *map(str, checkpoints.values()),
    ]  # fmt: skip
    _run(cmd, timeout=420, env={"TIDAL_TEST_ENGINES": f"{urls['a']},{urls['b']}"})
    return out


def _transformers_logits(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = hf_io.load_config(directory)
    ids = torch.randint(0, model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)(ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("family", list(TINY))
def test_tp2_pp2_ep2_export_is_bitwise(checkpoints, world4, family):
    from safetensors.torch import load_file

    assert json.loads((world4 / f"{family}_not_loaded.json").read_text()) == [], (
        "checkpoint tensors with no place in the megatron-core model"
    )
    assert json.loads((world4 / f"{family}_converted_equal.json").read_text()) == [True] * 4, (
        "loading the converted megatron-core directory must give the weights loaded from Hugging Face"
    )
    original = hf_io.load_tensors(checkpoints[family])
    exported = load_file(world4 / f"{family}_stage0.safetensors") | load_file(
        world4 / f"{family}_stage1.safetensors"
    )
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("family", list(TINY))
def test_tp2_pp2_ep2_logits_equal_transformers_logits(checkpoints, world4, family):
    reference = _transformers_logits(checkpoints[family])
    # the comparison has power: the logits are far from zero relative to the tolerance
    assert reference.std() > 100 * 1e-5
    torch.testing.assert_close(torch.load(world4 / f"{family}_logits.pt"), reference)  # fp32 tolerances


@pytest.mark.slow
def test_pp2_ep2_trainer_syncs_two_engines_bitwise(checkpoints, engines, world4):
    urls, before = engines
    reports = [json.loads((world4 / f"sync_stage{s}.json").read_text()) for s in (0, 1)]
    assert all(r["ok"] and r["dropped"] == [] and r["buckets"] > 1 for r in reports)
    original = hf_io.load_tensors(checkpoints["qwen3_moe"])

    def engine_tensor(url: str, tensor_name: str) -> torch.Tensor:
        body = {"name": tensor_name, "truncate_size": 1 << 20}
        resp = httpx.post(f"{url}/get_weights_by_name", json=body, timeout=60)
        resp.raise_for_status()
        return torch.tensor(resp.json(), dtype=torch.float32)

    with ThreadPoolExecutor(8) as pool:
        for name in ("a", "b"):
            got = dict(
                zip(original, pool.map(lambda n, u=urls[name]: engine_tensor(u, n), original), strict=True)
            )
            for tensor_name, tensor in original.items():
                assert torch.equal(got[tensor_name], tensor), f"engine {name}: {tensor_name}"


@pytest.mark.slow
def test_synced_engines_generate_like_a_fresh_engine_from_the_export(engines, world4):
    urls, before = engines
    fresh = _generate(urls["fresh"])
    # the comparison has power: before the sync the stale engines answered differently
    assert before["a"]["meta_info"]["output_token_logprobs"] != fresh["meta_info"]["output_token_logprobs"]
    for name in ("a", "b"):
        after = _generate(urls[name])
        assert after["output_ids"] == fresh["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == fresh["meta_info"]["output_token_logprobs"]
        assert after["meta_info"]["weight_version"] == "1"

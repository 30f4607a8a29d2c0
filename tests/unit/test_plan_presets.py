"""Every preset loads, plans to a legal mesh that fits, and describes the published model."""

from pathlib import Path

import pytest

from tidal.cli import main as cli_main
from tidal.config import RunConfig
from tidal.configio import load_config
from tidal.memory_model import total_params

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "tiny.yaml")
TINY = sorted((CONFIGS / "tiny").glob("*.yaml"))

# Published total sizes (model cards), written with the significant digits they are published with.
PUBLISHED_TOTAL = {
    "deepseek_v4_flash": "284B",
    "deepseek_v4_pro": "1.6T",
    "kimi_k2_6": "1T",
    "glm_5_1": "744B",
    "qwen3_5_35b_a3b": "35B",
}
# The trainer meshes: (world, tp, pp, cp, ep, etp)
MESHES = {
    "deepseek_v4_flash": (128, 1, 4, 4, 8, 1),
    "deepseek_v4_pro": (512, 1, 8, 4, 16, 1),
    "kimi_k2_6": (256, 1, 8, 8, 8, 1),
    "glm_5_1": (256, 1, 8, 8, 8, 1),
    "qwen3_5_35b_a3b": (8, 1, 1, 8, 8, 1),
}


def test_there_is_a_preset_and_a_tiny_variant_for_each_seed_model():
    assert {p.stem for p in PRESETS} == set(PUBLISHED_TOTAL)
    assert {p.stem for p in TINY} == set(PUBLISHED_TOTAL)


@pytest.mark.parametrize("path", PRESETS + TINY, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_plan_prints_a_legal_mesh_and_a_memory_estimate(path, capsys):
    assert cli_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ngpu / pp = tp * cp * dp = etp * ep * edp" in out
    assert "layers per stage" in out and "experts per rank" in out
    assert "verdict: fits" in out


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_mesh_algorithm_and_engine(path):
    cfg = load_config(RunConfig, path)
    world, tp, pp, cp, ep, etp = MESHES[path.stem]
    mesh = cfg.trainer.mesh
    assert cfg.trainer.nproc * cfg.trainer.nnodes == world
    assert (mesh.tp, mesh.pp, mesh.cp, mesh.ep, mesh.etp) == (tp, pp, cp, ep, etp)
    assert cfg.trainer.optimizer.kind == "fsdp2"
    loss = cfg.trainer.loss
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert loss.agg == "token-mean" and loss.tis != "off"
    assert cfg.rollout.engine.type == "sglang"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_size_rounds_to_the_published_size(path):
    published = PUBLISHED_TOTAL[path.stem]
    scale = {"B": 1e9, "T": 1e12}[published[-1]]
    digits = len(published[:-1].replace(".", ""))
    total = total_params(load_config(RunConfig, path).model)[0] / scale
    assert float(f"{total:.{digits}g}") == float(published[:-1]), (total, published)


@pytest.mark.parametrize("path", PRESETS + TINY, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_tidal_config_prints_the_preset(path, capsys):
    assert cli_main(["config", str(path)]) == 0
    assert f"family: {load_config(RunConfig, path).model.family}" in capsys.readouterr().out


def test_tiny_variant_keeps_the_preset_layer_kinds():
    for tiny in TINY:
        small = load_config(RunConfig, tiny).model
        big = load_config(RunConfig, CONFIGS / tiny.name).model
        assert small.family == big.family
        kinds = lambda m: {m.attention_kind(i) for i in range(m.num_hidden_layers)}  # noqa: E731
        assert kinds(small) == kinds(big), tiny.stem
        assert (small.first_k_dense_replace > 0) == (big.first_k_dense_replace > 0)
        assert (small.num_hash_layers > 0) == (big.num_hash_layers > 0)
        assert small.hidden_size <= 128 and small.num_experts <= 16

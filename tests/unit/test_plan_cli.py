"""`tidal plan`: rule checks, the verdict, suggestions, dist_opt advice, options."""

import json
from pathlib import Path

import pytest

from tidal.cli import main as cli_main
from tidal.config import RunConfig
from tidal.configio import ConfigError, load_config
from tidal.plan import auto_layout, candidate_meshes, parse_gib, parse_options, plan_errors

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FLASH = str(CONFIGS / "deepseek_v4_flash.yaml")
PRO = str(CONFIGS / "deepseek_v4_pro.yaml")
QWEN = str(CONFIGS / "qwen3_5_35b_a3b.yaml")


def plan(capsys, *args):
    rc = cli_main(["plan", *args])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


@pytest.mark.parametrize(
    ("args", "rule"),
    [
        ((FLASH, "trainer.mesh.tp=2"), "deepseek_v4 does not shard over TP"),
        ((FLASH, "--gpus", "100"), "tp*cp*pp=16 does not divide world size 100"),
        ((FLASH, "trainer.mesh.ep=3"), "num_experts=256 is not divisible by ep=3"),
        ((FLASH, "trainer.mesh.last_stage_layers=12"), "the 31 middle layers are not divisible"),
        ((FLASH, "trainer.mesh.last_stage_layers=null"), "num_hidden_layers=43 is not divisible by pp*vpp=4"),
        ((FLASH, "trainer.micro_batch_tokens=65540"), "not divisible by 2*cp=8"),
        (
            (QWEN, "trainer.mesh.tp=8", "trainer.mesh.cp=1"),
            "tp=8 but tidal trains model.family=qwen3_5_moe with tp=1 only",
        ),
    ],
)
def test_illegal_mesh_fails_naming_the_rule(capsys, args, rule):
    rc, out = plan(capsys, *args)
    assert rc == 2
    assert rule in out


def test_a_mesh_that_does_not_fit_gets_the_nearest_legal_meshes_that_do(capsys):
    rc, out = plan(capsys, PRO, "--gpus", "256", "--suggest", "3")
    assert rc == 1
    assert "DOES NOT FIT" in out
    lines = out.split("nearest legal meshes that fit on 256 GPUs (fsdp2):\n")[1].strip().splitlines()
    assert len(lines) == 3 and all("-> fits" in line for line in lines)
    # the nearest change that fits doubles two degrees, cp 4 -> 8 and ep 16 -> 32 (doubling cp alone
    # leaves a recomputed MoE layer's stacked expert weights and routed copies over the budget)
    assert lines[0].strip().startswith("tp=1 pp=8 cp=8 ep=32 etp=1")


def test_suggested_meshes_are_legal_and_fit():
    cfg = load_config(RunConfig, PRO)
    model, tokens = cfg.model, cfg.trainer.micro_batch_tokens
    meshes = list(candidate_meshes(model, 256, cfg.trainer.mesh, tokens))
    assert meshes and all(not plan_errors(model, m, 256, tokens) for m in meshes)
    assert all(m.tp == 1 for m in meshes)  # DeepSeek-V4 never shards over TP


def test_dist_opt_advice_names_a_larger_pp_times_ep(capsys):
    rc, out = plan(capsys, PRO)
    assert rc == 0
    assert "dist_opt at this mesh" in out
    assert "dist_opt needs a larger PP x EP: pp=8 x ep=32 (= 256, now 128)" in out


def test_nothing_fits_says_what_to_change(capsys):
    rc, out = plan(capsys, FLASH, "--gpus", "32")
    assert rc == 1
    assert "none: add GPUs, shorten trainer.micro_batch_tokens or use larger GPUs" in out


def test_smaller_gpus_change_the_verdict(capsys):
    rc, out = plan(capsys, QWEN)
    assert rc == 0 and "fits only with full activation recompute" in out
    rc, out = plan(capsys, QWEN, "--gpu-mem", "80GB")
    assert rc == 1 and "DOES NOT FIT" in out


def test_measured_peak_is_printed_with_the_error(capsys, tmp_path):
    path = tmp_path / "peak_memory.json"
    path.write_text(json.dumps({"ranks": [{"rank": 0, "pp_rank": 0, "peak_bytes": 50 << 20}]}))
    rc, out = plan(capsys, str(CONFIGS / "tiny" / "qwen3_5_35b_a3b.yaml"), "--measured", str(path))
    assert rc == 0
    assert "measured 50.0 MiB, error" in out


def test_options_and_sizes():
    assert parse_gib("141GB", "--gpu-mem") == 141
    assert parse_gib("80GiB", "--gpu-mem") == 80
    assert parse_gib("512MiB", "--gpu-mem") == 0.5
    assert parse_gib("1.5T", "--gpu-mem") == 1536
    opts = parse_options(["--gpus", "16", "--gpu-mem", "96G", "--reserve", "4GB"])
    assert (opts.gpus, opts.gpu_mem_gib, opts.reserve_gib) == (16, 96, 4)
    with pytest.raises(ConfigError, match="is not a size"):
        parse_options(["--gpu-mem", "lots"])
    with pytest.raises(ConfigError, match="unknown arguments"):
        parse_options(["--gpus", "8", "--fast"])


def test_auto_layout_prefers_even_then_a_lighter_last_stage():
    assert auto_layout(40, 4) == (None, None)
    assert auto_layout(43, 4) == (None, 10)
    assert auto_layout(61, 8) == (None, 5)
    assert auto_layout(78, 8) == (None, 8)
    assert auto_layout(7, 8) is None

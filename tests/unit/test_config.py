import signal
import subprocess
import sys

import pytest

from tidal.cli import main as cli_main
from tidal.cli import split_args
from tidal.config import RunConfig
from tidal.configio import ConfigError, apply_overrides, build, load_config
from tidal.model_config import ModelConfig
from tidal.trainer.mesh import MeshConfig, mesh_errors, resolve_mesh


def test_default_config_loads_and_overrides_apply():
    cfg = load_config(RunConfig, "configs/tiny.yaml", ["trainer.optimizer.lr=1e-4", "broker.max_staleness=0"])
    assert cfg.trainer.optimizer.lr == pytest.approx(1e-4)
    assert cfg.broker.max_staleness == 0
    assert cfg.model.family == "qwen3_moe"


def test_override_creates_nested_sections_and_parses_yaml_scalars():
    data = apply_overrides({}, ["a.b.c=3", "a.d=true", "e=[1, 2]", "f=hello"])
    assert data == {"a": {"b": {"c": 3}, "d": True}, "e": [1, 2], "f": "hello"}


def test_bad_value_names_key_value_and_rule():
    with pytest.raises(ConfigError) as exc:
        build(RunConfig, {"broker": {"group_size": 0}})
    assert "broker.group_size=0" in str(exc.value)
    assert "greater than or equal to 1" in str(exc.value)


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"broker\.grop_size: unknown key"):
        build(RunConfig, {"broker": {"grop_size": 8}})


def test_discriminated_engine_union_rejects_unknown_type():
    with pytest.raises(ConfigError, match="rollout.engine"):
        build(RunConfig, {"rollout": {"engine": {"type": "vllm"}}})


@pytest.mark.parametrize(
    ("mesh", "world", "rule"),
    [
        (MeshConfig(tp=3), 8, "tp*cp*pp=3 does not divide world size 8 (dense world = tp*cp*pp*dp)"),
        (MeshConfig(ep=3), 6, "model.num_experts=4 is not divisible by ep=3"),
        (MeshConfig(pp=4), 4, "num_hidden_layers=2 is not divisible by pp*vpp=4"),
        (MeshConfig(tp=8), 8, "num_attention_heads=4 is not divisible by tp=8"),
        (MeshConfig(vpp=2), 1, "vpp=2 needs pp > 1"),
        (
            MeshConfig(tp=2, sequence_parallel=False),
            2,
            "sequence_parallel must be on when tp > 1 with experts",
        ),
    ],
)
def test_mesh_rules_are_named(mesh, world, rule):
    model = ModelConfig(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    errors = mesh_errors(mesh, world, model)
    assert any(rule in e for e in errors), errors


def test_mesh_accounting_for_a_seed_scale_mesh():
    model = ModelConfig(
        family="qwen3_moe",
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_experts=384,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
    )
    layout = resolve_mesh(MeshConfig(pp=8, ep=8, cp=8), 256, model)
    assert (layout.dp, layout.edp) == (4, 4)
    assert "world/pp=32 = tp*cp*dp = 1*8*4 = etp*ep*edp = 1*8*4" in layout.describe()


def test_illegal_mesh_fails_the_run_config():
    with pytest.raises(ConfigError, match="does not divide world size 2"):
        build(RunConfig, {"trainer": {"nproc": 2, "mesh": {"tp": 4}}, "model": {"num_attention_heads": 4}})


def test_model_config_round_trips_through_hf_dict():
    for family, extra in [
        ("qwen3", {}),
        ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}),
        (
            "deepseek_v3",
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "kv_lora_rank": 32,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                "n_shared_experts": 1,
            },
        ),
    ]:
        cfg = ModelConfig(family=family, **extra)
        back = ModelConfig.from_hf_dict(cfg.to_hf_dict())
        # MLA has no grouped K/V heads and transformers reads its head_dim as the rotary width
        unused = {"head_dim", "num_key_value_heads"} if family == "deepseek_v3" else set()
        assert back.model_dump(exclude=unused) == cfg.model_dump(exclude=unused)
        assert cfg.to_hf_config().model_type == family


def test_cli_reports_bad_config_without_starting(capsys):
    rc = cli_main(["config", "configs/tiny.yaml", "trainer.mesh.tp=3"])
    assert rc == 2
    assert "tp*cp*pp=3 does not divide world size 1" in capsys.readouterr().err


def test_split_args_separates_config_overrides_and_flags():
    cfg, ov, flags = split_args(["configs/tiny.yaml", "a.b=1", "--broker", "tcp://h:1", "--sync"])
    assert (cfg, ov, flags) == ("configs/tiny.yaml", ["a.b=1"], ["--broker", "tcp://h:1", "--sync"])


def test_grpo_needs_groups_of_at_least_two():
    with pytest.raises(ConfigError, match=r"broker.group_size=1 must be >= 2 with trainer.loss.kind=grpo"):
        load_config(RunConfig, "configs/tiny.yaml", ["broker.group_size=1", "warmup.batch_size=1"])
    config = load_config(RunConfig, "configs/tiny.yaml", ["broker.group_size=2", "warmup.batch_size=2"])
    assert config.broker.group_size == 2


def test_warmup_batch_size_must_be_whole_groups():
    assert load_config(RunConfig, "configs/tiny.yaml", ["warmup.batch_size=64"]).warmup.batch_size == 64
    with pytest.raises(ConfigError, match=r"warmup.batch_size=100 must be a multiple of broker.group_size=8"):
        load_config(RunConfig, "configs/tiny.yaml", ["warmup.batch_size=100"])


_CRASHING_SUBCOMMAND = """
import os, sys, types
from tidal import cli

def crash(config, args):
    os.abort()  # as a native library's allocator aborts on a corrupted heap

module = types.ModuleType("crashing_subcommand")
module.main = crash
sys.modules["crashing_subcommand"] = module
cli.COMMANDS["crash"] = ("crashing_subcommand", "aborts")
cli.main(["crash"])
"""


def test_a_native_crash_leaves_the_python_stack_in_the_log():
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_SUBCOMMAND], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in proc.stderr
    assert "line 6 in crash" in proc.stderr, proc.stderr[-2000:]

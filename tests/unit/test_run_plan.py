"""What `tidal run` starts from and which phases it runs (tidal/run_plan.py): the initial model is
model.path where given, the warm-up runs where there are demonstrations, and what cannot be carried out is
refused, naming the setting, before anything is written."""

import json
from pathlib import Path

import pytest

from tidal.cli import load_run_config
from tidal.errors import ConfigError
from tidal.run_plan import plan_run

# a Hugging Face config.json as a checkpoint has it: the default job's model
HF_CONFIG = load_run_config(None, []).model.to_hf_dict()


def _model_dir(tmp_path: Path, weights: bool = True) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    if weights:
        (d / "model.safetensors").write_bytes(b"")
    return d


def _plan(tmp_path: Path, *overrides: str):
    root = tmp_path / "run"
    config = load_run_config(None, [f"run_dir={root}", *overrides])
    return plan_run(config, root, root / "init_hf"), root


def test_the_default_job_initialises_its_model_and_warms_up_on_the_tasks_demonstrations(tmp_path):
    plan, root = _plan(tmp_path)
    assert plan.writes_initial and plan.initial == root / "init_hf"
    assert plan.warmup and plan.demonstrations == root / "data" / "sft.jsonl"
    assert plan.start(root / "sft" / "hf") == root / "sft" / "hf" and plan.start_name == "sft"
    assert plan.eval_rows == root / "data" / "eval.jsonl"

    plan, root = _plan(tmp_path, "warmup.enabled=false")
    assert not plan.warmup and plan.start(root / "sft" / "hf") == root / "init_hf"
    assert plan.start_name == "initial"


def test_your_model_and_data_start_grpo_from_the_model_where_it_lies(tmp_path):
    model = _model_dir(tmp_path)
    data = tmp_path / "train.parquet"
    given = ("task.name=gsm8k", f"model.path={model}", f"broker.data.path={data}")
    plan, root = _plan(tmp_path, *given)
    assert not plan.writes_initial and plan.initial == model
    assert not plan.warmup and plan.start(root / "sft" / "hf") == model
    assert plan.eval_rows is None  # nothing to evaluate on without task.eval_path

    demos = tmp_path / "demos.jsonl"
    demos.write_text('{"prompt": "1+1=", "response": "2"}\n')
    plan, root = _plan(tmp_path, *given, f"warmup.data={demos}", f"task.eval_path={data}")
    assert plan.warmup and plan.demonstrations == demos and plan.eval_rows == data
    assert plan.start(root / "sft" / "hf") == root / "sft" / "hf"


def test_what_cannot_be_carried_out_is_refused_naming_the_setting(tmp_path):
    model = _model_dir(tmp_path)
    given = ("task.name=gsm8k", f"model.path={model}", f"broker.data.path={tmp_path / 'train.jsonl'}")
    with pytest.raises(
        ConfigError, match=r"warmup.enabled=true: task.name=gsm8k has no demonstrations.*warmup.data"
    ):
        _plan(tmp_path, *given, "warmup.enabled=true")
    with pytest.raises(ConfigError, match=r"warmup.data=.*nope.jsonl: file does not exist"):
        _plan(tmp_path, *given, f"warmup.data={tmp_path / 'nope.jsonl'}")
    # the arithmetic task writes demonstrations only with the data it generates
    with pytest.raises(
        ConfigError, match=r"arithmetic task writes demonstrations only with the data it generates"
    ):
        _plan(tmp_path, f"broker.data.path={tmp_path / 'train.jsonl'}", "warmup.enabled=true")
    plan, _ = _plan(tmp_path, f"broker.data.path={tmp_path / 'train.jsonl'}")
    assert not plan.warmup

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(
        ConfigError, match=r"model.path=.*bare: no model.safetensors or model.safetensors.index.json"
    ):
        _plan(tmp_path, "task.name=gsm8k", f"model.path={bare}", f"broker.data.path={tmp_path / 'x.jsonl'}")


def test_a_model_path_without_a_readable_config_names_the_key():
    with pytest.raises(ConfigError, match=r"model.path=/nonexistent/model: no config.json there"):
        load_run_config(None, ["model.path=/nonexistent/model"])

"""What a Hugging Face directory holds beside its weights travels with the model, and nothing else does:
an initial model whose tokenizer comes from another model's directory keeps its own weights and config."""

import json
from pathlib import Path

from safetensors import safe_open

from tidal.bootstrap import init_hf_model
from tidal.cli import load_run_config
from tidal.rollout.tasks.char_tokenizer import DEFAULT_CHARSET, save_char_tokenizer
from tidal.weights_sync.hf_io import copy_side_files

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _other_models_dir(tmp_path: Path) -> Path:
    """A model directory as a hub download has it: weights (single, sharded, .bin), config, tokenizer."""
    d = tmp_path / "other"
    save_char_tokenizer(d, DEFAULT_CHARSET)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 4096}))
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.123}))
    for name in ("model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin"):
        (d / name).write_bytes(b"not these weights")
    (d / "model.safetensors.index.json").write_text("{}")
    return d


def test_side_files_are_copied_and_weights_and_config_are_not(tmp_path):
    source = _other_models_dir(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    copied = copy_side_files(source, target)
    assert "chat_template.jinja" in copied and "generation_config.json" in copied
    assert "tokenizer.json" in copied
    assert not {"config.json", "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"} & {
        p.name for p in target.iterdir()
    }


def test_an_initial_model_keeps_its_own_weights_beside_another_models_tokenizer(tmp_path):
    source = _other_models_dir(tmp_path)
    model = load_run_config(None, []).model  # the default job's tiny model
    out = init_hf_model(model, source, tmp_path / "init_hf", seed=0)
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == model.hidden_size
    assert json.loads((out / "generation_config.json").read_text()).get("temperature") != 0.123
    with safe_open(out / "model.safetensors", "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert tuple(embed.shape) == (model.vocab_size, model.hidden_size)
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    assert not (out / "model.safetensors.index.json").exists() and not (out / "pytorch_model.bin").exists()

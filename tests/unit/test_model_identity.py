import json

from tidal.model_config import ModelConfig
from tidal.model_identity import model_identity


def test_a_checkpoint_written_from_a_config_has_that_configs_identity_wherever_it_lies(tmp_path):
    model = ModelConfig(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    for where in ("a", "copy"):
        (tmp_path / where).mkdir()
        (tmp_path / where / "config.json").write_text(json.dumps(model.to_hf_dict()))
    from_config = model_identity(model)
    from_dirs = [model_identity(ModelConfig(path=str(tmp_path / w))) for w in ("a", "copy")]
    assert {i["fingerprint"] for i in from_dirs} == {from_config["fingerprint"]}
    assert from_config["summary"] == "qwen3_moe (vocab 512, hidden 128, 2 layers, 4 experts)"
    assert from_dirs[1]["summary"].endswith(f"from {tmp_path / 'copy'}")


def test_any_architecture_field_changes_the_fingerprint():
    base = model_identity(ModelConfig())["fingerprint"]
    others = [ModelConfig(hidden_size=64), ModelConfig(vocab_size=513), ModelConfig(rope_theta=1e6)]
    assert base not in {model_identity(m)["fingerprint"] for m in others}
    assert len({model_identity(m)["fingerprint"] for m in others}) == 3

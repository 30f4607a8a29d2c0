"""The embedded engine loads a Hugging Face model directory (config, safetensors, tokenizer.json)."""

from __future__ import annotations

import asyncio

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from tidal.model_config import ModelConfig
from tidal.rollout.config import EmbeddedEngineConfig
from tidal.rollout.embedded.sampling import SamplingParams
from tidal.rollout.embedded.service import EmbeddedEngine, GenerateInput


def save_model_dir(path) -> torch.nn.Module:
    cfg = ModelConfig(
        family="qwen3_moe",
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    torch.manual_seed(11)
    lm = transformers.AutoModelForCausalLM.from_config(cfg.to_hf_config()).eval()
    lm.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(40)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return lm


def test_engine_serves_a_saved_hf_directory_with_its_tokenizer(tmp_path):
    saved = save_model_dir(tmp_path)
    engine = EmbeddedEngine(
        ModelConfig(path=str(tmp_path)), EmbeddedEngineConfig(max_batch_size=4, max_seq_len=32), seed=0
    )
    assert engine.model_config.family == "qwen3_moe" and engine.tokenizer is not None
    for name, p in saved.named_parameters():
        assert torch.equal(engine.loader.read(name), p), name
    engine.start()
    try:
        prompt = engine.encode("w3 w5 w7")
        assert prompt == [3, 5, 7]

        async def go():
            inp = GenerateInput(
                input_ids=prompt, params=SamplingParams(max_new_tokens=6, temperature=0), return_logprob=True
            )
            return (await engine.generate([inp]))[0]

        req = asyncio.run(go())
    finally:
        engine.close()
    expected = saved.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert req.output_ids == expected[0, 3:].tolist()
    assert engine.decode(req.output_ids) == " ".join(f"w{t}" for t in req.output_ids)

"""`tidal run` on your own model and data: a Hugging Face checkpoint given as model.path (a tiny Qwen3 with a
byte-level BPE tokenizer and a chat template, built here: nothing is downloaded) and GSM8K-style verl
parquet rows. The job starts GRPO from that checkpoint where it lies (no initialisation, no warm-up: there
are no demonstrations), serves the chat-formatted prompts through the embedded engines, and evaluates the
initial model against GRPO's result on the held-out rows."""

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch

from tidal.procs import free_port, python_cmd

LM_HEAD = 0.0123  # every lm_head weight of the user's checkpoint: a fresh initialisation would not have it
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _rows(n: int, split: str, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        question = f"Sam has {a} pens and gets {b} more. How many pens now? {INSTRUCTION}"
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def _users_model_and_data(root: Path) -> tuple[Path, Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    rng = random.Random(0)
    train, test = _rows(200, "train", rng), _rows(16, "test", rng)
    pq.write_table(pa.Table.from_pylist(train), root / "train.parquet")
    pq.write_table(pa.Table.from_pylist(test), root / "test.parquet")

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [f"{r['prompt'][0]['content']} #### {r['reward_model']['ground_truth']}" for r in train]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template
    )
    model_dir = root / "model"
    tokenizer.save_pretrained(model_dir)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.fill_(LM_HEAD)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir, root / "train.parquet", root / "test.parquet"


@pytest.mark.slow
def test_tidal_run_trains_your_checkpoint_on_your_verl_rows(tmp_path: Path):
    model_dir, train, test = _users_model_and_data(tmp_path)
    run_dir = tmp_path / "run"
    cmd = python_cmd(
        "run",
        "configs/tiny.yaml",
        f"run_dir={run_dir}",
        f"broker.bind=tcp://127.0.0.1:{free_port()}",
        "task.name=gsm8k",
        f"model.path={model_dir}",
        f"broker.data.path={train}",
        f"task.eval_path={test}",
        "trainer.steps=2",
        "broker.batch_groups=2",
        "rollout.nodes=1",
        "rollout.sampling.max_new_tokens=8",
        "rollout.engine.max_seq_len=96",
        "--plain",
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log"))
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    assert "no warm-up: GRPO starts from the initial model" in proc.stdout

    assert not (run_dir / "init_hf").exists() and not (run_dir / "sft").exists()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["start"] == "initial" and report["eval_problems"] == 16
    assert {"initial", "grpo"} <= report.keys() and not {"sft", "control_sft"} & report.keys()
    assert report["journal"]["problems"] == []
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]

    from safetensors import safe_open
    from transformers import AutoTokenizer

    final = run_dir / "final_hf"
    with safe_open(final / "model.safetensors", "pt") as f:
        lm_head = f.get_tensor("lm_head.weight")
    # two steps at the warming-up learning rate move a weight by far less than 1e-3
    assert (lm_head - LM_HEAD).abs().max() < 1e-3
    assert (
        AutoTokenizer.from_pretrained(final).chat_template
        == AutoTokenizer.from_pretrained(model_dir).chat_template
    )

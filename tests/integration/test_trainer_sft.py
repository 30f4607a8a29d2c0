"""``tidal sft`` under torchrun on the arithmetic task's SFT rows, from a Hugging Face initialisation.

The run loads transformers' initial weights through weights_sync's mapping, trains (the loss must fall), and
exports a Hugging Face directory with the tokenizer (and its chat template) that transformers loads back,
with weights that differ from the initial ones.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tidal.cli import load_run_config
from tidal.procs import free_port


@pytest.mark.slow
def test_sft_trains_from_hf_and_exports_hf(tmp_path):
    from tidal.bootstrap import init_hf_model
    from tidal.rollout.tasks import prepare_task

    overrides = [f"run_dir={tmp_path}", "task.num_train=64", "task.num_eval=8", "broker.batch_groups=4"]
    config = load_run_config(None, overrides)
    files = prepare_task(config, tmp_path)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (files.tokenizer / "chat_template.jinja").write_text(template)  # a template travels with the tokenizer
    init_hf_model(config.model, files.tokenizer, tmp_path / "init_hf", seed=0)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=1",
        f"--master-port={free_port()}",
        "-m",
        "tidal.cli",
        "sft",
        *overrides,
        "--init",
        str(tmp_path / "init_hf"),
        "--out",
        str(tmp_path / "sft"),
        "--steps",
        "6",
        "--lr",
        "3e-3",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 0.1, f"SFT loss did not go down: {losses}"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = tmp_path / "sft" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert tokenizer.eos_token_id is not None
    assert tokenizer.chat_template == template
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "init_hf", torch_dtype=torch.float32)
    changed = [
        n for n, p in model.named_parameters() if not torch.equal(p, dict(initial.named_parameters())[n])
    ]
    assert changed, "the exported weights are the initial ones: training was not exported"

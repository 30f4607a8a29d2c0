import json

import pytest
from transformers import AutoTokenizer

from tidal.broker.types import PromptRow
from tidal.cli import load_run_config
from tidal.config import RunConfig
from tidal.configio import build, load_config
from tidal.errors import ConfigError
from tidal.rollout.tasks import build_task, load_tokenizer, prepare_task, task_files
from tidal.rollout.tasks.arithmetic import make_records
from tidal.rollout.tasks.char_tokenizer import DEFAULT_CHARSET, save_char_tokenizer
from tidal.rollout.tasks.data import read_rows, write_records


def _pairs(records):
    return [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in records]


def test_records_are_deterministic_by_seed_and_eval_is_disjoint():
    train, evaluation = make_records(digits=2, num_train=300, num_eval=50, seed=3)
    again_train, again_eval = make_records(digits=2, num_train=300, num_eval=50, seed=3)
    other_train, _ = make_records(digits=2, num_train=300, num_eval=50, seed=4)
    assert train == again_train and evaluation == again_eval
    assert _pairs(train) != _pairs(other_train)
    assert len(train) == 300 and len(evaluation) == 50
    assert len(set(_pairs(evaluation))) == 50
    assert not set(_pairs(train)) & set(_pairs(evaluation))


def test_rows_are_fixed_width_addition_with_the_sum_as_ground_truth():
    train, _ = make_records(digits=2, num_train=200, num_eval=10, seed=0)
    for r in train:
        a, b = r["extra_info"]["a"], r["extra_info"]["b"]
        assert r["prompt"] == f"{a:02d}+{b:02d}="
        assert len(r["prompt"]) == 6
        assert r["reward_model"]["ground_truth"] == str(a + b)
        assert r["data_source"] == "arithmetic"


def test_train_cycles_through_every_non_eval_pair_before_repeating():
    # 1 digit: 100 problems, 10 for eval, so the first 90 train rows are the other 90, each once
    train, evaluation = make_records(digits=1, num_train=200, num_eval=10, seed=1)
    first_pass = _pairs(train[:90])
    assert len(set(first_pass)) == 90
    assert set(first_pass) | set(_pairs(evaluation)) == {(a, b) for a in range(10) for b in range(10)}


def test_large_operand_spaces_sample_without_enumerating():
    train, evaluation = make_records(digits=5, num_train=2000, num_eval=300, seed=0)
    assert len(set(_pairs(evaluation))) == 300
    assert not set(_pairs(train)) & set(_pairs(evaluation))
    assert all(len(r["prompt"]) == 12 for r in train)
    assert make_records(digits=5, num_train=2000, num_eval=300, seed=0)[0] == train


def test_eval_larger_than_the_problem_space_is_a_clear_error():
    with pytest.raises(ValueError, match="only 100 distinct problems"):
        make_records(digits=1, num_train=10, num_eval=100, seed=0)


# a Hugging Face config.json as a checkpoint has it: the default job's model
HF_CONFIG = load_run_config(None, []).model.to_hf_dict()


def _config(tmp_path, *overrides):
    return load_config(
        RunConfig,
        "configs/tiny.yaml",
        [f"run_dir={tmp_path}", "task.num_train=400", "task.num_eval=40", *overrides],
    )


def test_prepare_task_writes_data_and_a_tokenizer_that_autotokenizer_loads(tmp_path):
    files = prepare_task(_config(tmp_path), tmp_path)
    assert files.train == tmp_path / "data" / "train.jsonl"
    rows = list(read_rows(files.train))
    assert len(rows) == 400 and isinstance(rows[0], PromptRow)
    assert len(list(read_rows(files.eval))) == 40
    sft = [json.loads(line) for line in files.sft.read_text().splitlines()]
    assert sft[0]["prompt"] == rows[0].prompt and sft[0]["response"] == rows[0].ground_truth

    tok = AutoTokenizer.from_pretrained(files.tokenizer)
    assert type(load_tokenizer(files.tokenizer)) is type(tok)  # the shortcut loads what AutoTokenizer does
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert len(tok) <= 32  # fits tiny.yaml's model.vocab_size
    ids = tok("07+45=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 7
    assert tok.decode(ids, skip_special_tokens=True) == "07+45="


def test_prepare_task_is_idempotent_and_regenerates_when_the_config_changes(tmp_path):
    files = prepare_task(_config(tmp_path), tmp_path)
    before = files.train.stat().st_mtime_ns
    prepare_task(_config(tmp_path), tmp_path)
    assert files.train.stat().st_mtime_ns == before
    first = files.train.read_text()
    prepare_task(_config(tmp_path, "seed=7"), tmp_path)
    assert files.train.read_text() != first


def test_a_given_tokenizer_and_eval_file_are_read_never_written(tmp_path):
    # a user's tokenizer (here a character-level one with a marker file) and held-out rows
    theirs = tmp_path / "their_tokenizer"
    save_char_tokenizer(theirs, DEFAULT_CHARSET + "abc")
    (theirs / "tokenizer_config.json").write_text((theirs / "tokenizer_config.json").read_text() + " ")
    before = {f.name: f.read_bytes() for f in theirs.iterdir()}
    held_out = tmp_path / "held_out.jsonl"
    write_records(
        held_out, [{"data_source": "mine", "prompt": "01+01=", "reward_model": {"ground_truth": "2"}}]
    )
    run = tmp_path / "run"
    files = prepare_task(_config(run, f"task.tokenizer={theirs}", f"task.eval_path={held_out}"), run)
    assert files.tokenizer == theirs and files.eval == held_out
    assert {f.name: f.read_bytes() for f in theirs.iterdir()} == before
    assert len(list(read_rows(held_out))) == 1 and not (run / "tokenizer").exists()
    assert len(list(read_rows(run / "data" / "eval.jsonl"))) == 40  # its own held-out rows, beside
    # a checkpoint keeps its own tokenizer; a model tidal initialises gets the character-level one
    model = tmp_path / "model"
    save_char_tokenizer(model, DEFAULT_CHARSET)
    (model / "config.json").write_text(json.dumps(HF_CONFIG))
    assert task_files(_config(run, f"model.path={model}"), run).tokenizer == model
    assert task_files(_config(run), run).tokenizer == run / "tokenizer"


def test_a_vocab_too_small_for_the_tokenizer_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"model.vocab_size=16 is smaller than the tokenizer's 18 tokens"):
        prepare_task(_config(tmp_path, "model.vocab_size=16"), tmp_path)


def test_arithmetic_task_tokenizes_and_scores_with_hand_computed_ids(tmp_path):
    cfg = _config(tmp_path)
    prepare_task(cfg, tmp_path)
    task = build_task(cfg, tmp_path)
    row = PromptRow(index=0, data_source="arithmetic", prompt="07+45=", ground_truth="52")
    # vocab: <pad>=0 <bos>=1 <eos>=2 <unk>=3, then '0'..'9' = 4..13, '+'=14 '-'=15 '*'=16 '='=17
    assert task.prompt_ids(row) == [1, 4, 11, 14, 8, 9, 17]
    assert task.response_ids("52") == [9, 6, 2]
    assert task.stop_token_ids == [2]

    import asyncio

    assert asyncio.run(task.score(row, [9, 6, 2])).reward == 1.0
    assert asyncio.run(task.score(row, [9, 7, 2])).reward == 0.0
    assert asyncio.run(task.score(row, [9, 6, 6])).reward == 0.0  # "522": no early stop, wrong


def test_custom_task_without_a_reward_is_rejected_before_anything_starts():
    with pytest.raises(ConfigError, match="task.name=custom needs task.reward"):
        build(RunConfig, {"task": {"name": "custom"}})


def test_the_sft_set_holds_the_first_num_sft_train_rows_and_rl_prompts_all_of_them(tmp_path):
    files = prepare_task(_config(tmp_path, "task.num_sft=50"), tmp_path)
    rows = list(read_rows(files.train))
    sft = [json.loads(line) for line in files.sft.read_text().splitlines()]
    assert len(rows) == 400 and len(sft) == 50
    assert [s["prompt"] for s in sft] == [r.prompt for r in rows[:50]]
    files = prepare_task(_config(tmp_path, "task.num_sft=null"), tmp_path)
    assert len(files.sft.read_text().splitlines()) == 400

import pytest

from tidal.config import RunConfig
from tidal.configio import load_config
from tidal.errors import ConfigError
from tidal.rollout.tasks import TaskFiles, check_prompts, prepare_task, task_files
from tidal.rollout.tasks.char_tokenizer import save_char_tokenizer
from tidal.rollout.tasks.data import read_rows, write_records
from tidal.rollout.tasks.gsm8k import INSTRUCTION, gsm8k_record


def test_gsm8k_rows_become_verl_rows_with_the_final_number_as_ground_truth():
    record = gsm8k_record("How many?", "48/2 = 24 clips\n#### 1,072", index=5, split="test")
    assert record["data_source"] == "openai/gsm8k"
    assert record["prompt"] == [{"role": "user", "content": f"How many? {INSTRUCTION}"}]
    assert record["reward_model"] == {"style": "rule", "ground_truth": "1072"}
    assert record["extra_info"]["index"] == 5
    with pytest.raises(ValueError, match="no '#### <number>' line"):
        gsm8k_record("q", "no final answer", index=0)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_verl_rows_round_trip_through_jsonl_and_parquet(tmp_path, suffix):
    records = [gsm8k_record(f"q{i}", f"#### {i}", index=i) for i in range(3)]
    path = tmp_path / f"train{suffix}"
    assert write_records(path, records) == 3
    rows = list(read_rows(path))
    assert [r.index for r in rows] == [0, 1, 2]
    assert rows[2].ground_truth == "2" and rows[2].prompt == records[2]["prompt"]
    assert rows[1].extra_info["question"] == "q1"


def test_a_row_without_a_prompt_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"data_source": "x", "prompt": "a"}\n{"data_source": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl 1: missing field\(s\) \['prompt'\]"):
        list(read_rows(path))


def test_user_data_tasks_need_a_data_path_and_a_tokenizer(tmp_path):
    cfg = load_config(RunConfig, None, ["task.name=gsm8k"])
    with pytest.raises(ConfigError, match="set broker.data.path"):
        task_files(cfg)
    cfg = load_config(RunConfig, None, ["task.name=gsm8k", f"broker.data.path={tmp_path}/train.jsonl"])
    with pytest.raises(ConfigError, match="set task.tokenizer or model.path"):
        task_files(cfg)
    cfg = load_config(
        RunConfig,
        None,
        ["task.name=gsm8k", f"broker.data.path={tmp_path}/train.jsonl", f"task.tokenizer={tmp_path}/tok"],
    )
    with pytest.raises(ConfigError, match=r"broker.data.path=.*train.jsonl'?: file does not exist"):
        prepare_task(cfg, tmp_path)


def test_data_the_tokenizer_cannot_render_is_refused_before_the_job_starts(tmp_path):
    save_char_tokenizer(tmp_path / "tok")  # no chat template
    chat = tmp_path / "chat.jsonl"
    write_records(chat, [gsm8k_record("1+1?", "#### 2", 0)])
    plain = tmp_path / "plain.jsonl"
    write_records(plain, [{"data_source": "d", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}])
    check_prompts(TaskFiles(train=plain, eval=None, sft=None, tokenizer=tmp_path / "tok"))
    with pytest.raises(ConfigError, match=r"broker.data.path=.*chat.jsonl with the tokenizer .*tok: row 0"):
        check_prompts(TaskFiles(train=chat, eval=None, sft=None, tokenizer=tmp_path / "tok"))

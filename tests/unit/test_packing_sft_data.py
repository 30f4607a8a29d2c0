"""SFT rows (verl format, parquet and JSONL) tokenised, batched by step and packed with response-only loss."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidal.rollout.tasks.char_tokenizer import build_char_tokenizer
from tidal.trainer.data import SFTDataConfig, SFTDataset, rows_from_records
from tidal.trainer.packing import plan_minibatch


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_jsonl_prompt_response_rows_tokenised_like_the_rollout(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "sft.jsonl", [{"prompt": "12+3=", "response": "15"}, {"prompt": "1+1=", "response": "2"}]
    )
    data = SFTDataset(SFTDataConfig(path=path, batch_size=2, shuffle=False), tokenizer)
    first = data.items[0].sample
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert first.prompt_ids.tolist() == [bos, *tokenizer.convert_tokens_to_ids(list("12+3="))]
    assert first.response_ids.tolist() == [*tokenizer.convert_tokens_to_ids(list("15")), eos]

    plan = plan_minibatch(data.batch(0), dp_size=1, max_tokens=64)
    (mb,) = plan.micro_batches(0)
    # the loss is on exactly the response tokens (and EOS): 3 + 2
    assert plan.normalizer.tokens == 5
    assert (
        mb.labels[mb.loss_mask == 1].tolist()
        == first.response_ids.tolist() + data.items[1].sample.response_ids.tolist()
    )


def test_parquet_with_nested_gsm8k_style_keys(tmp_path, tokenizer):
    records = [
        {"data_source": "gsm8k", "extra_info": {"question": f"{i}+{i}=", "answer": str(2 * i)}}
        for i in range(5)
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    config = SFTDataConfig(
        path=str(path), prompt_key="extra_info.question", response_key="extra_info.answer", batch_size=2
    )
    data = SFTDataset(config, tokenizer)
    assert len(data.items) == 5 and data.steps_per_epoch == 2
    # batches are a function of the step: the same on a resumed run, reshuffled per epoch, no repeats in one
    epoch0 = [tuple(x.sample.prompt_ids) for s in range(2) for x in data.batch(s)]
    assert len(set(epoch0)) == 4
    again = SFTDataset(config, tokenizer)
    assert [x.sample.prompt_ids.tolist() for x in again.batch(3)] == [
        x.sample.prompt_ids.tolist() for x in data.batch(3)
    ]


def test_multi_turn_messages_train_the_last_assistant_turn():
    records = [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
            ]
        }
    ]
    (row,) = rows_from_records(records, SFTDataConfig(path="x.jsonl", messages_key="messages"))
    assert row.response == "4" and len(row.prompt) == 3
    with pytest.raises(ValueError, match="must end with an assistant message"):
        rows_from_records(
            [{"messages": records[0]["messages"][:3]}], SFTDataConfig(path="x.jsonl", messages_key="messages")
        )


def test_clear_errors_for_missing_columns_and_long_rows(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "1+1=", "response": "2"}])
    with pytest.raises(KeyError, match="has no 'prompt'"):
        SFTDataset(SFTDataConfig(path=path, batch_size=1), tokenizer)
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "1+1=", "response": "2222222"}])
    with pytest.raises(ValueError, match="over max_length=8; raise max_length or set truncation=right"):
        SFTDataset(SFTDataConfig(path=path, batch_size=1, max_length=8), tokenizer)
    data = SFTDataset(SFTDataConfig(path=path, batch_size=1, max_length=8, truncation="right"), tokenizer)
    sample = data.items[0].sample
    assert len(sample.prompt_ids) + len(sample.response_ids) == 8
    np.testing.assert_array_equal(sample.logprobs, np.zeros(3, np.float32))

"""The prompt source: verl-format parquet and JSONL, seeded per-epoch shuffles, exactly once per epoch."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidal.broker.source import PromptSource, load_rows
from tidal.broker.testing import synthetic_rows, write_rows
from tidal.errors import ConfigError
from tidal.rollout.tasks.data import read_rows


def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    rows = synthetic_rows(5)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    a = load_rows(write_rows(tmp_path / "d.jsonl", rows))
    b = load_rows(tmp_path / "d.parquet")
    assert a == b
    assert a[2].ground_truth == "5" and a[2].data_source == "synthetic/add"
    assert a[2].prompt == [{"role": "user", "content": "2 + 3 = ?"}] and a[2].extra_info == {"index": 2}


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("d.jsonl", '{"data_source": "x"}\n', "no 'prompt' column"),
        ("d.jsonl", "not json\n", "line 1 is not JSON"),
        ("d.jsonl", "", "has no rows"),
        ("d.csv", "a,b\n", "unknown format '.csv'"),
    ],
)
def test_bad_data_files_are_named_with_the_reason(tmp_path, name, content, words):
    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=words):
        load_rows(tmp_path / name)


def test_a_directory_of_shards_and_a_list_of_data_sets_are_numbered_in_order(tmp_path):
    rows = synthetic_rows(7)
    shards = tmp_path / "train"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[3:]), shards / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:3]), shards / "train-00000-of-00002.parquet")
    (shards / "README.md").write_text("not data")
    whole = load_rows(write_rows(tmp_path / "all.jsonl", rows))
    assert load_rows(shards) == whole  # name order: shard 0 first
    other = write_rows(tmp_path / "other.jsonl", synthetic_rows(2))
    mixed = load_rows([str(shards), str(other)])
    assert mixed[:7] == whole and [r.index for r in mixed] == list(range(9))
    assert mixed[7].prompt == load_rows(other)[0].prompt
    # read the same way by the launcher's checks and the evaluation
    assert [r.index for r in read_rows([shards, other])] == list(range(9))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty'?: the directory holds no .parquet or .jsonl file"):
        load_rows(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"broker.data.path=\[\]"):
        load_rows([])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")


def test_each_row_once_per_epoch_in_a_seeded_order_then_exhausted(tmp_path):
    rows = load_rows(write_rows(tmp_path / "d.jsonl", 10))
    src = PromptSource(rows, seed=3, shuffle=True, epochs=2)
    first = src.take(4) + src.take(4) + src.take(4)
    assert len(first) == 12
    epoch0 = [g for g in first if g.startswith("0:")]
    assert sorted(int(g[2:]) for g in epoch0) == list(range(10))
    rest = src.take(100)
    assert len(first) + len(rest) == 20 and src.exhausted and src.take(1) == []
    again = PromptSource(rows, seed=3, shuffle=True, epochs=2)
    assert again.take(20) == first + rest
    other = PromptSource(rows, seed=4, shuffle=True, epochs=2).take(10)
    assert other != epoch0
    assert [g for g in first + rest if g.startswith("1:")] != [f"1:{g[2:]}" for g in epoch0]


def test_seek_resumes_the_same_sequence(tmp_path):
    rows = load_rows(write_rows(tmp_path / "d.jsonl", 7))
    a = PromptSource(rows, seed=0, shuffle=True, epochs=None)
    head = a.take(9)
    b = PromptSource(rows, seed=0, shuffle=True, epochs=None)
    b.seek(a.epoch, a.pos)
    assert b.take(10) == a.take(10)
    assert sorted(head[:7]) == [f"0:{i}" for i in range(7)] and head[:7] != sorted(head[:7])
    assert PromptSource(rows, seed=0, shuffle=False, epochs=1).take(7) == [f"0:{i}" for i in range(7)]

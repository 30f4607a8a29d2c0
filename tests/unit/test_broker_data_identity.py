"""A broker resumes its journal only over the prompt data it was written over: the journal keeps the
source's identity (rows, order, a digest of their content), and a replay over other data is refused with
a ConfigError that says what changed, before a lease could name a row of the wrong data."""

import msgpack
import pytest

from tidal.broker.codec import encode_group
from tidal.broker.config import BrokerConfig
from tidal.broker.journal import Journal
from tidal.broker.journal_records import Kind, read_records
from tidal.broker.source import PromptSource, load_rows
from tidal.broker.state import BrokerState
from tidal.broker.testing import fake_group, synthetic_rows, write_rows
from tidal.errors import ConfigError

T0 = 1_000_000.0


def state_over(tmp_path, rows, seed=0, shuffle=True, file="data.jsonl", **cfg):
    """A broker state over ``rows`` (a count or rows) written to ``file``, replaying the journal in
    ``tmp_path/journal``."""
    data = write_rows(tmp_path / file, rows)
    settings = {"group_size": 2, "batch_groups": 2, "max_staleness": 3} | cfg
    settings["data"] = {"path": str(data)} | settings.get("data", {})
    config = BrokerConfig.model_validate(settings)
    source = PromptSource(load_rows(data), seed=seed, shuffle=shuffle, epochs=None)
    journal = Journal(tmp_path / "journal", fsync="never")
    state = BrokerState(config, source, journal)
    state.replay(journal.open())
    return state


def run_a_little(state):
    """Lease four groups, submit two of them, cut a batch; the other two stay out on their lease."""
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 4, T0)
    state.submit(node, lease.lease_id, [encode_group(fake_group(pg)) for pg in lease.groups[:2]], T0)
    state.get_batch(-1, None)
    state.journal.flush()
    state.journal.close()


def takes(tmp_path):
    records = read_records(memoryview((tmp_path / "journal" / "journal.log").read_bytes()))[0]
    return [msgpack.unpackb(p) for k, p in records if k is Kind.TAKE]


def test_the_same_data_resumes_and_the_identity_is_journaled_once(tmp_path):
    run_a_little(state_over(tmp_path, 20))
    again = state_over(tmp_path, 20)
    assert sorted(again.requeue) and again.source.pos == 4
    node = again.register(b"b", "rollout", "b", {}, T0)
    again.lease(node, 4, T0)  # the two re-queued groups and two fresh ones: a TAKE without the identity
    again.journal.flush()
    recorded = [t.get("source") for t in takes(tmp_path)]
    assert recorded[0] == again.source.identity and recorded[1:] == [None]
    assert recorded[0]["rows"] == 20 and recorded[0]["seed"] == 0 and len(recorded[0]["digest"]) == 24


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"rows": 5}, "rows 20 -> 5"),
        ({"seed": 7}, "seed 0 -> 7"),
        ({"shuffle": False}, "shuffle True -> False"),
        ({"rows": [r | {"reward_model": {"ground_truth": "0"}} for r in synthetic_rows(20)]}, "digest"),
    ],
)
def test_other_data_under_the_same_journal_is_refused_naming_what_changed(tmp_path, change, words):
    run_a_little(state_over(tmp_path, 20))
    with pytest.raises(ConfigError) as err:
        state_over(tmp_path, **({"rows": 20} | change))
    message = str(err.value)
    assert "broker.data.path=" in message and "written over other prompt data" in message and words in message
    assert "broker.journal.dir" in message


def test_more_epochs_and_the_same_rows_in_another_file_resume(tmp_path):
    run_a_little(state_over(tmp_path, 20))
    (tmp_path / "data.jsonl").unlink()
    again = state_over(tmp_path, 20, file="elsewhere.jsonl", data={"epochs": 3})
    assert again.source.pos == 4 and again.cfg.data.path.endswith("elsewhere.jsonl")


def test_a_compacted_journal_keeps_the_identity(tmp_path):
    state = state_over(tmp_path, 20, journal={"compact_every_bytes": 1, "compact_dead_per_live": 0})
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 4, T0)
    state.submit(node, lease.lease_id, [encode_group(fake_group(pg)) for pg in lease.groups], T0)
    state.get_batch(-1, None)
    state.report_consumed(0)
    assert state.maybe_compact()
    state.journal.flush()
    state.journal.close()
    assert takes(tmp_path) == []  # the history went into the snapshot
    with pytest.raises(ConfigError, match="seed 0 -> 1"):
        state_over(tmp_path, 20, seed=1)
    assert state_over(tmp_path, 20).source.pos == 4


def test_a_journal_of_an_earlier_tidal_is_checked_by_the_rows_its_groups_name(tmp_path):
    journal = Journal(tmp_path / "journal", fsync="never")
    journal.open()
    journal.append(Kind.TAKE, msgpack.packb({"ids": ["0:3", "0:17"], "epoch": 0, "pos": 2}))  # no identity
    journal.flush()
    journal.close()
    with pytest.raises(ConfigError, match=r"rows this data does not have \(\['0:17'\], but 10 rows\)"):
        state_over(tmp_path, 10)
    state = state_over(tmp_path, 20)
    assert sorted(state.requeue) == ["0:17", "0:3"]
    assert state.journaled_source is None  # recorded by its first TAKE
    node = state.register(b"a", "rollout", "a", {}, T0)
    state.lease(node, 3, T0)
    state.journal.flush()
    assert takes(tmp_path)[-1]["source"] == state.source.identity

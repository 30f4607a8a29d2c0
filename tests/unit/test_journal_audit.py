"""The journal audit (``tidal run``'s account of every prompt group, ``tidal journal``) over a real broker
state's journal."""

import json

import pytest

from tidal.broker.codec import encode_group
from tidal.broker.config import BrokerConfig
from tidal.broker.journal import Journal
from tidal.broker.journal_records import Kind, read_records
from tidal.broker.source import PromptSource, load_rows
from tidal.broker.state import BrokerState
from tidal.broker.testing import fake_group, write_rows
from tidal.cli import main as tidal
from tidal.journal_audit import audit_journal

T0 = 1_000_000.0


def _state(tmp_path, **journal_settings):
    write_rows(tmp_path / "data.jsonl", 6)
    config = BrokerConfig.model_validate(
        {"group_size": 2, "batch_groups": 2, "max_staleness": 3, "journal": journal_settings}
    )
    source = PromptSource(load_rows(tmp_path / "data.jsonl"), seed=0, shuffle=True, epochs=1)
    journal = Journal(tmp_path / "journal", fsync="never")
    state = BrokerState(config, source, journal)
    state.replay(journal.open())
    return state


def test_the_audit_follows_groups_journaled_packed_or_plain_through_batches(tmp_path):
    state = _state(tmp_path)
    journal = state.journal
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 4, T0)
    groups = [fake_group(pg, response_len=300) for pg in lease.groups]
    for t in range(300):  # the last group's versions change every token: too many runs to pack
        groups[-1].samples[0].versions[t] = t
    state.submit(node, lease.lease_id, [encode_group(g) for g in groups], T0)
    state.get_batch(-1, None)
    state.report_consumed(0)
    journal.flush()

    kinds = [k for k, _ in read_records(memoryview(journal.path.read_bytes()))[0]]
    assert kinds.count(Kind.PACKED) == 3 and kinds.count(Kind.GROUP) == 1
    audit = audit_journal(tmp_path / "journal")
    assert (audit.taken, audit.accepted, audit.batched, audit.buffered, audit.consumed_through) == (
        4,
        4,
        2,
        2,
        0,
    )
    assert audit.problems == []
    assert audit.format == "5" and audit.file_id == journal.file_id
    assert audit.records["TAKE"] == 1 and audit.records["BATCH"] == 1 and audit.records["CONSUMED"] == 1
    assert audit.cursor == (0, 4) and audit.unconsumed_batches == 0
    assert audit.good_bytes <= audit.bytes and audit.tail_is_padding
    # uncompacted, the whole run's figures are the ones above
    assert audit.run == {
        "taken": 4,
        "accepted": 4,
        "dropped_stale": 0,
        "filtered": 0,
        "failed": 0,
        "batches": 1,
        "batched": 2,
    }


def _history(tmp_path, **journal_settings):
    """Four groups taken, accepted, two cut into batch 0 and consumed, two leased and left out."""
    state = _state(tmp_path, **journal_settings)
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 4, T0)
    state.submit(node, lease.lease_id, [encode_group(fake_group(pg)) for pg in lease.groups], T0)
    state.get_batch(-1, None)
    state.publish_version(1)
    state.report_consumed(0)
    return state, node, state.lease(node, 2, T0)


def test_tidal_journal_prints_the_account_and_what_a_restart_would_do(tmp_path, capsys):
    _history(tmp_path)[0].journal.flush()
    assert tidal(["journal", str(tmp_path / "journal")]) == 0
    out = capsys.readouterr().out
    assert "format 5" in out and "consumed through batch 0, policy version 1" in out
    assert "re-leases 2 groups" in out and "keeps 2 accepted groups" in out and "serves 0 cut batches" in out
    assert "ok: no group accepted twice" in out
    assert "prompt data: 6 rows shuffled with seed 0, digest" in out

    assert tidal(["journal", str(tmp_path / "journal" / "journal.log"), "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["taken"], d["accepted"], d["batched"], d["outstanding"], d["problems"]) == (6, 4, 2, 2, [])


def test_tidal_journal_reports_a_torn_tail_as_what_a_restart_cuts_off(tmp_path, capsys):
    _history(tmp_path)[0].journal.flush()
    log = tmp_path / "journal" / "journal.log"
    good = audit_journal(log).good_bytes  # the records, without O_DIRECT's zero padding after them
    log.write_bytes(log.read_bytes()[:good] + b"\x01\x40\x00\x00\x00torn")  # a header, its payload never came
    assert tidal(["journal", str(log)]) == 0
    out = capsys.readouterr().out
    assert "9 bytes after the last intact record" in out and "cuts them off" in out


def test_tidal_journal_after_a_compaction_checks_the_files_it_refers_to(tmp_path, capsys):
    state, node, lease = _history(tmp_path, compact_every_bytes=1, compact_dead_per_live=0)
    state.submit(node, lease.lease_id, [encode_group(fake_group(pg)) for pg in lease.groups], T0)
    assert state.maybe_compact()
    state.journal.flush()
    kept = list((tmp_path / "journal").glob("journal.*.log"))
    assert len(kept) == 1

    assert tidal(["journal", str(tmp_path / "journal"), "--format=json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["compacted"] and d["refs"] == 4 and d["buffered"] == 4 and d["problems"] == []
    # the whole run, from the snapshot's counters: 6 taken and accepted, batch 0 of 2 groups
    assert d["run"] == {
        "taken": 6,
        "accepted": 6,
        "dropped_stale": 0,
        "filtered": 0,
        "failed": 0,
        "batches": 1,
        "batched": 2,
    }
    assert tidal(["journal", str(tmp_path), "--format=json"]) == 0  # the run directory holding journal/
    assert json.loads(capsys.readouterr().out) == d

    # records after the compaction add to the snapshot's figures
    state.get_batch(0, None)
    state.journal.flush()
    assert tidal(["journal", str(tmp_path / "journal")]) == 0
    out = capsys.readouterr().out
    assert "the whole run (the compaction snapshot's counters and what follows): 6 taken, 6 accepted" in out
    assert "4 in 2 batches" in out

    kept[0].unlink()  # what a broker would refuse to start on
    assert tidal(["journal", str(tmp_path / "journal")]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM" in out and kept[0].name in out


def test_tidal_journal_finds_no_record_in_a_file_that_is_not_a_journal(tmp_path, capsys):
    (tmp_path / "journal.log").write_bytes(b"PAR1 not a journal at all")
    assert tidal(["journal", str(tmp_path)]) == 1
    assert "PROBLEM: no intact record at the start" in capsys.readouterr().out


def test_tidal_journal_names_a_path_without_a_journal(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert tidal(["journal", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "holds no journal.log" in err and "broker.journal.dir" in err
    assert tidal(["journal", str(tmp_path / "nowhere"), "--format", "yaml"]) == 2
    assert "--format='yaml'" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["a", "b"], ["--bogus", "1"]])
def test_tidal_journal_refuses_arguments_it_does_not_take(tmp_path, capsys, extra):
    assert tidal(["journal", *extra]) == 2
    assert "tidal journal" in capsys.readouterr().err

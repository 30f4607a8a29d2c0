"""The journal audit (``tidal run``'s account of every prompt group) over a real broker state's journal."""

from tidal.broker.codec import encode_group
from tidal.broker.config import BrokerConfig
from tidal.broker.journal import Journal
from tidal.broker.journal_records import Kind, read_records
from tidal.broker.source import PromptSource, load_rows
from tidal.broker.state import BrokerState
from tidal.broker.testing import fake_group, write_rows
from tidal.journal_audit import audit_journal

T0 = 1_000_000.0


def test_the_audit_follows_groups_journaled_packed_or_plain_through_batches(tmp_path):
    write_rows(tmp_path / "data.jsonl", 6)
    config = BrokerConfig.model_validate({"group_size": 2, "batch_groups": 2, "max_staleness": 3})
    source = PromptSource(load_rows(tmp_path / "data.jsonl"), seed=0, shuffle=True, epochs=1)
    journal = Journal(tmp_path / "journal", fsync="never")
    state = BrokerState(config, source, journal)
    state.replay(journal.open())
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

"""The broker's bookkeeping (no sockets): leases, submissions, staleness, batches, journal replay."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from tidal.broker.batch_refs import journal_refs
from tidal.broker.codec import encode_group
from tidal.broker.config import BrokerConfig
from tidal.broker.journal import Journal
from tidal.broker.journal_records import Kind, _crc32_combine, read_records, record_crc, record_parts
from tidal.broker.protocol import BAD_GROUP, BAD_REQUEST, LEASE_REJECTED, NOT_REGISTERED, ProtocolError
from tidal.broker.source import PromptSource, load_rows
from tidal.broker.state import BrokerState
from tidal.broker.testing import fake_group, write_rows

T0 = 1_000_000.0


def make_state(tmp_path, rows=20, epochs=1, with_journal=True, **cfg):
    settings_ = {"group_size": 2, "batch_groups": 2, "max_staleness": 1, "lease_timeout_s": 10.0} | cfg
    config = BrokerConfig.model_validate(settings_)
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_rows(data, rows)
    source = PromptSource(load_rows(data), seed=0, shuffle=True, epochs=epochs)
    j = Journal(tmp_path / "journal", fsync="never") if with_journal else None
    state = BrokerState(config, source, j)
    if j is not None:
        state.replay(j.open())
    return state


def frames(lease, version=0, rewards=None):
    return [encode_group(fake_group(pg, version=version, rewards=rewards)) for pg in lease.groups]


def test_unregistered_peer_is_told_to_register(tmp_path):
    state = make_state(tmp_path)
    with pytest.raises(ProtocolError) as exc:
        state.node_for(b"peer", T0)
    assert exc.value.code == NOT_REGISTERED and "register" in exc.value.message


def test_admission_follows_the_staleness_rule(tmp_path):
    state = make_state(tmp_path, max_staleness=1, batch_groups=2)
    node = state.register(b"a", "rollout", "a", {}, T0)
    first = state.lease(node, 3, T0)
    second = state.lease(node, 3, T0)
    assert len(first.groups) == 3 and len(second.groups) == 1  # (eta + 0 + 1) * 2 = 4
    assert state.lease(node, 1, T0) is None
    state.submit(node, first.lease_id, frames(first), T0)
    assert state.lease(node, 1, T0) is None  # accepted groups still count
    state.publish_version(1)
    assert len(state.lease(node, 5, T0).groups) == 2


def test_eta_zero_is_synchronous(tmp_path):
    state = make_state(tmp_path, max_staleness=0, batch_groups=2)
    node = state.register(b"a", "rollout", "a", {}, T0)
    for version in range(3):
        lease = state.lease(node, 10, T0)
        assert len(lease.groups) == 2 and state.lease(node, 1, T0) is None
        state.submit(node, lease.lease_id, frames(lease, version=version), T0)
        batch = state.get_batch(version - 1, None)
        assert batch.batch_id == version and batch.policy_version == version
        state.publish_version(version + 1)
    assert state.histogram == {0: 6}


def test_groups_may_come_back_in_several_submissions(tmp_path):
    state = make_state(tmp_path)
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 3, T0)
    fs = frames(lease)
    assert state.submit(node, lease.lease_id, fs[:1], T0)["accepted"] == [lease.groups[0].group_id]
    state.submit(node, lease.lease_id, fs[1:], T0)
    assert lease.lease_id not in state.leases and len(state.buffer) == 3
    with pytest.raises(ProtocolError) as exc:
        state.submit(node, lease.lease_id, fs[:1], T0)
    assert exc.value.code == LEASE_REJECTED


def test_whole_groups_only_and_only_groups_of_the_lease(tmp_path):
    state = make_state(tmp_path, group_size=3)
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 1, T0)
    pg = lease.groups[0]
    with pytest.raises(ProtocolError) as exc:
        state.submit(node, lease.lease_id, [encode_group(fake_group(replace(pg, n=2)))], T0)
    assert exc.value.code == BAD_GROUP and "n=3" in exc.value.message
    with pytest.raises(ProtocolError) as exc:
        state.submit(node, lease.lease_id, [encode_group(fake_group(replace(pg, group_id="9:9")))], T0)
    assert exc.value.code == LEASE_REJECTED and "not outstanding" in exc.value.message
    assert not state.buffer and state.leased == 1


def test_expired_lease_is_refused_and_its_prompts_are_re_leased(tmp_path):
    state = make_state(tmp_path, lease_timeout_s=5.0)
    a = state.register(b"a", "rollout", "a", {}, T0)
    b = state.register(b"b", "rollout", "b", {}, T0)
    lease = state.lease(a, 2, T0)
    state.heartbeat(a, T0 + 4)  # extends to T0 + 9
    state.expire(T0 + 8)
    assert lease.lease_id in state.leases
    state.expire(T0 + 9.5)
    assert state.counters.expired_leases == 1
    again = state.lease(b, 2, T0 + 10)
    assert [g.group_id for g in again.groups] == [g.group_id for g in lease.groups]
    with pytest.raises(ProtocolError) as exc:
        state.submit(a, lease.lease_id, frames(lease), T0 + 10)
    assert exc.value.code == LEASE_REJECTED and "lease again" in exc.value.message
    state.submit(b, again.lease_id, frames(again), T0 + 10)
    assert list(state.buffer) == [g.group_id for g in lease.groups]


def test_silent_node_loses_its_leases_release_and_leave_requeue(tmp_path):
    state = make_state(tmp_path, node_timeout_s=3.0)
    a = state.register(b"a", "rollout", "a", {}, T0)
    b = state.register(b"b", "rollout", "b", {}, T0)
    la = state.lease(a, 2, T0)
    lb = state.lease(b, 2, T0)
    state.node_for(b"b", T0 + 2.5)
    state.expire(T0 + 3.5)
    assert not state.nodes[a.node_id].alive and state.nodes[b.node_id].alive
    assert list(state.requeue) == [g.group_id for g in la.groups]
    assert state.release(b, lb.lease_id, [lb.groups[1].group_id]) == 1
    assert state.requeue[0] == lb.groups[1].group_id
    state.leave(b)
    assert state.requeue[0] == lb.groups[0].group_id and not state.leases and b.node_id not in state.nodes


def test_a_group_that_fails_max_group_failures_times_is_dropped_journaled_and_not_leased_again(tmp_path):
    state = make_state(tmp_path, rows=3, max_group_failures=2, max_staleness=4)
    a = state.register(b"a", "rollout", "a", {}, T0)
    b = state.register(b"b", "rollout", "b", {}, T0)
    first = state.lease(a, 3, T0)
    bad, good, other = (g.group_id for g in first.groups)
    # a give-back without an error (a node stopping, an engine gone) counts nothing
    assert state.release(a, first.lease_id, [good]) == 1
    assert state.release(a, first.lease_id, [bad], error="SampleFailed: prompt too long") == 1
    assert list(state.requeue) == [bad, good] and state.counters.failed_groups == 0
    again = state.lease(b, 1, T0)
    assert [g.group_id for g in again.groups] == [bad]
    assert state.release(b, again.lease_id, None, error="SampleFailed: prompt too long") == 0
    assert state.counters.failed_groups == 1 and bad not in state.outstanding
    assert again.lease_id not in state.leases and list(state.requeue) == [good]
    rest = state.lease(b, 2, T0)
    assert [g.group_id for g in rest.groups] == [good]
    state.submit(b, rest.lease_id, frames(rest), T0)
    state.submit(a, first.lease_id, [encode_group(fake_group(first.groups[2]))], T0)
    assert state.finished  # the failed group is resolved: the data is done without it

    replayed = make_state(tmp_path, rows=3, max_group_failures=2, max_staleness=4)
    assert replayed.counters.failed_groups == 1 and not replayed.outstanding and replayed.finished
    from tidal.journal_audit import audit_journal

    audit = audit_journal(tmp_path / "journal")
    assert audit.failed == 1 and audit.outstanding == 0 and not audit.problems


def _fail_once(state, name, want_group=None):
    node = state.register(name.encode(), "rollout", name, {}, T0)
    lease = state.lease(node, 1, T0)
    gid = lease.groups[0].group_id
    assert want_group in (None, gid)
    return gid, state.release(node, lease.lease_id, None, error="SampleFailed: prompt too long")


def test_failed_attempts_count_on_across_restarts_and_a_compaction(tmp_path):
    from tidal.journal_audit import audit_journal
    from tidal.journal_command import audit_lines

    settings = {
        "rows": 2,
        "max_group_failures": 3,
        "max_staleness": 4,
        "journal": {"compact_dead_per_live": 0},
    }
    state = make_state(tmp_path, **settings)
    bad, left = _fail_once(state, "a")
    assert left == 1 and state.failures == {bad: 1}
    # no close(): the process dies here; the count is in the file
    state = make_state(tmp_path, **settings)
    assert state.failures == {bad: 1} and list(state.requeue) == [bad]
    assert _fail_once(state, "b", bad) == (bad, 1)
    audit = audit_journal(tmp_path / "journal")
    assert audit.failing == 1 and audit.records["ATTEMPTS"] == 2 and not audit.problems
    assert "re-leases 1 groups that were out on leases (1 with failed sampling attempts" in "".join(
        audit_lines(audit)
    )
    state.cfg.journal.compact_every_bytes = 1
    assert state.maybe_compact()  # the snapshot carries the counts; the ATTEMPTS records are gone
    assert "ATTEMPTS" not in audit_journal(tmp_path / "journal").records
    assert audit_journal(tmp_path / "journal").failing == 1
    state = make_state(tmp_path, **settings)
    assert state.failures == {bad: 2}
    assert _fail_once(state, "c", bad) == (bad, 0)  # the third attempt, across two restarts: dropped
    assert state.counters.failed_groups == 1 and bad not in state.outstanding and not state.failures
    again = make_state(tmp_path, **settings)
    assert again.counters.failed_groups == 1 and not again.failures and bad not in again.requeue


def test_an_older_format_journal_takes_no_attempts_record_and_a_restart_counts_afresh(tmp_path):
    (tmp_path / "journal").mkdir()
    head = record_parts(Kind.FORMAT, b"4 0123456789abcdef")
    (tmp_path / "journal" / "journal.log").write_bytes(b"".join(bytes(p) for p in head))
    state = make_state(tmp_path, rows=2, max_group_failures=3)
    bad, left = _fail_once(state, "a")
    assert left == 1 and state.failures == {bad: 1}
    kinds = [k for k, _ in read_records(memoryview(state.journal.path.read_bytes()))[0]]
    assert Kind.TAKE in kinds and Kind.ATTEMPTS not in kinds
    assert make_state(tmp_path, rows=2, max_group_failures=3).failures == {}


def test_dynamic_sampling_filters_groups_with_equal_rewards(tmp_path):
    state = make_state(tmp_path, dynamic_sampling=True)
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 2, T0)
    fs = [
        encode_group(fake_group(lease.groups[0], rewards=[1.0, 1.0])),
        encode_group(fake_group(lease.groups[1], rewards=[1.0, 0.0])),
    ]
    out = state.submit(node, lease.lease_id, fs, T0)
    assert out == {"accepted": [lease.groups[1].group_id], "filtered": [lease.groups[0].group_id]}
    assert state.counters.filtered_groups == 1 and state.accepted_live == 1 and not state.outstanding


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_stale_groups_are_dropped_or_kept_and_counted(tmp_path, policy):
    state = make_state(tmp_path, max_staleness=1, batch_groups=2, staleness_policy=policy)
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 4, T0)
    state.publish_version(3)  # e.g. a trainer that restarted from a later checkpoint
    fs = frames(lease, version=0)
    fs[3] = encode_group(fake_group(lease.groups[3], version=2))
    fs[2] = encode_group(fake_group(lease.groups[2], version=3))
    state.submit(node, lease.lease_id, fs, T0)
    batch = state.get_batch(-1, 2)
    if policy == "drop":
        assert batch.group_ids == [lease.groups[2].group_id, lease.groups[3].group_id]
        assert state.counters.dropped_stale_groups == 2 and state.accepted_live == 2
        assert state.histogram == {0: 1, 1: 1}
    else:
        assert batch.group_ids == [lease.groups[0].group_id, lease.groups[1].group_id]
        assert state.counters.dropped_stale_groups == 0 and state.histogram == {3: 2}


def test_batches_are_cut_in_order_and_given_again_until_consumed(tmp_path):
    state = make_state(tmp_path, max_staleness=4)
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 5, T0)
    state.submit(node, lease.lease_id, frames(lease), T0)
    with pytest.raises(ProtocolError) as exc:
        state.get_batch(1, None)
    assert exc.value.code == BAD_REQUEST and "pass after=-1" in exc.value.message
    b0 = state.get_batch(-1, None)
    b1 = state.get_batch(0, None)
    assert state.get_batch(-1, None) is b0 and b0.group_ids != b1.group_ids
    assert state.get_batch(1, None) is None  # one group left, batches need two
    state.report_consumed(0)
    with pytest.raises(ProtocolError, match="was reported consumed"):
        state.get_batch(-1, None)
    with pytest.raises(ProtocolError, match="never cut"):
        state.report_consumed(5)


def test_last_partial_batch_when_the_data_is_exhausted(tmp_path):
    state = make_state(tmp_path, rows=3, max_staleness=4)
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 10, T0)
    assert len(lease.groups) == 3 and state.lease(node, 1, T0) is None
    state.submit(node, lease.lease_id, frames(lease), T0)
    assert len(state.get_batch(-1, None).group_ids) == 2
    assert len(state.get_batch(0, None).group_ids) == 1 and state.finished


def _summary(state):
    return {
        "buffer": list(state.buffer),
        "batches": {b: (c.group_ids, c.policy_version) for b, c in state.batches.items()},
        "requeue": sorted(state.requeue),
        "version": state.version,
        "consumed": state.consumed,
        "next": state.next_batch_id,
        "cursor": (state.source.epoch, state.source.pos),
        "accepted_live": state.accepted_live,
        "filtered": state.counters.filtered_groups,
        "dropped": state.counters.dropped_stale_groups,
    }


def _busy_history(state):
    a = state.register(b"a", "rollout", "a", {}, T0)
    leases = [state.lease(a, 3, T0) for _ in range(3)]
    state.submit(a, leases[0].lease_id, frames(leases[0]), T0)
    state.submit(a, leases[1].lease_id, frames(leases[1])[:2], T0)
    state.get_batch(-1, None)
    state.publish_version(1)
    state.get_batch(0, None)
    state.report_consumed(0)
    filtered = frames(leases[2], rewards=[0.0, 0.0])[:1]
    state.cfg.dynamic_sampling = True
    state.submit(a, leases[2].lease_id, filtered, T0)
    return leases


def test_replay_after_a_crash_restores_everything_and_requeues_leased_prompts(tmp_path):
    state = make_state(tmp_path, max_staleness=3)
    leases = _busy_history(state)
    # no close(): the process dies here; what was written is in the file
    again = make_state(tmp_path, max_staleness=3, dynamic_sampling=True)
    want = _summary(state)
    in_flight = sorted(g for lease in state.leases.values() for g in lease.pending)
    assert in_flight == sorted([leases[1].groups[2].group_id, *[g.group_id for g in leases[2].groups[1:]]])
    want["requeue"] = in_flight
    assert _summary(again) == want


def test_compaction_keeps_the_live_state_and_shrinks_the_log(tmp_path):
    state = make_state(
        tmp_path, max_staleness=3, journal={"compact_every_bytes": 1, "compact_dead_per_live": 0}
    )
    _busy_history(state)
    before = state.journal.bytes_written
    assert state.maybe_compact() and state.journal.bytes_written < before
    state.publish_version(2)
    again = make_state(tmp_path, max_staleness=3, dynamic_sampling=True)
    assert _summary(again) | {"requeue": None} == _summary(state) | {"requeue": None}
    assert sorted(again.requeue) == sorted(g for lease in state.leases.values() for g in lease.pending)


def test_compaction_waits_until_the_dead_bytes_outweigh_the_live_ones_by_the_ratio(tmp_path):
    state = make_state(tmp_path, max_staleness=3, journal={"compact_every_bytes": 1})
    _busy_history(state)
    live = state.live_bytes()
    dead = state.journal.bytes_written - live
    assert live > 0 and dead > 0
    state.cfg.journal.compact_dead_per_live = dead / live * 1.01
    before = state.journal.bytes_written
    assert not state.maybe_compact() and state.journal.bytes_written == before
    state.cfg.journal.compact_dead_per_live = dead / live * 0.99
    assert state.maybe_compact() and state.journal.bytes_written < before


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=hs.data(),
    eta=hs.integers(0, 3),
    batch_groups=hs.integers(1, 4),
    policy=hs.sampled_from(["drop", "keep"]),
)
def test_staleness_bound_holds_for_any_interleaving(tmp_path_factory, data, eta, batch_groups, policy):
    """Random nodes lease, lag, submit late or never, expire; the trainer steps whenever it can."""
    state = make_state(
        tmp_path_factory.mktemp("s"),
        rows=12,
        epochs=2,
        with_journal=False,
        max_staleness=eta,
        batch_groups=batch_groups,
        staleness_policy=policy,
        lease_timeout_s=5.0,
        node_timeout_s=1e9,
    )
    nodes = [state.register(bytes([i]), "rollout", str(i), {}, T0) for i in range(3)]
    held = []  # (node, lease, version the node saw when it leased)
    trained: list[str] = []
    now = T0
    for _ in range(data.draw(hs.integers(20, 120))):
        op = data.draw(hs.sampled_from(["lease", "submit", "submit", "tick", "train"]))
        if op == "lease":
            node = data.draw(hs.sampled_from(nodes))
            lease = state.lease(node, data.draw(hs.integers(1, 5)), now)
            if lease:
                held.append((node, lease, state.version))
        elif op == "submit" and held:
            node, lease, seen = held.pop(data.draw(hs.integers(0, len(held) - 1)))
            try:
                state.submit(node, lease.lease_id, frames(lease, version=seen), now)
            except ProtocolError as exc:
                assert exc.code == LEASE_REJECTED
        elif op == "tick":
            now += data.draw(hs.sampled_from([0.5, 2.0, 6.0]))
            state.expire(now)
        elif op == "train":
            batch = state.get_batch(state.next_batch_id - 1, None)
            if batch:
                trained += batch.group_ids
                state.publish_version(batch.batch_id + 1)
                state.report_consumed(batch.batch_id)
        limit = (eta + state.version + 1) * batch_groups
        assert state.leased + state.accepted_live <= limit
    assert len(trained) == len(set(trained))
    if policy == "drop":
        assert all(s <= eta for s in state.histogram)
    if eta == 0 and policy == "drop":
        assert state.counters.dropped_stale_groups == 0


def test_accepted_groups_are_journaled_packed_and_replay_as_the_frames_that_came(tmp_path):
    from tidal.broker.journal_records import read_records  # noqa: PLC0415

    state = make_state(tmp_path, max_staleness=3)
    a = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(a, 2, T0)
    sent = [encode_group(fake_group(pg, version=0, response_len=400)) for pg in lease.groups]
    state.submit(a, lease.lease_id, sent, T0)
    state.journal.flush()
    groups = [
        (k, p)
        for k, p in read_records(memoryview(state.journal.path.read_bytes()))[0]
        if k in (Kind.GROUP, Kind.PACKED)
    ]
    assert [k for k, _ in groups] == [Kind.PACKED, Kind.PACKED]
    assert all(len(p) < len(f) - 2 * 400 * 4 + 64 for (_, p), f in zip(groups, sent, strict=True))
    journal_stats = state.stats(T0)["journal"]
    assert journal_stats["packed_groups"] == 2
    assert journal_stats["packed_bytes_saved"] == sum(len(f) for f in sent) - sum(len(p) for _, p in groups)
    batch = state.get_batch(-1, None)
    file_id, refs = journal_refs(state, batch)
    assert [n for _, n in refs] == [len(p) for _, p in groups]  # a local reader reads the packed records
    again = make_state(tmp_path, max_staleness=3)
    assert [bytes(again.batch_store[g].frame) for g in batch.group_ids] == [f.tobytes() for f in sent]


@pytest.mark.skipif(
    _crc32_combine() is None, reason="the native codec (which combines CRCs) cannot be built here"
)
def test_a_packed_group_carries_its_frames_crc_from_the_one_pass_that_sums_its_record(tmp_path):
    state = make_state(tmp_path)
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 2, T0)
    sent = frames(lease, version=0)
    state.submit(node, lease.lease_id, sent, T0)
    state.journal.commit()
    stored = [state.buffer[pg.group_id] for pg in lease.groups]
    assert state.packed_groups == 2
    for s, frame in zip(stored, sent, strict=True):
        assert s.crc == record_crc(Kind.GROUP, frame)  # what a local memory reader checks
    # and the records written carry their own CRC, which replaying them checks
    state.journal.close()
    again = make_state(tmp_path)
    assert list(again.buffer) == [pg.group_id for pg in lease.groups]
    assert [bytes(again.buffer[pg.group_id].frame) for pg in lease.groups] == [f.tobytes() for f in sent]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hs.data())
def test_the_count_of_leased_groups_follows_every_way_a_group_leaves_a_lease(tmp_path_factory, data):
    """Admission reads the leased groups as a running count, and lease pushes each node's: they must equal
    the groups still pending on the leases after leases, whole and partial submits, releases (failed or
    not), expiries and leaves."""
    state = make_state(
        tmp_path_factory.mktemp("s"),
        rows=16,
        epochs=3,
        with_journal=False,
        max_staleness=50,
        lease_timeout_s=5.0,
        node_timeout_s=8.0,
        max_group_failures=2,
    )
    for i in range(3):
        state.register(bytes([i]), "rollout", str(i), {}, T0)
    now = T0
    for _ in range(data.draw(hs.integers(10, 80))):
        op = data.draw(hs.sampled_from(["lease", "submit", "release", "fail", "tick", "leave"]))
        live = [lease for lease in state.leases.values() if lease.node_id in state.nodes]
        if op == "lease":
            node = data.draw(hs.sampled_from(list(state.nodes.values()))) if state.nodes else None
            if node is not None:
                state.lease(node, data.draw(hs.integers(1, 4)), now)
        elif op in ("submit", "release", "fail") and live:
            lease = data.draw(hs.sampled_from(live))
            node = state.nodes[lease.node_id]
            ids = list(lease.pending)
            some = ids[: data.draw(hs.integers(1, len(ids)))]
            if op == "submit":
                pgs = [lease.pending[g] for g in some]
                state.submit(node, lease.lease_id, [encode_group(fake_group(pg)) for pg in pgs], now)
            else:
                state.release(node, lease.lease_id, some, "engine error" if op == "fail" else None)
        elif op == "tick":
            now += data.draw(hs.sampled_from([1.0, 6.0]))
            for node in state.nodes.values():
                if data.draw(hs.booleans()):
                    state.heartbeat(state.node_for(node.peer, now), now)
            state.expire(now)
        elif op == "leave" and len(state.nodes) > 1:
            state.leave(data.draw(hs.sampled_from(list(state.nodes.values()))))
        assert state.leased == sum(len(lease.pending) for lease in state.leases.values())
        for node in state.nodes.values():
            assert node.in_flight == sum(len(state.leases[x].pending) for x in node.leases)

"""The journal: records survive reopening; a torn or corrupt tail is cut off; compaction is atomic."""

import os
import threading
import time
from collections import deque

import pytest

from tidal.broker.journal import Journal
from tidal.broker.journal_records import (
    FORMAT_RECORD_BYTES,
    JournalFormatError,
    Kind,
    read_records,
    record_parts,
)

FORMAT_BYTES = FORMAT_RECORD_BYTES  # the FORMAT record every journal starts with


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("fsync", ["always", "interval", "never"])
def test_records_survive_reopen_in_order(tmp_path, fsync, direct_io):
    j = Journal(tmp_path, fsync=fsync, fsync_interval_s=0.01, direct_io=direct_io)
    assert j.open() == []
    payloads = [os.urandom(n) for n in (0, 1, 100, 70_000)]
    for i, p in enumerate(payloads):
        j.append(Kind.GROUP if i % 2 else Kind.TAKE, p)
    j.close()
    records = Journal(tmp_path).open()
    assert [(k, bytes(p)) for k, p in records] == [
        (Kind.GROUP if i % 2 else Kind.TAKE, p) for i, p in enumerate(payloads)
    ]


def test_direct_io_records_are_readable_without_close_as_after_a_kill(tmp_path):
    """With O_DIRECT the file ends in zero padding until close; a reader after a crash sees every record."""
    j = Journal(tmp_path, fsync="never", direct_io=True)
    j.open()
    payloads = [os.urandom(n) for n in (10, 5000, 4096 - 9, 1 << 20, 3)]
    for p in payloads:
        j.append(Kind.GROUP, p)
        records, _ = read_records(memoryview(j.path.read_bytes()))  # what a restart would read now
        assert [bytes(r) for _, r in records][-1] == p
    assert j.path.stat().st_size % 4096 == 0
    os.close(j._writer.fd)  # the process dies: no close(), no truncation of the padding
    reopened = Journal(tmp_path, direct_io=True)
    assert [bytes(p) for _, p in reopened.open()] == payloads
    assert reopened.truncated_bytes == 0
    reopened.append(Kind.VERSION, b"more")
    reopened.close()
    assert [bytes(p) for _, p in Journal(tmp_path).open()] == [*payloads, b"more"]
    assert j.bytes_written == FORMAT_BYTES + sum(9 + len(p) for p in payloads)


def test_torn_tail_is_truncated_and_appending_continues(tmp_path):
    j = Journal(tmp_path, fsync="never")
    j.open()
    j.append(Kind.VERSION, b"one")
    j.append(Kind.VERSION, b"two")
    j.close()
    size = j.path.stat().st_size
    with open(j.path, "r+b") as f:
        f.truncate(size - 2)  # a crash in the middle of the last write
    j2 = Journal(tmp_path, fsync="never")
    assert [bytes(p) for _, p in j2.open()] == [b"one"]
    assert j2.truncated_bytes == size - 2 - FORMAT_BYTES - (len(b"one") + 9)
    j2.append(Kind.VERSION, b"three")
    j2.close()
    assert [bytes(p) for _, p in Journal(tmp_path).open()] == [b"one", b"three"]


def test_corrupt_record_stops_replay_there(tmp_path):
    j = Journal(tmp_path, fsync="never")
    j.open()
    for p in (b"aaaa", b"bbbb", b"cccc"):
        j.append(Kind.BATCH, p)
    j.close()
    data = bytearray(j.path.read_bytes())
    data[FORMAT_BYTES + 9 + 4 + 9 + 1] ^= 0xFF  # flip a payload byte of the second record
    j.path.write_bytes(bytes(data))
    assert [bytes(p) for _, p in Journal(tmp_path).open()] == [b"aaaa"]


def test_rewrite_replaces_the_log_and_appends_go_to_the_new_file(tmp_path):
    j = Journal(tmp_path, fsync="interval", fsync_interval_s=0.01)
    j.open()
    for _ in range(50):
        j.append(Kind.GROUP, b"x" * 1000)
    j.rewrite([(Kind.SNAPSHOT, b"snap"), (Kind.RESTORE, b"g1")])
    j.append(Kind.CONSUMED, b"after")
    j.close()
    assert not j.path.with_suffix(".log.tmp").exists()
    records = Journal(tmp_path).open()
    assert [(k, bytes(p)) for k, p in records] == [
        (Kind.SNAPSHOT, b"snap"),
        (Kind.RESTORE, b"g1"),
        (Kind.CONSUMED, b"after"),
    ]
    assert j.path.stat().st_size == FORMAT_BYTES + sum(9 + n for n in (4, 2, 5))


def _old_log(records: list[tuple[Kind, bytes]]) -> bytes:
    """A log as an earlier format wrote it: records with plain (unmasked) checksums."""
    return b"".join(bytes(part) for kind, payload in records for part in record_parts(kind, payload))


def test_a_journal_of_another_format_is_refused_saying_what_to_do(tmp_path):
    (tmp_path / "journal.log").write_bytes(_old_log([(Kind.VERSION, b"v")]))  # format 1: no FORMAT record
    with pytest.raises(
        JournalFormatError, match="format 1, this broker reads formats 2, 3.*move the journal"
    ):
        Journal(tmp_path).open()


@pytest.mark.parametrize("fsync", ["always", "interval"])
def test_background_mode_commits_groups_of_records_and_reports_durability(tmp_path, fsync):
    j = Journal(tmp_path, fsync=fsync, fsync_interval_s=0.01, background=True)
    j.open()
    reported: list[int] = []
    j.on_durable = reported.append
    seqs = [j.append(Kind.GROUP, os.urandom(n)) for n in (5, 70_000, 9000, 1)]
    assert seqs == [1, 2, 3, 4]
    j.flush()
    assert j.durable_seq == 4 and reported and reported[-1] == 4 and reported == sorted(reported)
    j.close()
    assert len(Journal(tmp_path).open()) == 4


def test_background_compaction_takes_its_place_among_the_appends(tmp_path):
    j = Journal(tmp_path, fsync="interval", fsync_interval_s=0.01, background=True)
    j.open()
    j.append(Kind.GROUP, b"before" * 1000)
    j.compact([(Kind.SNAPSHOT, b"snap"), (Kind.RESTORE, b"kept")])
    assert j.compacting
    j.append(Kind.CONSUMED, b"after")
    j.flush()
    assert not j.compacting and j.durable_seq == 2
    j.close()
    assert [(k, bytes(p)) for k, p in Journal(tmp_path).open()] == [
        (Kind.SNAPSHOT, b"snap"),
        (Kind.RESTORE, b"kept"),
        (Kind.CONSUMED, b"after"),
    ]


@pytest.mark.parametrize("background", [False, True])
def test_append_and_compact_say_where_each_payload_lies_and_in_which_file(tmp_path, background):
    from tidal.broker.journal_records import FORMAT_VERSION, parse_format

    j = Journal(tmp_path, fsync="never", background=background)
    j.open()
    placed = []
    for n in (5, 70_000, 4096, 1):
        payload = os.urandom(n)
        j.append(Kind.GROUP, payload)
        placed.append((j.file_id, j.last_offset, payload))
    first_id = j.file_id
    j.flush()
    before = j.path.read_bytes()
    for file_id, offset, payload in placed:
        assert file_id == first_id and before[offset : offset + len(payload)] == payload
    kept = os.urandom(3000)
    offsets = j.compact([(Kind.SNAPSHOT, b"snap"), (Kind.RESTORE, kept)])
    assert j.file_id != first_id
    compacted = [(j.file_id, offsets[1], kept)]
    j.append(Kind.GROUP, b"later")
    compacted.append((j.file_id, j.last_offset, b"later"))
    j.flush()
    data = j.path.read_bytes()
    records, _ = read_records(memoryview(data))
    assert parse_format(records[0][1]) == (str(FORMAT_VERSION), j.file_id)
    for file_id, offset, payload in compacted:
        assert file_id == j.file_id and data[offset : offset + len(payload)] == payload
    j.close()
    # Reopened, the journal keeps its file id.
    again = Journal(tmp_path)
    again.open()
    assert again.file_id == compacted[0][0]
    again.close()


def test_background_mode_writes_small_commits_inline_and_large_ones_on_its_thread(tmp_path):
    j = Journal(tmp_path, fsync="never", background=True, inline_bytes=100_000)
    j.open()
    reported: list[int] = []
    j.on_durable = reported.append
    j.append(Kind.GROUP, b"small" * 100)
    j.append(Kind.VERSION, b"v")
    assert j.durable_seq == 0  # appended, not yet committed
    j.commit()
    assert j.durable_seq == 2 and reported == []  # written by the committing thread: nothing to report
    j.append(Kind.GROUP, os.urandom(200_000))  # over inline_bytes: the writer thread's
    j.commit()
    j.flush()
    assert j.durable_seq == 3 and reported == [3]
    j.close()
    assert [k for k, _ in Journal(tmp_path).open()] == [Kind.GROUP, Kind.VERSION, Kind.GROUP]


def test_commits_the_loop_writes_itself_do_not_wake_the_writer_thread(tmp_path):
    # each inline pass reports its durability to flush()'s waiters, not to the sleeping writer thread:
    # a wake-up (and a GIL hand-off) per commit cost the broker ~2 CPU-us a 1K-token sample
    j = Journal(tmp_path, fsync="never", background=True, inline_bytes=100_000)
    j.open()
    time.sleep(0.05)  # the writer thread is asleep in its wait
    for i in range(50):
        j.append(Kind.GROUP, b"g%d" % i * 100)
        j.commit()
        assert j.durable_seq == i + 1
    assert j.writer_wakeups == 0
    j.append(Kind.GROUP, os.urandom(200_000))  # over inline_bytes: this one wakes it
    j.commit()
    j.flush()
    assert j.writer_wakeups >= 1 and j.durable_seq == 51
    j.close()
    assert len(Journal(tmp_path).open()) == 51


class _TakenWhileSized(bytes):
    """A payload whose size, asked for, lets the writer thread take the queued records first: the
    interleaving of a commit summing the queue while the thread empties it."""

    journal: Journal | None = None

    def __len__(self) -> int:
        j, type(self).journal = type(self).journal, None
        if j is not None:
            with j._pass:  # what the writer thread does when it wakes
                j._write_pass()
        return super().__len__()


def test_a_commit_sizing_the_queue_while_the_writer_thread_takes_it_goes_on(tmp_path):
    j = Journal(tmp_path, fsync="never", background=True, inline_bytes=100_000)
    j.open()
    j.append(Kind.GROUP, b"first")
    j.append(Kind.GROUP, _TakenWhileSized(b"second"))
    j.append(Kind.VERSION, b"v")
    _TakenWhileSized.journal = j
    j.commit()  # raised "deque mutated during iteration" when it summed the live queue
    assert _TakenWhileSized.journal is None  # the interleaving happened
    j.close()
    assert [k for k, _ in Journal(tmp_path).open()] == [Kind.GROUP, Kind.GROUP, Kind.VERSION]


class _EmptiedAfterTheWakeUp:
    """A queue the writer thread finds holding records when it wakes and empty when it then looks again:
    an inline commit on the event loop wrote them in between."""

    def __init__(self) -> None:
        self.looks = iter([True, False])

    def __bool__(self) -> bool:
        return next(self.looks, False)


def test_the_writer_thread_keeps_waiting_when_an_inline_commit_took_what_woke_it(tmp_path):
    j = Journal(tmp_path, fsync="never")  # no thread of its own: this test runs the writer's loop
    j.open()
    j._queue = _EmptiedAfterTheWakeUp()
    writer = threading.Thread(target=j._write_loop, daemon=True)
    writer.start()
    writer.join(0.3)
    assert writer.is_alive()  # it returned here, and later commits waited for a writer that was gone
    j._stop.set()
    with j._lock:
        j._lock.notify_all()
    writer.join(5)
    assert not writer.is_alive()  # it still stops when told to
    j._queue = deque()
    j.close()


@pytest.mark.parametrize("background", [False, True])
def test_compaction_refers_to_live_groups_where_they_lie_and_keeps_only_the_files_it_refers_to(
    tmp_path, background
):
    from tidal.broker.journal_records import JournalCorrupt, ref_payload, segment_path

    j = Journal(tmp_path, fsync="interval", fsync_interval_s=0.01, background=background)
    j.open()
    a, dead = os.urandom(5000), os.urandom(70_000)
    j.append(Kind.GROUP, a)
    where_a = (j.file_id, j.last_offset, len(a))
    j.append(Kind.GROUP, dead)
    first = j.file_id
    j.compact([(Kind.SNAPSHOT, b"snap1"), (Kind.REF, ref_payload(*where_a))])
    c = os.urandom(3000)
    j.append(Kind.GROUP, c)
    where_c = (j.file_id, j.last_offset, len(c))
    j.flush()
    second = j.file_id
    assert segment_path(tmp_path, first).exists()  # it holds a live group: kept, not copied
    assert j.path.stat().st_size < len(a) + len(dead)
    j.close()

    again = Journal(tmp_path)
    records = again.open()
    assert [(k, bytes(p)) for k, p in records] == [
        (Kind.SNAPSHOT, b"snap1"),
        (Kind.RESTORE, a),
        (Kind.GROUP, c),
    ]
    assert again.replayed_locs == [None, where_a, where_c]
    # a is consumed: the next compaction refers to c alone, and the first file goes
    again.compact([(Kind.SNAPSHOT, b"snap2"), (Kind.REF, ref_payload(*where_c))])
    again.close()
    assert not segment_path(tmp_path, first).exists() and segment_path(tmp_path, second).exists()
    assert sorted(p.name for p in tmp_path.glob("journal.*")) == sorted(
        ["journal.log", f"journal.{second}.log"]
    )

    segment_path(tmp_path, second).unlink()  # lost by hand: the log names what it misses
    with pytest.raises(JournalCorrupt, match=f"journal.{second}.log"):
        Journal(tmp_path).open()


def test_a_format_2_journal_still_opens_and_takes_appends(tmp_path):
    (tmp_path / "journal.log").write_bytes(
        _old_log([(Kind.FORMAT, b"2 0123456789abcdef"), (Kind.VERSION, b"v")])
    )
    j = Journal(tmp_path)
    assert [(k, bytes(p)) for k, p in j.open()] == [(Kind.VERSION, b"v")]
    j.append(Kind.VERSION, b"w")  # in the file's own format
    j.close()
    assert [(k, bytes(p)) for k, p in Journal(tmp_path).open()] == [
        (Kind.VERSION, b"v"),
        (Kind.VERSION, b"w"),
    ]


@pytest.mark.parametrize("background", [False, True])
def test_records_larger_than_the_staging_buffers_are_written_whole_and_in_order(tmp_path, background):
    from tidal.broker.journal_writers import DirectWriter

    j = Journal(tmp_path, fsync="interval", fsync_interval_s=0.01, background=background)
    j.open()
    assert j.direct, "this file system refuses O_DIRECT: the staging buffers are not used"
    staging = DirectWriter.STAGING
    # across both buffers several times, ending mid-buffer and mid-block, then small records after
    payloads = [os.urandom(n) for n in (staging - 100, 2 * staging + 12345, 7, staging // 3, 4096, 1)]
    for p in payloads:
        j.append(Kind.GROUP, p)
        j.commit()
    j.flush()
    j.close()
    assert [bytes(p) for _, p in Journal(tmp_path).open()] == payloads


def test_records_copied_in_one_call_or_piece_by_piece_make_the_same_file(tmp_path, monkeypatch):
    from tidal.broker import journal_writers

    if journal_writers._gather() is None:
        pytest.skip("the native codec cannot be built here: only the piecewise copy runs")
    payloads = [os.urandom(n) for n in (1, 4095, 4096, 4097, 70_000, 3)]

    def write(folder, gather):
        monkeypatch.setattr(journal_writers, "_gather", lambda: gather)
        w = journal_writers.DirectWriter(folder / "log", 0)
        for p in payloads:  # one record a call, then all of them in one call
            w.write(record_parts(Kind.GROUP, p))
        w.write([part for p in payloads for part in record_parts(Kind.GROUP, p)])
        w.close()
        return (folder / "log").read_bytes()

    (tmp_path / "native").mkdir()
    (tmp_path / "pieces").mkdir()
    native = write(tmp_path / "native", journal_writers._gather())
    assert native == write(tmp_path / "pieces", None)
    records, good = read_records(memoryview(native))
    assert [bytes(p) for _, p in records] == payloads * 2 and good == len(native)


def test_a_reused_file_never_yields_what_it_held_before(tmp_path):
    from tidal.broker.journal_records import RECORD_HEADER

    # A file's earlier life: records that each start on a 4 KiB boundary, every one intact.
    earlier = Journal(tmp_path / "earlier", fsync="never")
    earlier.open()
    earlier.append(Kind.VERSION, b"f" * (4096 - FORMAT_BYTES - RECORD_HEADER.size))
    for i in range(8):
        earlier.append(Kind.CONSUMED, bytes([i]) * (4096 - RECORD_HEADER.size))
    earlier.close()
    (tmp_path / "journal").mkdir()
    (tmp_path / "earlier" / "journal.log").rename(tmp_path / "journal" / "spare.old")

    j = Journal(tmp_path / "journal", fsync="never", spare_files=1)
    j.open()
    # Written over the spare, the new file ends exactly where one of the earlier records begins.
    snapshot = b"s" * (4096 - FORMAT_BYTES - RECORD_HEADER.size)
    j.compact([(Kind.SNAPSHOT, snapshot)])
    assert j.spares_used == 1 and j.path.stat().st_size > 4096  # written over, not truncated
    assert [(k, bytes(p)) for k, p in Journal(tmp_path / "journal").open()] == [(Kind.SNAPSHOT, snapshot)]


def test_files_nothing_refers_to_are_kept_as_spares_up_to_the_limit_and_written_over(tmp_path):
    j = Journal(tmp_path, fsync="never", spare_files=2)
    j.open()
    for i in range(6):
        j.append(Kind.GROUP, os.urandom(50_000))
        j.compact([(Kind.SNAPSHOT, b"snap%d" % i)])
    # each compaction from the second on writes over the file the one before let go of
    assert len(list(tmp_path.glob("spare.*"))) == 1 and not list(tmp_path.glob("journal.*.log"))
    assert j.spares_used == 5
    j.append(Kind.VERSION, b"after")
    j.close()
    assert [(k, bytes(p)) for k, p in Journal(tmp_path).open()] == [
        (Kind.SNAPSHOT, b"snap5"),
        (Kind.VERSION, b"after"),
    ]
    none = Journal(tmp_path / "none", fsync="never", spare_files=0)
    none.open()
    none.append(Kind.GROUP, b"g" * 5000)
    none.compact([(Kind.SNAPSHOT, b"snap")])
    none.close()
    assert not list((tmp_path / "none").glob("spare.*")) and not list(
        (tmp_path / "none").glob("journal.*.log")
    )

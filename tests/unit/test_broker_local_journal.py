"""Reading group frames straight from a journal file, as a client on the broker's host does."""

import os
from pathlib import Path

import pytest

from tidal.broker.journal import Journal
from tidal.broker.journal_records import Kind
from tidal.broker.local_journal import JournalReader, JournalUnavailable, host_id


def _journal(tmp_path, **kw) -> Journal:
    j = Journal(tmp_path, fsync="never", **kw)
    j.open()
    return j


@pytest.mark.parametrize("direct_io", [True, False])
def test_reads_what_the_journal_says_lies_where_in_any_order(tmp_path, direct_io):
    j = _journal(tmp_path, direct_io=direct_io)
    payloads, refs = [], []
    for n in (100, 70_000, 4096, 3, 600_000, 9000):
        payloads.append(os.urandom(n))
        j.append(Kind.GROUP, payloads[-1])
        refs.append([j.last_offset, n])
        j.append(Kind.VERSION, b"between")  # records in between are skipped or read over
    reader = JournalReader()
    order = [4, 0, 5, 2, 1, 3]
    # a journal written through the page cache is read through it (the broker says so: "direct")
    got = reader.read(str(j.path), j.file_id, [refs[i] for i in order], direct=direct_io)
    assert [bytes(g) for g in got] == [payloads[i] for i in order]
    assert all(g.readonly for g in got)
    reader.close()
    j.close()


def test_a_replaced_file_or_a_wrong_record_is_refused(tmp_path):
    j = _journal(tmp_path, direct_io=False)
    j.append(Kind.GROUP, b"group-frame")
    old_id, ref = j.file_id, [j.last_offset, len(b"group-frame")]
    reader = JournalReader()
    assert bytes(reader.read(str(j.path), old_id, [ref])[0]) == b"group-frame"
    with pytest.raises(JournalUnavailable, match="no group record"):
        reader.read(str(j.path), old_id, [[ref[0], ref[1] - 1]])
    j.append(Kind.VERSION, b"v")
    with pytest.raises(JournalUnavailable, match="no group record"):
        reader.read(str(j.path), old_id, [[j.last_offset, 1]])  # not a group record
    j.compact([(Kind.SNAPSHOT, b"snap")])  # a new file under the same path
    with pytest.raises(JournalUnavailable, match=f"not {old_id}"):
        JournalReader().read(str(j.path), old_id, [ref])
    with pytest.raises(JournalUnavailable, match="reading the journal"):
        JournalReader().read(str(tmp_path / "missing.log"), old_id, [ref])
    j.close()


def test_host_id_is_the_kernel_boot_id():
    assert host_id() == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_read_memory_is_reused_only_once_nothing_refers_to_it():
    import numpy as np

    from tidal.broker.local_journal import ReadMemory

    memory = ReadMemory(max_bytes=1 << 20)
    a = memory.take(100_000)
    a_id = id(a.obj)
    view = np.frombuffer(a[:8], np.uint8)  # like a decoded sample's array
    del a
    b = memory.take(100_000)
    b_id = id(b.obj)
    assert b_id != a_id  # a's memory is still referred to by `view`
    del b, view
    c = memory.take(90_000)
    assert id(c.obj) in (a_id, b_id) and len(memory.bases) == 2  # reused, nothing new
    assert np.asarray(c).ctypes.data % 4096 == 0
    d = memory.take(900_000)  # over what may be kept beside the others: used once, not kept
    assert len(d) == 900_000 and sum(map(len, memory.bases)) <= 1 << 20

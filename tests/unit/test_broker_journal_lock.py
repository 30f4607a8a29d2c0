"""One broker per journal directory: the second to lock it is refused, saying who holds it, and the lock
goes with its holder."""

import os

import pytest

from tidal.broker.journal_lock import journal_holder, lock_journal_dir
from tidal.errors import ConfigError


def test_a_second_lock_is_refused_naming_the_holder_until_the_first_is_let_go(tmp_path):
    assert journal_holder(tmp_path) is None
    fd = lock_journal_dir(tmp_path, "tcp://127.0.0.1:5555")
    holder = journal_holder(tmp_path)
    assert holder.startswith(f"pid {os.getpid()} on ") and "serving tcp://127.0.0.1:5555" in holder
    with pytest.raises(ConfigError) as err:
        lock_journal_dir(tmp_path, "tcp://127.0.0.1:5556")
    message = str(err.value)
    assert f"broker.journal.dir={str(tmp_path)!r} is in use by another broker (pid {os.getpid()}" in message
    assert "Stop that broker first" in message
    os.close(fd)  # what the kernel does when the holder dies
    assert journal_holder(tmp_path) is None
    os.close(lock_journal_dir(tmp_path, "tcp://127.0.0.1:5556"))

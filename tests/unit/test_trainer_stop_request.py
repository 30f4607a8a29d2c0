"""A signal asks the trainer to stop at its next batch boundary instead of killing it mid-step."""

import os
import signal

import pytest

from tidal.trainer.stop_request import StopRequest


def test_sigterm_is_recorded_and_a_repeat_changes_nothing():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    try:
        assert not stop.requested and not stop.agreed() and stop.name == "no signal"
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
        assert stop.requested and stop.agreed() and stop.name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # `tidal run` signals the group, torchrun forwards another
        assert stop.name == "SIGTERM"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_sigint_interrupts_at_once():
    before = signal.getsignal(signal.SIGINT)  # not always Python's default: an event loop may have set one
    stop = StopRequest()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before

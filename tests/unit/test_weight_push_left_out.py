"""Engines a weight sync dropped are tried again after 1, 2, 4, ... steps (trainer/main.py LeftOut), with the
sync's own report (weights_sync/sync_report.py). A dropped engine used to stay out until the broker's list
of engines changed, so one restarted on its URL never got weights again."""

from tidal.trainer.main import LeftOut
from tidal.weights_sync.sync_report import SyncReport

A, B = "http://a:1", "http://b:1"


def _report(engines: list[str], dropped: list[str]) -> SyncReport:
    return SyncReport(version=0, engines=engines, dropped=dropped)


def test_a_dropped_engine_is_tried_again_after_a_growing_number_of_steps():
    left_out = LeftOut()
    tried = []
    for step in range(1, 40):
        urls = left_out.filter([A, B], step)
        if B in urls:
            tried.append(step)
        # B refuses every update (another model): each sync that includes it drops it
        left_out.update(_report([A], [B] if B in urls else []), step)
    assert tried == [1, 2, 4, 8, 16, 32]


def test_an_engine_that_takes_the_weights_again_is_kept_from_then_on():
    left_out = LeftOut()
    left_out.update(_report([A], [B]), 10)  # down while its node restarted it on the same URL
    assert left_out.filter([A, B], 10) == [A]
    assert left_out.filter([A, B], 11) == [A, B]
    left_out.update(_report([A, B], []), 11)
    assert all(left_out.filter([A, B], step) == [A, B] for step in range(11, 20))


def test_the_wait_stops_growing_at_its_cap():
    left_out = LeftOut()
    step = 0
    for _ in range(10):
        left_out.update(_report([A], [B]), step)
        step = left_out.until[B]
    assert left_out.wait[B] == LeftOut.MAX_STEPS

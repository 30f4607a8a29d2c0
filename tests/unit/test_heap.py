import gc

from tidal.heap import freeze_start_up_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_frozen_start_up_objects_leave_collections_and_later_cycles_are_still_collected():
    start_up = _Node()
    try:
        frozen = freeze_start_up_heap()
        assert frozen >= 1
        assert not any(o is start_up for o in gc.get_objects())  # collections no longer walk it

        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle made after start-up: the collector still frees it
        ids = {id(a), id(b)}
        del a, b
        assert gc.collect() >= 2
        assert not any(id(o) in ids and isinstance(o, _Node) for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is start_up for o in gc.get_objects())

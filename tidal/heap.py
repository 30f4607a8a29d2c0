"""The garbage collector in tidal's long-lived processes.

A full collection walks every object a process holds. What a process built at start-up (imported modules,
a model, a replayed broker state) lives until it exits, so walking it again at every full collection is
pure cost, and it is paid in one stretch: a pause of the thread that triggered it.
"""

from __future__ import annotations

import gc


def freeze_start_up_heap() -> int:
    """Collect what start-up left for garbage, then move every object alive now into the permanent
    generation, which collections no longer walk. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

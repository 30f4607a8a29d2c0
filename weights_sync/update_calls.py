"""The calls that open and close a weight update on every engine, one thread per engine.

Opening is ``/pause_generation`` then ``/begin_weight_update``; closing ``/end_weight_update`` then
``/continue_generation`` (SGLang's order: begin after pause, resume after end). An engine that declared
``pause_in_update`` (tidal's) gets each pair as one call, with the same order inside the engine.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from tidal.weights_sync.engine_api import EngineWeightsClient


@dataclass
class Calls:
    """Control calls in flight to every engine (``begin`` or ``end``), by engine url."""

    what: str
    started: float
    futures: dict[str, Future] = field(default_factory=dict)
    ended: float = 0.0  # when the last of them finished

    def add(self, url: str, future: Future) -> None:
        self.futures[url] = future
        future.add_done_callback(self._finished)

    def _finished(self, _: Future) -> None:
        self.ended = max(self.ended, time.perf_counter())

    def done(self) -> bool:
        return all(f.done() for f in self.futures.values())


def start(
    what: str,
    clients: dict[str, EngineWeightsClient],
    declared: dict[str, frozenset[str]],
    pause_mode: str | None,
    pool: Executor,
) -> Calls:
    """Open (``what="begin"``) or close (``"end"``) the update on every engine in ``clients``; ``declared``:
    each engine's extensions; ``pause_mode`` None: generation is neither paused nor continued. (Sending each
    pair as two calls at once measured no faster: an engine's event loop handles them one by one.)"""

    def call(client: EngineWeightsClient, combined: bool) -> None:
        if what == "begin":
            if combined:
                client.begin(pause_mode=pause_mode)
                return
            if pause_mode:
                client.pause(pause_mode)
            client.begin()
        else:
            if combined:
                client.end(resume=True)
                return
            client.end()
            if pause_mode:
                client.resume()

    calls = Calls(what, time.perf_counter())
    for url, client in clients.items():
        combined = bool(pause_mode) and "pause_in_update" in declared.get(url, ())
        calls.add(url, pool.submit(call, client, combined))
    return calls

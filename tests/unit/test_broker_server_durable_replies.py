"""The broker answers a trainer's registration only once the model it journals is written.

The server runs in this process (a real ROUTER socket on loopback, a real journal with its writer thread,
a real client) so that the test can hold the journal's write pass, as the writer thread does while it
writes a large commit: the record then waits in the queue, and the reply must wait with it. A reply that
outran it let a broker killed at that moment restart without the model and admit nodes of another one.
"""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tidal.broker.client import BrokerClient
from tidal.broker.config import BrokerConfig
from tidal.broker.journal import Journal, Kind
from tidal.broker.server import BrokerServer
from tidal.broker.source import PromptSource, load_rows
from tidal.broker.state import BrokerState
from tidal.broker.testing import write_rows
from tidal.procs import free_port

TRAINED = {"fingerprint": "aaaa", "summary": "qwen3 (vocab 512, hidden 128, 2 layers)"}


class InProcessBroker:
    def __init__(self, tmp_path):
        self.cfg = BrokerConfig.model_validate(
            {"bind": f"tcp://127.0.0.1:{free_port()}", "group_size": 2, "batch_groups": 2}
        )
        rows = load_rows([write_rows(tmp_path / "data.jsonl", 8)])
        self.journal = Journal.from_config(tmp_path / "journal", self.cfg.journal)
        state = BrokerState(self.cfg, PromptSource(rows, seed=0, shuffle=False, epochs=1), self.journal)
        state.replay(self.journal.open(), self.journal.replayed_locs)
        self.server = BrokerServer(self.cfg, state)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def _serve(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self.server.serve(self.stop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self._thread.join(10)
        self.journal.close()


def test_a_trainers_registration_is_answered_once_its_model_is_written(tmp_path):
    broker = InProcessBroker(tmp_path)
    trainer, node = BrokerClient(broker.cfg.bind, timeout_s=10), BrokerClient(broker.cfg.bind, timeout_s=10)
    try:
        assert broker.journal.background  # the default journal: a writer thread beside the event loop
        with ThreadPoolExecutor(1) as pool:
            with broker.journal._pass:  # the writer thread is in the middle of a write
                registering = pool.submit(trainer.register, "trainer", "t", {"model": TRAINED})
                time.sleep(0.5)
                assert not registering.done()  # the model's record is queued, not written: no answer yet
                assert broker.journal.durable_seq < broker.journal.appended_seq
            registering.result(10)  # the writer thread wrote it, and the answer followed
        assert broker.journal.durable_seq == broker.journal.appended_seq
        # a node's registration journals nothing and is answered at once, the pass held or not
        with broker.journal._pass:
            node.register("rollout", "n", {"model": TRAINED})
    finally:
        trainer.close()
        node.close()
        broker.close()
    records = Journal(tmp_path / "journal").open()
    assert [kind for kind, _ in records][-1] == Kind.VERSION  # the trainer's model, as the restart reads it

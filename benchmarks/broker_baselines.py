"""The baselines tidal's broker is measured against, over the same samples (benchmarks/broker_throughput.py):
raw pyzmq PUSH/PULL (the ceiling) and verl's Ray patterns (an actor holding a deque; ``ray.util.queue``).

Ray workers import this module by name: ``broker_throughput.py`` starts Ray with this folder on their path.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq
from proc_stats import HostWindow, SchedWindow, sched_line, sched_mean, sched_totals

PRODUCERS = 2
BATCH_WAIT_S = 120.0  # a consumer that gets no batch this long gives up (a producer died)
META = {
    "data_source": "openai/gsm8k",
    "finish_reason": "stop",
    "uid": "a" * 96,
    "prompt_index": 123456,
    "reward": 1.0,
    "extra": {"answer": "72", "split": "train", "ability": "math"},
}


def sample_arrays(tokens: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(tokens)
    return {
        "response_ids": rng.integers(0, 150_000, tokens, dtype=np.int32),
        "logprobs": rng.standard_normal(tokens).astype(np.float32),
        "versions": np.full(tokens, 3, np.int32),
    }


def sample_bytes(tokens: int) -> int:
    return tokens * 12 + len(msgpack.packb(META))


def raw_frame(arrays: dict[str, np.ndarray]) -> bytes:
    return msgpack.packb(
        {**{k: v.tobytes() for k, v in arrays.items()}, "dtype": "<i4,<f4,<i4", "meta": META}
    )


# ------------------------------------------------------------------------------------------- raw pyzmq
def _zmq_producer(address: str, tokens: int, n: int, go, cpu) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    arrays = sample_arrays(tokens)
    go.wait()
    c0, sched = time.process_time(), SchedWindow()
    for _ in range(n):
        sock.send(raw_frame(arrays), copy=False)
    sock.close(linger=-1)
    # ctx.term() waits while ZeroMQ's I/O thread sends what is queued, then ends that thread and its
    # record in /proc: the shares are read before it (they miss that last stretch)
    threads = sched.result()
    ctx.term()
    cpu.put((time.process_time() - c0, sched_totals(threads)))


def run_zmq(tokens: int, n: int, workdir: Path) -> tuple[float, int, dict[str, float], dict[str, float]]:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, int(BATCH_WAIT_S * 1000))  # a producer died: zmq.Again, not a hang
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    go, cpu = mp.Event(), mp.Queue()
    procs = [
        mp.Process(target=_zmq_producer, args=(f"tcp://127.0.0.1:{port}", tokens, n // PRODUCERS, go, cpu))
        for _ in range(PRODUCERS)
    ]
    for p in procs:
        p.start()
    time.sleep(0.5)
    window = HostWindow(workdir)
    go.set()
    t0, c0, sched = time.perf_counter(), time.process_time(), SchedWindow()
    got = n // PRODUCERS * PRODUCERS
    for _ in range(got):
        frame = pull.recv(copy=False)
        msgpack.unpackb(frame.buffer)
    elapsed, consumer = time.perf_counter() - t0, time.process_time() - c0
    window.stop()
    consumer_sched = sched_totals(sched.result())
    reports = [cpu.get() for _ in procs]
    producers = sum(r[0] for r in reports)
    for p in procs:
        p.join()
    pull.close(0)
    ctx.term()
    scheduling = {"producer": sched_mean([r[1] for r in reports]), "consumer": consumer_sched}
    print(sched_line(scheduling), file=sys.stderr)
    host = window.result(producers + consumer)
    host["scheduling"] = scheduling
    return elapsed, got, {"producers": producers, "consumer": consumer}, host


# ------------------------------------------------------------------------------------------------ ray
def run_ray_deque(tokens: int, n: int) -> float:
    import ray

    @ray.remote(num_cpus=0)
    class DequeActor:
        def __init__(self):
            from collections import deque

            self.q = deque()

        def put(self, item):
            self.q.append(item)

        def get(self):
            return self.q.popleft() if self.q else None

    @ray.remote(num_cpus=0)
    def producer(actor, count):
        arrays = sample_arrays(tokens)
        for _ in range(count):
            ray.get(actor.put.remote({**arrays, "meta": META}))

    actor = DequeActor.remote()
    ray.get(actor.get.remote())
    per = n // PRODUCERS
    t0 = time.perf_counter()
    tasks = [producer.remote(actor, per) for _ in range(PRODUCERS)]
    got = 0
    while got < per * PRODUCERS:
        if ray.get(actor.get.remote()) is not None:
            got += 1
    elapsed = time.perf_counter() - t0
    ray.get(tasks)
    ray.kill(actor)
    return elapsed


def run_ray_queue(tokens: int, n: int, batch: int) -> float:
    import ray
    from ray.util.queue import Queue

    @ray.remote(num_cpus=0)
    def producer(queue, count):
        arrays = sample_arrays(tokens)
        sent = 0
        while sent < count:
            k = min(batch, count - sent)
            queue.put_nowait_batch([{**arrays, "meta": META} for _ in range(k)])
            sent += k

    queue = Queue(actor_options={"num_cpus": 0})
    per = n // PRODUCERS
    t0 = time.perf_counter()
    tasks = [producer.remote(queue, per) for _ in range(PRODUCERS)]
    got = 0
    while got < per * PRODUCERS:
        size = queue.qsize()
        if size == 0:
            time.sleep(0.0005)
            continue
        got += len(queue.get_nowait_batch(min(size, batch)))
    elapsed = time.perf_counter() - t0
    ray.get(tasks)
    queue.shutdown()
    return elapsed

"""How a decode step runs the lean forward: eagerly, or padded to fixed buckets and replayed as CUDA graphs.

A CUDA graph replays fixed shapes at fixed addresses, so the step is padded: the rows up to a batch bucket
(1, 2, 4, ..., max_batch_size) and the attended cache up to a length bucket (32, 48, 64, 96, 128, ...: at
most 1.5x the longest row, ``max_seq_len`` last). Token ids and positions are copied into static buffers,
and the graph writes the logits into a static buffer. Padding rows are free KV slots (the running batch is
slots ``0..n-1``), given token 0 at position 0: they write a key nobody reads (a slot's cache is rewritten
by its prefill) and attend over that one key, so their logits are finite and discarded.

Graphs are captured for every bucket pair when the scheduler starts (a few seconds; no capture in the
middle of serving). Weights are read in place, so a weight update is seen by every graph. If a capture
fails, the step falls back to the eager lean forward and says why once (``DecodeGraphs.failure``).
Without CUDA (``capture=False``) the same padding runs eagerly: that is how CPU tests check the padding.
"""

from __future__ import annotations

import logging
import time

import torch

from tidal.rollout.embedded.lean import LeanDecoder

log = logging.getLogger(__name__)
MIN_LENGTH_BUCKET = 32


def batch_buckets(max_rows: int) -> list[int]:
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return [*sizes, max_rows]


def length_buckets(max_len: int) -> list[int]:
    """32, 48, 64, 96, 128, 192, ... (each at most 1.5x the previous), ending at ``max_len``."""
    sizes, size = [], MIN_LENGTH_BUCKET
    while size < max_len:
        sizes.append(size)
        if size * 3 // 2 < max_len:
            sizes.append(size * 3 // 2)
        size *= 2
    return sorted({*sizes, max_len})


def _bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class EagerDecode:
    """The lean forward on exactly the running rows, attending up to the longest row."""

    def __init__(self, decoder: LeanDecoder):
        self.decoder = decoder

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, last: int, uniform: bool) -> torch.Tensor:
        """``ids``/``positions``: ``[rows]`` on the device; ``last``: the largest position; ``uniform``: all
        rows at ``last`` (then no mask). The host never reads the device here, so steps chain without a sync."""
        return self.decoder(ids, positions, last + 1, masked=not uniform)

    def greedy(
        self, ids: torch.Tensor, positions: torch.Tensor, last: int, uniform: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every row greedy: (tokens, their logprobs) from the native step in one call; None without it."""
        step = self.decoder.native_step
        return None if step is None else step.greedy(ids, positions)


class DecodeGraphs:
    """The lean forward padded to (batch, length) buckets; CUDA graphs per bucket pair when ``capture``."""

    def __init__(self, decoder: LeanDecoder, max_rows: int, max_seq_len: int, *, capture: bool):
        self.decoder = decoder
        # the static-shape MoE paths, which graphs can capture (padding without capture runs the same ones),
        # and PyTorch's ops on CPU too, which is what the bucketed mode is there to check
        decoder.grouped_mm = False
        if decoder.native_step is not None:
            decoder.native_step = None
            decoder.step = "torch (the padded CUDA-graph step runs PyTorch's ops)"
        self.device = decoder.device
        self.rows_buckets = batch_buckets(max_rows)
        self.len_buckets = length_buckets(max_seq_len)
        self.ids = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        vocab = decoder.lm_head.shape[0]
        self.logits = torch.zeros(max_rows, vocab, dtype=decoder.dtype, device=self.device)
        self.capture = capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.failure: str | None = None
        self.capture_seconds = 0.0
        self.stale = False  # graphs dropped because the weights moved; captured again by the scheduler

    def _forward(self, rows: int, length: int) -> torch.Tensor:
        return self.decoder(self.ids[:rows], self.positions[:rows], length, masked=True)

    def capture_all(self) -> None:
        """Capture a graph for every bucket pair (the pool's slots must all be free: padding writes there)."""
        if not self.capture or self.failure is not None:
            return
        self.stale = False
        t0 = time.perf_counter()
        self.ids.zero_()
        self.positions.zero_()
        try:
            mempool = torch.cuda.graph_pool_handle()
            # every shape once off the capture (lazy initialisations, per-shape kernel choices and plans),
            # on a side stream as torch.cuda.graphs asks
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for rows in self.rows_buckets:
                    for length in self.len_buckets:
                        self._forward(rows, length)
            torch.cuda.current_stream(self.device).wait_stream(side)
            # largest first: later (smaller) graphs reuse the pool memory the first one reserved
            for rows in reversed(self.rows_buckets):
                for length in reversed(self.len_buckets):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
                        self.logits[:rows].copy_(self._forward(rows, length))
                    self.graphs[(rows, length)] = graph
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
            self.graphs.clear()
            self.failure = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, decoding eagerly: %s", self.failure)
        self.capture_seconds = time.perf_counter() - t0

    def drop_graphs(self) -> None:
        """Drop the captured graphs: they replay the addresses the weights had at capture, which a relayout
        (``arena.relayout``) frees. Marks them ``stale``: the scheduler captures again once the pool's slots
        are all free (a capture writes padding rows there); meanwhile the padded step runs eagerly."""
        if not self.capture or self.failure is not None:
            return
        if self.graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay in flight still reads through them
        self.graphs.clear()  # their private memory pool goes with the last graph
        self.stale = True

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, last: int, uniform: bool) -> torch.Tensor:
        """Same contract as :class:`EagerDecode`; the rows past ``len(ids)`` up to the bucket are padding."""
        n = ids.shape[0]
        rows = _bucket(self.rows_buckets, n)
        length = _bucket(self.len_buckets, last + 1)
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        if rows > n:
            self.ids[n:rows].zero_()
            self.positions[n:rows].zero_()
        graph = self.graphs.get((rows, length))
        if graph is None:
            return self._forward(rows, length)[:n]
        graph.replay()
        return self.logits[:n]

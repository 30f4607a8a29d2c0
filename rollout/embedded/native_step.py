"""The whole lean decode (or prefill) step of Qwen3 / Qwen3-MoE on CPU as one call into C (fp32).

With every op of a step a separate PyTorch call, a batch-64 decode step of the default job's model spent a
quarter of its time in ~60 small ops (norms, rotary, residuals, routing) and a third in GEMMs run by MKL,
which uses its AVX2 code on AMD CPUs (about half of an AVX-512 core's rate on Zen 5). This kernel runs a
step's every layer in one call: its GEMMs are ``native_gemm.py``'s register-tiled AVX-512 (or AVX2) loops
over the weights in their own layout, the small ops are loops over the same columns, and the attention is
``native_attention.py``'s. The three sources compile into one library (``native_build.py``); the step's own C source and the
ctypes mirror of its structs are ``native_step_kernel.py``, this module binds a model to it.

Layout: activations are feature-major (``[features, columns]``, one column per row, columns padded with
zeros to the vector width), so every projection is ``W[N, K] @ X[K, columns]`` with the weights read where
the model keeps them (the fused Q/K/V and gate/up matrices, the experts' ``[E, 2I, H]`` / ``[E, H, I]``
tensors, the norms, the rotary tables) and the rows of one step side by side in a vector register. Nothing
is packed or copied, so weight updates by name are seen at the next step, as by the PyTorch path; the
pointers are read from the tensors at every call (a woken engine's storage may have moved).

Arithmetic follows transformers' (RMSNorm in fp32 with the weight applied after, q/k norm per head, rotary
``q*cos + rotate_half(q)*sin`` from the model's own tables, router softmax in fp32, top-k renormalised,
experts summed per row in expert order, the residual added after each block); sums run in another order
than MKL's, so results agree with PyTorch's to fp32 rounding, not bit for bit. Single-threaded: ``auto``
picks it when the engine runs one intra-op thread (``lean.py``'s ``cpu_step``).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from tidal.rollout.embedded import native_attention, native_build
from tidal.rollout.embedded.native_step_kernel import SOURCE, TIMED_PARTS, Layer, Model

# scratch memory kept between steps (64 MiB); a step that needs more allocates its own for that call
KEPT_SCRATCH_FLOATS = 16 << 20


@cache
def load(isa: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """The compiled step library for ``isa`` (None: the best this machine runs), or None and why not."""
    lib, how = native_build.load(SOURCE, isa)
    if lib is None:
        return None, how
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.tidal_forward_step.argtypes = [ptr, i32, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr, i64]
    lib.tidal_forward_step.restype = ctypes.c_int
    lib.tidal_step_scratch_floats.argtypes = [ptr, i32, i32]
    lib.tidal_step_scratch_floats.restype = ctypes.c_int64
    lib.tidal_gemm.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32, ptr]
    lib.tidal_gemm.restype = None
    return lib, how


def unsupported_reason(decoder) -> str | None:
    """Why the native step cannot run ``decoder`` (a ``LeanDecoder``), None when it can."""
    if decoder.device.type != "cpu":
        return f"the native step is for CPU; this decoder runs on {decoder.device}"
    if decoder.dtype != torch.float32:
        return f"the native step is fp32; the model is {decoder.dtype}"
    if decoder.head_dim not in native_attention.SUPPORTED_HEAD_DIMS:
        return f"head_dim {decoder.head_dim} (the native step covers {native_attention.SUPPORTED_HEAD_DIMS})"
    act = getattr(decoder.lm.config, "hidden_act", None)
    if act != "silu":
        return f"hidden_act {act!r} (the native step runs SiLU)"
    if getattr(decoder.lm.config, "num_experts", 0) and decoder.lm.config.num_experts > 1024:
        return f"{decoder.lm.config.num_experts} experts (the native step routes up to 1024)"
    tensors = [decoder.embed, decoder.final_norm, decoder.lm_head]
    for layer in decoder.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    if any(not t.is_contiguous() for t in tensors):
        return "a weight that is not contiguous"
    return None


class NativeStep:
    """``logits = step(ids, positions, slots=None, out_rows=None)`` over the decoder's tensors and KV pool.

    Row ``r`` is token ``ids[r]`` at ``positions[r]`` of KV slot ``slots[r]`` (None: slot ``r``, a decode
    step over the compacted running batch); every row's key and value are written before any row attends
    (a prefill passes a prompt's tokens as rows of one slot: causal by position). Logits of the rows
    ``out_rows`` (None: all), ``[len(out_rows), vocab]`` float32.
    """

    def __init__(self, decoder, lib: ctypes.CDLL):
        self.d = decoder
        self.lib = lib
        self._layers = (Layer * len(decoder.layers))()
        self.model = Model(
            layers=len(decoder.layers),
            hidden=decoder.embed.shape[1],
            heads=decoder.heads,
            kv_heads=decoder.kv_heads,
            head_dim=decoder.head_dim,
            experts=next((x.experts_gate_up.shape[0] for x in decoder.layers if x.router is not None), 0),
            top_k=decoder.top_k,
            norm_topk=int(bool(decoder.norm_topk_prob)),
            vocab=decoder.lm_head.shape[0],
            max_seq_len=decoder.pool.max_seq_len,
            slots=decoder.pool.num_slots,
            eps=decoder.eps,
            scaling=decoder.scaling,
            layer=self._layers,
        )
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.timings: torch.Tensor | None = None

    def time_parts(self, on: bool = True) -> None:
        """Add up nanoseconds per part of every later step in ``timings`` (TIMED_PARTS; the profiler's)."""
        self.timings = torch.zeros(len(TIMED_PARTS), dtype=torch.float64) if on else None
        ptr = ctypes.POINTER(ctypes.c_double)
        self.model.timings = ctypes.cast(self.timings.data_ptr(), ptr) if on else ptr()

    def rebind(self) -> None:
        """Re-read the weights' (and the pool's) addresses now, e.g. after ``arena.relayout`` moved them; the
        compiled code stays. Every step binds again before its call as well."""
        self._bind()

    def _bind(self) -> None:
        """Point the model description at the tensors as they are now (a woken storage may have moved)."""
        d, m = self.d, self.model
        m.embed, m.final_norm, m.lm_head = d.embed.data_ptr(), d.final_norm.data_ptr(), d.lm_head.data_ptr()
        m.cos, m.sin_signed = d.cos.data_ptr(), d.sin_signed.data_ptr()
        for index, (layer, out) in enumerate(zip(d.layers, self._layers, strict=True)):
            out.input_norm = layer.input_norm.data_ptr()
            out.post_norm = layer.post_norm.data_ptr()
            out.qkv = layer.qkv.data_ptr()
            out.q_norm = layer.q_norm.data_ptr()
            out.k_norm = layer.k_norm.data_ptr()
            out.o_proj = layer.o_proj.data_ptr()
            out.keys = d.pool.keys[index].data_ptr()
            out.values = d.pool.values[index].data_ptr()
            if layer.router is None:
                out.gate_up, out.down = layer.gate_up.data_ptr(), layer.down.data_ptr()
                out.router = out.experts_gate_up = out.experts_down = None
                out.intermediate = layer.down.shape[1]
            else:
                out.gate_up = out.down = None
                out.router = layer.router.data_ptr()
                out.experts_gate_up = layer.experts_gate_up.data_ptr()
                out.experts_down = layer.experts_down.data_ptr()
                out.intermediate = layer.experts_down.shape[2]

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor | None = None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._run(ids, positions, slots, out_rows, greedy=False)[0]

    def greedy(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step whose rows are all greedy: each row's argmax token and its log-softmax, computed in
        the kernel (``sampling.sample``'s result for greedy rows, without three PyTorch ops over the logits)."""
        _, tokens, logprobs = self._run(ids, positions, None, None, greedy=True)
        return tokens, logprobs

    def _run(self, ids, positions, slots, out_rows, *, greedy: bool):
        rows = ids.shape[0]
        n_out = rows if out_rows is None else out_rows.shape[0]
        if rows == 0 or n_out == 0:
            raise ValueError("native step: no rows")
        ids, positions = _int64(ids), _int64(positions)
        slots = None if slots is None else _int64(slots)
        out_rows = None if out_rows is None else _int64(out_rows)
        self._bind()
        model = ctypes.byref(self.model)
        need = self.lib.tidal_step_scratch_floats(model, rows, n_out)
        scratch = self.scratch
        if scratch.numel() < need:
            # every buffer is written before it is read (padding columns included), so no zeroing; a step
            # larger than KEPT_SCRATCH_FLOATS (a big model's long prefill) gets memory of its own, freed after
            scratch = torch.empty(need, dtype=torch.float32)
            if need <= KEPT_SCRATCH_FLOATS:
                self.scratch = scratch
        logits = torch.empty(n_out, self.model.vocab, dtype=torch.float32)
        tokens = torch.empty(n_out, dtype=torch.int64) if greedy else None
        logprobs = torch.empty(n_out, dtype=torch.float32) if greedy else None
        status = self.lib.tidal_forward_step(
            model,
            rows,
            ids.data_ptr(),
            positions.data_ptr(),
            None if slots is None else slots.data_ptr(),
            n_out,
            None if out_rows is None else out_rows.data_ptr(),
            logits.data_ptr(),
            None if tokens is None else tokens.data_ptr(),
            None if logprobs is None else logprobs.data_ptr(),
            scratch.data_ptr(),
            scratch.numel(),
        )
        if status != 0:
            raise ValueError(f"native step: {_REFUSED.get(status, f'status {status}')}")
        return logits, tokens, logprobs


_REFUSED = {
    -1: "a model shape it does not handle",
    -2: "too little scratch memory",
    -3: "a token id outside the vocabulary",
    -4: "a position outside the KV pool's max_seq_len",
    -5: "a KV slot outside the pool",
    -6: "an output row outside the step's rows",
}


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()

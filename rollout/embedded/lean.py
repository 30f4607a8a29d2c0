"""A lean decode forward for Qwen3 and Qwen3-MoE over the model's own (fused) weights.

transformers' modules spend most of a decode step on Python: per-layer module calls, keyword plumbing,
mask builders, rotary recomputation. A decode step needs about a dozen tensor ops per layer, which is what
this module runs, reading the very tensors the transformers model holds (``qkv_weight`` and
``gate_up_weight`` from ``fused.py``, the experts' fused matrices, the norms): weight loads by name write
them in place and are seen here (and by CUDA graphs captured over this forward) without any copy.

Layout contract with the scheduler: the rows of a decode step are the KV pool's slots ``0..rows-1`` (the
scheduler keeps the running batch compact), so attention reads a view of the pool, never a gather. Each row
writes its new key and value at its own position and attends over keys ``0..position`` (a length mask).

The arithmetic follows transformers' (RMSNorm in fp32 as one ``rms_norm``, rotary as ``q*cos +
rotate_half(q)*sin`` with the rotary module's own tables, router softmax in fp32, top-k renormalised), so
greedy tokens equal transformers' and logprobs agree within fp32 rounding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tidal.rollout.embedded import native_attention, native_step
from tidal.rollout.embedded.kv_cache import KVPool

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
# CPU decode attention: the native kernel (native_attention.py) where it builds, else PyTorch's matmuls
CPU_ATTENTION = ("auto", "native", "torch")
# how the whole step runs on CPU: one call into the native step (native_step.py; single-threaded), or PyTorch
# ops (attention per CPU_ATTENTION); auto: native where it builds and the engine runs one intra-op thread
CPU_STEP = ("auto", "native", "torch")
# SDPA kernels for the decode attention: the memory-efficient one takes the length mask and is captured
# by CUDA graphs; math is the always-available fallback. (cuDNN's builds a plan per shape, which a capture
# must not do.)
_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def sdpa_backends(restrict: bool):
    return sdpa_kernel(_SDPA_BACKENDS) if restrict else contextlib.nullcontext()


def unsupported_reason(lm: nn.Module) -> str | None:
    """Why the lean decoder cannot run ``lm`` (None when it can)."""
    config = lm.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} (lean decode covers {list(SUPPORTED_MODEL_TYPES)})"
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention layers"
    rope_type = getattr(lm.model.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        # these rescale the frequencies by the sequence length seen; the tables are built once
        return f"rope_type {rope_type!r} (frequencies that depend on the sequence length)"
    for layer in lm.model.layers:
        if not hasattr(layer.self_attn, "qkv_weight"):
            return "attention without fused Q/K/V (rollout.engine.fuse_projections is off, or attention bias)"
        mlp = layer.mlp
        if not hasattr(mlp, "gate_up_weight") and not hasattr(mlp, "experts"):
            return "an MLP without fused gate/up"
    return None


@dataclass
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor  # rows in megatron's grouped order (fused.py)
    qkv_order: torch.Tensor  # the gather of its output columns into q | k | v order
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    # dense MLP
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    # MoE
    router: torch.Tensor | None
    experts_gate_up: torch.Tensor | None  # [E, 2I, H]
    experts_down: torch.Tensor | None  # [E, H, I]


class LeanDecoder:
    """One decode token for rows ``0..n-1`` of the pool: ``logits = decoder(ids, positions, kv_len)``."""

    def __init__(self, lm: nn.Module, pool: KVPool, cpu_attention: str = "auto", cpu_step: str = "auto"):
        reason = unsupported_reason(lm)
        if reason is not None:
            raise ValueError(f"lean decode does not support this model: {reason}")
        if cpu_attention not in CPU_ATTENTION:
            raise ValueError(f"cpu_attention={cpu_attention!r}: choose one of {list(CPU_ATTENTION)}")
        if cpu_step not in CPU_STEP:
            raise ValueError(f"cpu_step={cpu_step!r}: choose one of {list(CPU_STEP)}")
        config = lm.config
        self.lm = lm
        self.pool = pool
        self.device = pool.device
        self.dtype = lm.dtype
        self.eps = config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        attn0 = lm.model.layers[0].self_attn
        self.qkv_sizes = list(attn0.qkv_sizes)
        self.top_k = getattr(config, "num_experts_per_tok", 0)
        self.norm_topk_prob = getattr(config, "norm_topk_prob", False)
        # attention through SDPA (CUDA) or two matmuls (CPU); see _attend
        self.sdpa_attention = self.device.type == "cuda"
        # sorted (row, expert) pairs through torch._grouped_mm on CPU (a kernel for any dtype there)
        self.grouped_mm = self.device.type == "cpu" and hasattr(torch, "_grouped_mm")
        self.act = lm.model.layers[0].mlp.act_fn if hasattr(lm.model.layers[0].mlp, "act_fn") else None
        self.layers = [self._layer(layer) for layer in lm.model.layers]
        if self.act is None:
            self.act = next(
                layer.mlp.experts.act_fn for layer in lm.model.layers if hasattr(layer.mlp, "experts")
            )
        self.embed = lm.model.embed_tokens.weight
        self.final_norm = lm.model.norm.weight
        self.lm_head = lm.get_output_embeddings().weight
        self.native, self.attention = self._native_attention(cpu_attention)
        self.cos, self.sin = self._rotary_tables(lm, pool.max_seq_len)
        # rotate_half(x) * sin == roll(x, half) * sin_signed (the first half's sign moved onto the table):
        # one roll instead of two slices, a negation and a concatenation, the same products bit for bit
        half = self.head_dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
        self.qk_heads = self.heads + self.kv_heads
        shape = (self.kv_heads, self.head_dim)
        for layer in range(len(self.layers)):
            pool.preallocate(layer, shape, shape, self.dtype)
        self.native_step, self.step = self._native_step(cpu_step)

    def _native_step(self, requested: str) -> tuple[native_step.NativeStep | None, str]:
        """The native whole-step kernel and a description of how the step runs (why not native)."""
        if requested == "torch":
            return None, "torch (asked for)"
        problem = native_step.unsupported_reason(self)
        if problem is None and requested == "auto" and torch.get_num_threads() != 1:
            problem = (
                f"the engine runs {torch.get_num_threads()} intra-op threads and the native step one "
                "(rollout.engine.num_threads=1 or cpu_step=native picks it)"
            )
        lib, how = (None, problem) if problem else native_step.load()
        if lib is None:
            if requested == "native":
                raise ValueError(f"cpu_step='native' is not available: {how}")
            return None, f"torch ({how})" if self.device.type == "cpu" else "torch"
        return native_step.NativeStep(self, lib), f"native ({how})"

    def _native_attention(self, requested: str) -> tuple[native_attention.NativeDecodeAttention | None, str]:
        """The native CPU decode attention and a description of the attention in use (why not native)."""
        if requested == "torch":
            return None, "torch (asked for)"
        problem = None
        if self.device.type != "cpu":
            problem = f"the native decode attention is for CPU; this decoder runs on {self.device}"
        elif self.dtype != torch.float32:
            problem = f"the native decode attention is fp32; the model is {self.dtype}"
        elif self.head_dim not in native_attention.SUPPORTED_HEAD_DIMS:
            problem = f"head_dim {self.head_dim} (native covers {native_attention.SUPPORTED_HEAD_DIMS})"
        fn, how = (None, problem) if problem else native_attention.load()
        if fn is None:
            if requested == "native":
                raise ValueError(f"cpu_attention='native' is not available: {how}")
            return None, f"torch ({how})" if self.device.type == "cpu" else "sdpa"
        kernel = native_attention.NativeDecodeAttention(
            fn, self.heads, self.kv_heads, self.head_dim, self.pool.max_seq_len, self.scaling
        )
        return kernel, how

    def refresh_weights(self) -> None:
        """Take the model's weight tensors again and re-point the native step at their addresses: after the
        weights moved (``arena.relayout``), or were replaced by other tensor objects. The rotary tables and
        the KV pool are not weights and stay."""
        lm = self.lm
        self.layers = [self._layer(layer) for layer in lm.model.layers]
        self.embed = lm.model.embed_tokens.weight
        self.final_norm = lm.model.norm.weight
        self.lm_head = lm.get_output_embeddings().weight
        if self.native_step is not None:
            problem = native_step.unsupported_reason(self)
            if problem is None:
                self.native_step.rebind()
            else:  # the native step reads weights in their own layout: PyTorch's ops from here on
                self.native_step, self.step = None, f"torch ({problem}, after the weights moved)"

    def _layer(self, layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        moe = hasattr(mlp, "experts")
        return _Layer(
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            qkv=attn.qkv_weight,
            qkv_order=attn.qkv_order,
            q_norm=attn.q_norm.weight,
            k_norm=attn.k_norm.weight,
            o_proj=attn.o_proj.weight,
            gate_up=None if moe else mlp.gate_up_weight,
            down=None if moe else mlp.down_proj.weight,
            router=mlp.gate.weight if moe else None,
            experts_gate_up=mlp.experts.gate_up_proj if moe else None,
            experts_down=mlp.experts.down_proj if moe else None,
        )

    def _rotary_tables(self, lm: nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the model's rotary module computes cos/sin elementwise per position, so a table row equals what
        # it computes for that position in a forward
        positions = torch.arange(length, device=self.device)[None]
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        cos, sin = lm.model.rotary_emb(probe, positions)
        return cos[0].contiguous(), sin[0].contiguous()

    # ---- the forward ----

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers: normalise in fp32, cast back to the input dtype, then scale by the weight
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return normed * weight
        return weight * normed.to(x.dtype)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, kv_len: int, masked: bool) -> torch.Tensor:
        """``[rows]`` token ids at ``[rows]`` positions -> ``[rows, vocab]`` logits (model dtype).

        ``kv_len`` > every position; ``masked``: rows differ in position (else every row is at position
        ``kv_len - 1`` and sees its whole cache).
        """
        if self.native_step is not None:
            return self.native_step(ids, positions)
        cos = self.cos[positions][:, None, :]  # [rows, 1, d]: broadcasts over heads
        sin = self.sin_signed[positions][:, None, :]
        native = self.native is not None and not self.sdpa_attention
        mask = lengths = None
        if native:
            lengths = positions + 1  # the keys each row attends
        elif masked:
            key_pos = torch.arange(kv_len, device=self.device)
            mask = (key_pos[None, :] <= positions[:, None])[:, None, None, :]  # [rows, 1, 1, kv_len]
        with sdpa_backends(self.sdpa_attention):
            return self._forward(ids, positions, kv_len, cos, sin, masked, mask, lengths)

    def _forward(self, ids, positions, kv_len, cos, sin, masked, mask, lengths) -> torch.Tensor:
        rows = ids.shape[0]
        qk_width = self.qk_heads * self.head_dim
        row_index = torch.arange(rows, device=self.device) if masked else None
        h = F.embedding(ids, self.embed)
        for index, layer in enumerate(self.layers):
            qkv = F.linear(self._norm(h, layer.input_norm), layer.qkv).index_select(-1, layer.qkv_order)
            qk = self._rotated_qk(qkv, layer, cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            v = qkv[:, qk_width:].view(rows, self.kv_heads, self.head_dim)
            k_buf, v_buf = self.pool.keys[index], self.pool.values[index]
            if not masked:  # every row writes at the same position: a strided copy, no scatter
                k_buf[:rows, :, kv_len - 1] = k
                v_buf[:rows, :, kv_len - 1] = v
            else:
                k_buf[row_index, :, positions] = k
                v_buf[row_index, :, positions] = v
            if lengths is not None:
                attn = self.native(q, k_buf, v_buf, lengths)
            else:
                attn = self._attend(q, k_buf[:rows, :, :kv_len], v_buf[:rows, :, :kv_len], mask)
            h = torch.addmm(h, attn, layer.o_proj.t())  # h + attn @ o_proj^T: the residual in the matmul
            x = self._norm(h, layer.post_norm)
            h = h + (self._mlp(x, layer) if layer.router is None else self._moe(x, layer))
        h = self._norm(h, self.final_norm)
        return F.linear(h, self.lm_head)

    def _rotated_qk(
        self, qkv: torch.Tensor, layer: _Layer, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """``[..., qkv width]`` -> the query and key heads ``[..., heads + kv_heads, dim]``, normalised together
        (one rms_norm), each scaled by its own weight, and rotated together."""
        qk = qkv[..., : self.qk_heads * self.head_dim].unflatten(-1, (self.qk_heads, self.head_dim))
        qk = F.rms_norm(qk.float(), (self.head_dim,), eps=self.eps).to(self.dtype)
        qk[..., : self.heads, :].mul_(layer.q_norm)
        qk[..., self.heads :, :].mul_(layer.k_norm)
        return qk * cos + torch.roll(qk, self.head_dim // 2, dims=-1) * sin

    def _attend(self, q, keys, values, mask) -> torch.Tensor:
        """One query per row over its cache.

        CUDA: SDPA (fp32 accumulation of the scores in bf16 too). CPU: query heads that share a K/V head are
        stacked as that head's rows and run as two matmuls (PyTorch's CPU SDPA kernels are tiled for long
        queries and cost more for a single one).
        """
        rows = q.shape[0]
        grouped = q.view(rows, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        if self.sdpa_attention:
            # the query heads of a K/V head as that head's "query positions" (the mask broadcasts over them):
            # GQA without repeating the cache, and a backend that takes a mask (memory-efficient) applies
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self.scaling)
            return out.reshape(rows, self.heads * self.head_dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float().mul_(self.scaling)
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(rows, self.heads * self.head_dim)

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, layer.down)

    def _moe(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """Qwen3-MoE's sparse block; static shapes (no data-dependent expert loop), so CUDA graphs capture it.

        Few rows (rows x top_k < experts): each row runs its own top-k experts (their matrices gathered:
        fewer bytes than all experts). Many rows: on CPU the (row, expert) pairs sorted by expert, one
        grouped matmul; else every expert runs on every row and the router's weights (zero off the top-k)
        combine them, which reads each expert once.
        """
        rows = x.shape[0]
        router_probs = torch.softmax(F.linear(x, layer.router), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        gate_up, down = layer.experts_gate_up, layer.experts_down
        experts = gate_up.shape[0]
        if rows * self.top_k < experts:
            picked_gate_up = gate_up[chosen]  # [rows, k, 2I, H]
            picked_down = down[chosen]  # [rows, k, H, I]
            hidden = torch.matmul(picked_gate_up, x[:, None, :, None]).squeeze(-1)  # [rows, k, 2I]
            gate, up = hidden.chunk(2, dim=-1)
            out = torch.matmul(picked_down, (self.act(gate) * up)[..., None]).squeeze(-1)  # [rows, k, H]
            return (out * weights[..., None]).sum(dim=1)
        if self.grouped_mm:
            return self._moe_grouped(x, chosen, weights, gate_up, down)
        dense = torch.zeros(rows, experts, dtype=x.dtype, device=x.device).scatter_(1, chosen, weights)
        hidden = torch.matmul(x[None], gate_up.transpose(1, 2))  # [E, rows, 2I]
        gate, up = hidden.chunk(2, dim=-1)
        out = torch.matmul(self.act(gate) * up, down.transpose(1, 2))  # [E, rows, H]
        return torch.einsum("erh,re->rh", out, dense)

    def _moe_grouped(self, x, chosen, weights, gate_up, down) -> torch.Tensor:
        """(row, expert) pairs sorted by expert, each expert's rows as one matmul (``torch._grouped_mm``).

        The pair count is fixed (rows * top_k) but the group sizes are data: fine eagerly, and the CPU's only
        path; CUDA graphs take the static-shape paths above.
        """
        experts = gate_up.shape[0]
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.top_k
        offsets = torch.bincount(flat, minlength=experts).cumsum(0).to(torch.int32)
        hidden = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=offsets)
        gate, up = hidden.chunk(2, dim=-1)
        out = torch._grouped_mm(self.act(gate) * up, down.transpose(1, 2), offs=offsets)
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, out)

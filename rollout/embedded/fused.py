"""Fused projections: one matmul for Q/K/V and one for gate/up, built once from the loaded weights.
RMSNorms run as PyTorch's single ``rms_norm`` op (the same fp32 arithmetic as transformers' eight small ops).

The fused matrix is the storage and the model's own ``q_proj``/``k_proj``/``v_proj`` (``gate_proj``/``up_proj``)
weights become views into it, so every later weight load (by name through ``NamedTensorLoader``'s ``copy_``,
or ``load_state_dict``) writes the fused matrix as well: nothing is re-fused and nothing can go stale. The
parameter names and the state dict are unchanged. Modules keep their class's behaviour; only ``forward`` of a
swapped-in subclass reads the fused weight.

The fused Q/K/V rows lie in megatron's grouped order, ``[kv_groups, q_heads_per_group + 2, head_dim,
hidden]`` (per KV group: its query heads' rows, its key head's, its value head's), so that a weight sync
sending megatron's fused matrix whole (``weights_sync/grouped_qkv.py``) lands in it in place, with no copy
apart. ``q_proj.weight`` is then the strided view ``[kv_groups, q_heads_per_group * head_dim, hidden]`` (HF's
rows in order, grouped; ``NamedTensorLoader``, ``state_dict`` and ``load_state_dict`` read and write it in
HF's 2-D shape) and the projection's
output columns are put back in q | k | v order by ``qkv_order`` (one gather of the activations, a small
fraction of the matmul's work).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from tidal.rollout.embedded.kv_cache import paged_attention

# transformers' classes whose forward is exactly "project Q/K/V (+ per-head norm), rotate, attend, project"
_ATTENTION = {"Qwen3Attention", "Qwen3MoeAttention"}
# ... and "down(act(gate(x)) * up(x))"
_MLP = {"Qwen3MLP", "Qwen3MoeMLP", "DeepseekV3MLP"}
_NORM = {"Qwen3RMSNorm", "Qwen3MoeRMSNorm", "DeepseekV3RMSNorm"}
_SUBCLASSES: dict[tuple[type, str], type] = {}


def fuse_projections(lm: nn.Module) -> int:
    """Fuse every supported attention and MLP block of ``lm`` in place; returns how many were fused."""
    fused = 0
    for module in lm.modules():
        kind = type(module).__name__
        if kind in _ATTENTION and _bias_free(module.q_proj, module.k_proj, module.v_proj):
            module.qkv_weight, module.qkv_sizes, module.qkv_order = _fuse_grouped_qkv(module)
            module.__class__ = _subclass(type(module), "attention")
            fused += 1
        elif kind in _MLP and _bias_free(module.gate_proj, module.up_proj):
            module.gate_up_weight, _ = _fuse(module.gate_proj, module.up_proj)
            module.__class__ = _subclass(type(module), "mlp")
            fused += 1
        elif kind in _NORM:
            module.__class__ = _subclass(type(module), "norm")
    return fused


def _bias_free(*linears: nn.Linear) -> bool:
    return all(isinstance(lin, nn.Linear) and lin.bias is None for lin in linears)


def _fuse(*linears: nn.Linear) -> tuple[torch.Tensor, list[int]]:
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    sizes, offset = [], 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[offset : offset + rows], requires_grad=False)
        sizes.append(rows)
        offset += rows
    return weight, sizes


def _fuse_grouped_qkv(attn: nn.Module) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The fused Q/K/V matrix in megatron's grouped row order, q/k/v's weights as views into it, and the
    gather that puts the fused projection's output columns back in q | k | v order."""
    q, k, v = attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach()
    head_dim = attn.head_dim
    groups = k.shape[0] // head_dim
    q_rows = q.shape[0] // groups  # one group's query rows
    hidden = q.shape[1]
    # the fused matrix is the base of every view cut from it (a view holds its base: one that
    # arena.relayout does not know, e.g. a 3-D intermediate, would keep the old storage alive)
    weight = torch.empty(groups * (q_rows + 2 * head_dim), hidden, dtype=q.dtype, device=q.device)
    grouped = weight.view(groups, -1, hidden)  # [groups, q_rows + 2 * head_dim, hidden]
    grouped[:, :q_rows] = q.view(groups, q_rows, hidden)
    grouped[:, q_rows : q_rows + head_dim] = k.view(groups, head_dim, hidden)
    grouped[:, q_rows + head_dim :] = v.view(groups, head_dim, hidden)
    attn.q_proj.weight = nn.Parameter(grouped[:, :q_rows], requires_grad=False)
    attn.k_proj.weight = nn.Parameter(grouped[:, q_rows : q_rows + head_dim], requires_grad=False)
    attn.v_proj.weight = nn.Parameter(grouped[:, q_rows + head_dim :], requires_grad=False)
    attn.register_state_dict_post_hook(_hf_shaped_state)
    attn.register_load_state_dict_pre_hook(_grouped_load)
    column = torch.arange(grouped.shape[0] * grouped.shape[1], device=q.device).view(groups, -1)
    order = torch.cat(
        [
            column[:, :q_rows].reshape(-1),
            column[:, q_rows : q_rows + head_dim].reshape(-1),
            column[:, q_rows + head_dim :].reshape(-1),
        ]
    )
    return weight, [q.shape[0], k.shape[0], v.shape[0]], order


_QKV = ("q_proj", "k_proj", "v_proj")


def _hf_shaped_state(module, state_dict, prefix, local_metadata) -> None:
    """``state_dict()`` gives q/k/v in Hugging Face's 2-D shape (a copy of the grouped rows)."""
    for part in _QKV:
        key = f"{prefix}{part}.weight"
        tensor = state_dict.get(key)
        if tensor is not None and tensor.dim() == 3:
            state_dict[key] = tensor.reshape(-1, tensor.shape[-1])


def _grouped_load(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` takes q/k/v in Hugging Face's 2-D shape into the grouped rows."""
    for part in _QKV:
        key = f"{prefix}{part}.weight"
        tensor = state_dict.get(key)
        weight = getattr(module, part).weight
        if tensor is not None and tensor.dim() == 2 and weight.dim() == 3:
            state_dict[key] = tensor.reshape(weight.shape)


def _subclass(cls: type, kind: str) -> type:
    key = (cls, kind)
    if key not in _SUBCLASSES:
        forward = {
            "attention": _fused_attention_forward,
            "mlp": _fused_mlp_forward,
            "norm": _rms_norm_forward,
        }[kind]
        _SUBCLASSES[key] = type(f"Fused{cls.__name__}", (cls,), {"forward": forward})
    return _SUBCLASSES[key]


def _rms_norm_forward(self, x):
    # transformers: normalise in fp32, cast back to the input dtype, then scale by the weight
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.variance_epsilon)
    if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
        return normed * self.weight
    return self.weight * normed.to(x.dtype)


def _fused_mlp_forward(self, x):
    gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _fused_attention_forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
    # the cache keyword is ``cache`` in newer transformers, ``past_key_values`` in older 5.x
    cache = kwargs.pop("cache", None)
    legacy = kwargs.pop("past_key_values", None)
    cache = legacy if cache is None else cache
    input_shape = hidden_states.shape[:-1]
    head_shape = (*input_shape, -1, self.head_dim)
    qkv = F.linear(hidden_states, self.qkv_weight).index_select(-1, self.qkv_order)
    q, k, v = qkv.split(self.qkv_sizes, dim=-1)
    query = self.q_norm(q.view(head_shape)).transpose(1, 2)
    key = self.k_norm(k.view(head_shape)).transpose(1, 2)
    value = v.view(head_shape).transpose(1, 2)
    cos, sin = position_embeddings
    rotate = sys.modules[type(self).__mro__[1].__module__].apply_rotary_pos_emb
    query, key = rotate(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    out, weights = paged_attention(self, query, key, value, attention_mask, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

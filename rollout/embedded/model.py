"""Build or load the embedded engine's model (transformers' classes) and load named tensors into it.

Weight updates arrive with Hugging Face *checkpoint* names (what SGLang's ``load_weights`` takes), e.g.
``model.layers.0.mlp.experts.3.gate_proj.weight``. transformers 5 keeps MoE experts fused
(``mlp.experts.gate_up_proj`` ``[E, 2*I, H]``, gate rows first, and ``mlp.experts.down_proj`` ``[E, H, I]``),
so per-expert names are mapped onto slices of those; fused names are accepted as they are.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tidal.model_config import ModelConfig
from tidal.rollout.embedded.fused import fuse_projections
from tidal.rollout.embedded.kv_cache import ATTENTION_NAME, register_attention
from tidal.weights_sync import grouped_qkv

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def build_model(model: ModelConfig, *, seed: int, device: str, dtype: str, fuse: bool = True):
    """The causal LM for ``model``: loaded from ``model.path`` if set, else randomly initialised with ``seed``.

    With ``fuse``, Q/K/V and gate/up projections run as one matmul each (see ``fused.py``).
    """
    from transformers import AutoModelForCausalLM

    check_servable(model)
    register_attention()
    torch_dtype = DTYPES[dtype]
    if model.path:
        path = Path(model.path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model.path={model.path}: no config.json there; give a Hugging Face model directory"
            )
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=ATTENTION_NAME)
    else:
        hf_config = model.to_hf_config()
        hf_config._attn_implementation = ATTENTION_NAME
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype)
    lm = lm.to(device).eval().requires_grad_(False)
    use_slot_state(lm)  # Qwen3.5's Gated DeltaNet layers keep their recurrent state per slot
    if fuse:
        fuse_projections(lm)  # after .to(): the fused matrices are plain tensors that .to() would not move
    return lm


class WeightLoadError(ValueError):
    pass


class NamedTensorLoader:
    """Copies tensors named by Hugging Face checkpoint names into a model's parameters and buffers."""

    def __init__(self, lm: torch.nn.Module):
        self.lm = lm
        self.targets: dict[str, torch.Tensor] = dict(lm.named_parameters(remove_duplicate=False))
        self.targets.update(dict(lm.named_buffers()))
        # attention blocks whose Q/K/V rows lie in megatron's grouped order (fused.py), by the name of
        # their fused QKV: megatron's fused matrix (grouped_qkv) is received into them in place
        self.grouped: dict[str, torch.nn.Module] = {
            f"{prefix}.qkv_proj.weight": module
            for prefix, module in lm.named_modules()
            if hasattr(module, "qkv_order")
        }
        # their q/k/v weights, views [groups, rows per group, hidden] of HF's [rows, hidden]
        self.grouped_parts = {part for name in self.grouped for part in grouped_qkv.parts(name)}
        # fused QKVs of other attention blocks, received whole, by name: their rows are copied into q/k/v after
        self.landings: dict[str, torch.Tensor] = {}

    def resolve(self, name: str) -> torch.Tensor:
        """The tensor (possibly a view into a fused parameter) that ``name`` writes to; for q/k/v of a grouped
        fused QKV a 3-D view (``hf_shape`` gives its Hugging Face shape)."""
        if name in self.targets:
            return self.targets[name]
        attn = self.grouped.get(name)
        if attn is not None:
            groups, hidden = attn.q_proj.weight.shape[0], attn.qkv_weight.shape[1]
            return attn.qkv_weight.view(groups, -1, attn.head_dim, hidden)
        m = _EXPERT.match(name)
        if m is not None:
            expert = int(m["expert"])
            if m["proj"] == "down_proj":
                fused = self.targets.get(f"{m['prefix']}.down_proj")
                if fused is not None and expert < fused.shape[0]:
                    return fused[expert]
            else:
                fused = self.targets.get(f"{m['prefix']}.gate_up_proj")
                if fused is not None and expert < fused.shape[0]:
                    half = fused.shape[1] // 2
                    return fused[expert, :half] if m["proj"] == "gate_proj" else fused[expert, half:]
        raise WeightLoadError(
            f"unknown parameter name {name!r}: the model has no such parameter "
            f"(expected Hugging Face names such as {next(iter(self.targets))!r})"
        )

    def hf_shape(self, name: str, target: torch.Tensor) -> tuple[int, ...]:
        """The shape that ``name`` has in a Hugging Face checkpoint, of its target ``target``."""
        if name in self.grouped_parts:
            groups, rows, hidden = target.shape
            return (groups * rows, hidden)
        return tuple(target.shape)

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` in its Hugging Face shape (a copy where the engine's layout differs)."""
        target = self.resolve(name)
        return target.reshape(self.hf_shape(name, target))

    def check(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Raise before anything is written if a name is unknown or a shape does not match."""
        for name, tensor in named:
            parts = grouped_qkv.parts(name)
            if parts is not None and name not in self.grouped:
                if len(tensor.shape) != 4:
                    raise WeightLoadError(
                        f"{name!r} is megatron's fused QKV, shaped [groups, q_heads + 2, head_dim, hidden]; "
                        f"received {list(tensor.shape)}"
                    )
                self.check(list(zip(parts, map(_Shaped, grouped_qkv.part_shapes(tensor.shape)), strict=True)))
                continue
            target = self.resolve(name)
            shape = self.hf_shape(name, target)
            if shape != tuple(tensor.shape):
                raise WeightLoadError(
                    f"shape mismatch for {name!r}: received {list(tensor.shape)}, the model has {list(shape)}"
                )

    def copies(self, name: str, tensor: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) pairs that load ``tensor`` under ``name`` (three for a fused QKV)."""
        parts = grouped_qkv.parts(name)
        if parts is None or name in self.grouped:
            target = self.resolve(name)
            if target.shape != tensor.shape:  # q/k/v into a grouped fused QKV: HF's rows, grouped
                tensor = tensor.reshape(target.shape)
            return [(target, tensor)]
        sources = grouped_qkv.split(tensor)
        return [(self.resolve(n).view(src.shape), src) for n, src in zip(parts, sources, strict=True)]

    def target(self, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Where ``name`` may be received in place: its weight (for a fused QKV, the grouped fused matrix),
        or for the fused QKV of other attention a landing tensor kept for it (``unscramble`` copies its rows
        into q/k/v once the bytes are in)."""
        if grouped_qkv.parts(name) is None or name in self.grouped:
            return self.resolve(name)
        kept = self.landings.get(name)
        if kept is None or list(kept.shape) != list(shape) or kept.dtype != dtype:
            device = self.resolve(grouped_qkv.parts(name)[0]).device
            kept = self.landings[name] = torch.empty(shape, dtype=dtype, device=device)
        return kept

    @torch.no_grad()
    def unscramble(self, names: list[str]) -> None:
        """Copy the rows of the fused QKVs landed under ``names`` into their q/k/v: one foreach copy for
        all of them (a bucket holds one per layer; per name, the launches and calls cost more than the
        bytes on a GPU)."""
        dsts, srcs = [], []
        for name in names:
            if name in self.grouped:  # received into the weights themselves
                continue
            for part, src in zip(
                grouped_qkv.parts(name), grouped_qkv.split(self.landings[name]), strict=True
            ):
                dsts.append(self.resolve(part).view(src.shape))
                srcs.append(src)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    @torch.no_grad()
    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.check(named)
        for name, tensor in named:
            for dst, src in self.copies(name, tensor):
                dst.copy_(src)


class _Shaped:
    def __init__(self, shape: list[int]):
        self.shape = shape


# ---------------------------------------------------------------- families with more than a KV cache

# families whose layers need state the engine's slot cache does not hold, and why
UNSERVED: dict[str, str] = {
    "glm_moe_dsa": (
        "the embedded engine cannot serve model.family=glm_moe_dsa: its DeepSeek sparse attention keeps an "
        "indexer key cache (transformers' cache.update_indexer) and masks attention to the indexer's top-k, "
        "which the engine's slot KV cache and paged attention do not do; serve it with SGLang "
        "(rollout.engine.type=sglang)"
    ),
    "deepseek_v4": (
        "the embedded engine cannot serve model.family=deepseek_v4 (hyper-connections, compressed sparse "
        "attention); serve it with SGLang (rollout.engine.type=sglang)"
    ),
}


def check_servable(model: ModelConfig) -> None:
    if model.family in UNSERVED:
        raise ValueError(UNSERVED[model.family])


class SlotStateGatedDeltaNet:
    """Qwen3.5's Gated DeltaNet with its recurrent state kept per engine slot.

    transformers' module reads its convolution and recurrent state from a ``DynamicCache``; the engine
    passes its slot KV cache (``StepCache``), which only stores keys and values. This forward keeps the
    module's weights and arithmetic (transformers' torch conv and gated delta rule, or fla's through
    transformers' kernel hooks) and stores the state in the engine's ``KVPool`` under the layer's index:
    the convolution window as ``keys[layer]`` ``[slots, conv_dim, 1, kernel - 1]`` and the recurrent state
    as ``values[layer]`` ``[slots, heads, 1, k_dim * v_dim]``. With the sequence axis of length 1, the pool's
    slot moves (``buf[dst, :, :n] = buf[src, :, :n]``) carry the whole state. A row whose cached length is 0
    starts from zero state (prefill).

    Mixed into the module's own class (:func:`use_slot_state`), so parameter names do not change; outside
    the engine (no ``tidal_step``) the module runs transformers' forward.
    """

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
        step = kwargs.get("tidal_step")
        store = (
            cache if cache is not None else kwargs.get("cache_params")
        )  # transformers < 5.2x: cache_params
        if step is None or not hasattr(store, "pool"):
            if cache is not None:
                kwargs["cache"] = cache
            return super().forward(hidden_states, attention_mask=attention_mask, **kwargs)
        cache = store
        gdn = self
        conv_buf, state_buf = self._slot_state(cache.pool, hidden_states)
        out = torch.zeros_like(hidden_states)
        for row, (slot, start, n) in enumerate(zip(step.slots, step.starts, step.new_lens, strict=True)):
            if start == 0:
                conv_buf[slot].zero_()
                state_buf[slot].zero_()
            out[row, :n] = self._run(gdn, hidden_states[row, :n], conv_buf, state_buf, slot)
        return out

    def _slot_state(self, pool, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gdn, layer = self, self.layer_idx
        conv = pool.keys[layer]
        if conv is None or conv.dtype != hidden_states.dtype:
            width = gdn.conv_kernel_size - 1
            pool.keys[layer] = torch.zeros(
                pool.num_slots, gdn.conv_dim, 1, width, dtype=hidden_states.dtype, device=pool.device
            )
            pool.values[layer] = torch.zeros(
                pool.num_slots,
                gdn.num_v_heads,
                1,
                gdn.head_k_dim * gdn.head_v_dim,
                dtype=torch.float32,
                device=pool.device,
            )
        return pool.keys[layer], pool.values[layer]

    @staticmethod
    def _run(gdn, x: torch.Tensor, conv_buf, state_buf, slot: int) -> torch.Tensor:
        """``x`` [n, hidden] of one row, continuing the slot's state; returns [n, hidden] and updates it."""
        import torch.nn.functional as F
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

        n = x.shape[0]
        mixed = gdn.in_proj_qkv(x).T  # [conv_dim, n]
        window = torch.cat([conv_buf[slot, :, 0], mixed], dim=1)  # [conv_dim, kernel - 1 + n]
        conv_buf[slot, :, 0] = window[:, -(gdn.conv_kernel_size - 1) :]
        weight = gdn.conv1d.weight  # [conv_dim, 1, kernel]
        mixed = F.silu(F.conv1d(window[None], weight, gdn.conv1d.bias, groups=gdn.conv_dim))[
            0
        ].T  # [n, conv_dim]
        query, key, value = torch.split(mixed, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        query = query.reshape(1, n, -1, gdn.head_k_dim)
        key = key.reshape(1, n, -1, gdn.head_k_dim)
        value = value.reshape(1, n, -1, gdn.head_v_dim)
        if gdn.num_v_heads != gdn.num_k_heads:  # each q/k head serves consecutive value heads
            query = query.repeat_interleave(gdn.num_v_heads // gdn.num_k_heads, dim=2)
            key = key.repeat_interleave(gdn.num_v_heads // gdn.num_k_heads, dim=2)
        beta = gdn.in_proj_b(x)[None].sigmoid()
        g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(x)[None].float() + gdn.dt_bias)
        state = state_buf[slot, :, 0].reshape(1, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
        rule = qwen.torch_recurrent_gated_delta_rule if n == 1 else qwen.torch_chunk_gated_delta_rule
        core, state = rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        state_buf[slot, :, 0] = state[0].reshape(gdn.num_v_heads, -1).float()
        z = gdn.in_proj_z(x).reshape(-1, gdn.head_v_dim)
        core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z).reshape(n, -1)
        return gdn.out_proj(core)


def use_slot_state(lm: torch.nn.Module) -> int:
    """Give every Qwen3.5 Gated DeltaNet of ``lm`` per-slot state (see :class:`SlotStateGatedDeltaNet`)."""
    swapped = 0
    for layer in getattr(getattr(lm, "model", None), "layers", []):
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None and type(gdn).__name__.endswith("GatedDeltaNet"):
            if not isinstance(gdn, SlotStateGatedDeltaNet):
                gdn.__class__ = type(
                    f"SlotState{type(gdn).__name__}", (SlotStateGatedDeltaNet, type(gdn)), {}
                )
            swapped += 1
    return swapped

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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def build_model(model: ModelConfig, *, seed: int, device: str, dtype: str, fuse: bool = True):
    """The causal LM for ``model``: loaded from ``model.path`` if set, else randomly initialised with ``seed``.

    With ``fuse``, Q/K/V and gate/up projections run as one matmul each (see ``fused.py``).
    """
    from transformers import AutoModelForCausalLM

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

    def resolve(self, name: str) -> torch.Tensor:
        """The tensor (possibly a view into a fused parameter) that ``name`` writes to."""
        if name in self.targets:
            return self.targets[name]
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

    def check(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Raise before anything is written if a name is unknown or a shape does not match."""
        for name, tensor in named:
            target = self.resolve(name)
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightLoadError(
                    f"shape mismatch for {name!r}: received {list(tensor.shape)}, the model has "
                    f"{list(target.shape)}"
                )

    @torch.no_grad()
    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.check(named)
        for name, tensor in named:
            self.resolve(name).copy_(tensor)

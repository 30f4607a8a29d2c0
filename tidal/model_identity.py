"""Which model a process holds, as the broker compares it: a fingerprint of the architecture.

The trainer registers with the identity of ``model.*`` (its config.json applied, ``model.path``), a rollout
node with that of the model its engines serve; the broker refuses a node whose fingerprint differs
(``broker/membership.py``). The fingerprint covers every field of the Hugging Face config tidal writes
for the architecture (``ModelConfig.to_hf_dict``), not the weights (the trainer's weight sync sets those)
nor the path (copies of one checkpoint match).
"""

from __future__ import annotations

import hashlib
import json

from tidal.model_config import ModelConfig


def model_identity(model: ModelConfig) -> dict[str, str]:
    """``{"fingerprint", "summary"}`` of ``model`` (resolved against its ``path``)."""
    resolved = model.resolved()
    hf = resolved.to_hf_dict()
    canonical = json.dumps(hf, sort_keys=True, separators=(",", ":"), default=str)
    fingerprint = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    summary = (
        f"{hf['model_type']} (vocab {resolved.vocab_size}, hidden {resolved.hidden_size}, "
        f"{resolved.num_hidden_layers} layers"
        + (f", {resolved.num_experts} experts" if resolved.is_moe else "")
        + ")"
        + (f" from {model.path}" if model.path else "")
    )
    return {"fingerprint": fingerprint, "summary": summary}

"""Models: the shared blocks here, each model family a package under `families/` (registered in
`internlm_offload.registry.MODELS` by `internlm_offload.model.families`).

The package's names load on first use, so importing a family's spec (plain data) imports no torch.
"""

import importlib
from typing import Any

_EXPORTS = {
    "Decoder": "internlm_offload.model.decoder",
    "DecoderLayer": "internlm_offload.model.decoder",
    "InternLM2": "internlm_offload.model.families.internlm2.model",
    "HFCausalLM": "internlm_offload.model.families.hf_causal_lm.model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

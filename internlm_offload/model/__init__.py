"""Models; importing this package registers them in `internlm_offload.registry.MODELS`."""

from internlm_offload.model.hf import HFCausalLM
from internlm_offload.model.internlm2 import DecoderLayer, InternLM2

__all__ = ["DecoderLayer", "HFCausalLM", "InternLM2"]

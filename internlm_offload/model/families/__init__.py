"""The built-in model families, one package each; importing this registers their specs (`family.FamilySpec`).

Each package's `__init__` is plain data (no torch): the config checks read its capabilities before the run
imports anything heavy. Where a new family goes: docs/architecture.md, "A new model family".
"""

from internlm_offload.model.families import deepseek_v3, gpt_oss, hf_causal_lm, internlm2, qwen3_next

__all__ = ["deepseek_v3", "gpt_oss", "hf_causal_lm", "internlm2", "qwen3_next"]

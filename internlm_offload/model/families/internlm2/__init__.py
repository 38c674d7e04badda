"""The native decoder family: InternLM2, and the models that are options of its blocks (Llama, InternLM v1,
Qwen2 / Qwen3 dense, Qwen2-MoE, Qwen3-MoE, Mixtral): RMSNorm, RoPE, grouped-query attention, SwiGLU or a mixture
of experts. Its parameters carry this trainer's names, so every parallel mode, tier and weights format applies.

Its Hugging Face side is in this package too: the name tables (`hf_names.py`), config.json read, checked and refused
(`hf_config.py`) and written (`hf_export.py`), each rule between them once (`hf_rules.py`).

`MODULE_NAMES` (the spec's `module_names`: PEFT's target names, Hugging Face's and the decoder's) is written out
rather than derived from `hf_names.HF_LLAMA`: a LoRA target is a linear module, where the table's rules are
parameters of every kind (norms, router, experts, biases) that a derivation would have to filter back to these
seven; and this module is the spec, read by the config checks before anything heavy is imported.
"""

from typing import Any

from internlm_offload.family import Capabilities, FamilySpec, register_family

# Hugging Face's (Llama's) projection names -> the decoder's modules (model/internlm2.py, model/mlp.py).
MODULE_NAMES = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
}


def check_section(model: Any) -> None:
    """Attention through sdpa or flash-attn (eager is transformers')."""
    if model.attn_impl == "eager":
        raise ValueError("model.attn_impl='eager' is for model.type='hf_causal_lm'; internlm2 has sdpa and flash")


FAMILY = register_family(
    FamilySpec(
        name="internlm2",
        entry="internlm_offload.model.families.internlm2.build",
        summary="the native decoder (InternLM2, Llama, InternLM, Qwen2/3, Qwen-MoE, Mixtral)",
        capabilities=Capabilities(
            native_experts=True,
            tensor_parallel=True,
            pipeline=True,
            init_per_param=True,
            one_block_copy=True,
            native_names=True,
            foreign_weights=True,
            config_vocab=True,
            lora=True,
        ),
        check_section=check_section,
        module_names=MODULE_NAMES,
    )
)

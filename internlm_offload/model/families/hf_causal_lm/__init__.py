"""Any Hugging Face causal LM through transformers (`model.hf_path` or `model.hf_config`), built in fp32 with its
own names and modules: data parallel (none, DDP, FSDP2), every optimizer tier, activation offload, LoRA."""

from typing import Any

from internlm_offload.family import Capabilities, FamilySpec, register_family


def check_section(model: Any) -> None:
    """A folder or a config, and no native-decoder key that means nothing to a transformers model."""
    if (model.hf_path is None) == (model.hf_config is None):
        raise ValueError("model.type='hf_causal_lm' needs exactly one of model.hf_path and model.hf_config")
    if model.attention_bias:
        raise ValueError("model.attention_bias is for model.type='internlm2'; an hf_causal_lm model has its own")


FAMILY = register_family(
    FamilySpec(
        name="hf_causal_lm",
        entry="internlm_offload.model.families.hf_causal_lm.build",
        summary="a transformers causal LM from a folder or a config (model.hf_path / model.hf_config)",
        capabilities=Capabilities(transformers_modules=True, lora=True),
        check_section=check_section,
    )
)

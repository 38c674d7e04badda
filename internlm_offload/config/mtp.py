"""The `model.mtp_config` section: multi-token prediction with XTuner's `MTPConfig` names, and its resolution.

The key is `mtp_config`, not `mtp`: InternEvo's `parallel.tensor.mode="mtp"` already means Megatron tensor parallel.
The section is resolved once, in the model section's checks (`resolve_mtp`): unset, it follows the model's own config
(a family's `FamilySpec.mtp_layers`: config.json's `num_nextn_predict_layers`, Qwen3-Next's `mtp_num_hidden_layers`)
as XTuner's GLM-5.2 `from_hf` does,
depth = that count with one physical block shared by every depth, the loss weighed by 0.1; the resolved values are what
the run, its checkpoints and its exports read.
"""

from typing import Any

from pydantic import Field

from internlm_offload.config.base import Section
from internlm_offload.family import capabilities, config_mtp_layers, families_with

# An unset section's loss weight (XTuner's `MTPConfig.loss_scaling_factor`; DeepSeek-V3's paper: 0.3, then 0.1).
DEFAULT_SCALING = 0.1


class MtpConfig(Section):
    num_layers: int | None = Field(
        None,
        ge=0,
        description="Prediction depths D: depth k (1..D) predicts the token k+1 ahead of each position. 0: off. "
        "Default: the model's config.json `num_nextn_predict_layers` (transformers' default where it leaves it out: "
        "1 for deepseek_v3 / kimi_k2 / glm4_moe, 0 for glm4_moe_lite); qwen3_next: `mtp_num_hidden_layers` (0 where "
        "it leaves it out).",
    )
    share_weights: bool = Field(
        False,
        description="One physical MTP block run at every depth (XTuner's `share_weights`; its GLM-5.2 recipe runs one "
        "block for 7 depths); False: one block per depth. With `model.mtp_config` unset: True.",
    )
    loss_scaling_factor: float = Field(
        DEFAULT_SCALING,
        ge=0,
        description="λ: the objective adds λ times the mean over depths of each depth's token-mean cross-entropy "
        "(logged as `mtp_loss`, λ included; `loss` stays the language-model loss).",
    )
    detach_mtp_inputs: bool = Field(
        False,
        description="Detach the main stack's hidden state and every depth's token embeddings fed to the MTP blocks: the "
        "MTP loss then trains the MTP blocks (and the head) alone (XTuner's; meant for RL).",
    )
    detach_mtp_lm_head_weight: bool = Field(
        False,
        description="The MTP logits through a detached head weight: the MTP loss does not train the shared head "
        "(XTuner's; meant for RL). Not under mtp / msp / fsp tensor parallel (the head is split there).",
    )


def resolve_mtp(model: Any) -> MtpConfig | None:
    """`model.mtp_config` resolved for the `model` section (a ModelConfig): explicit values everywhere for a family
    with multi-token prediction (None: its config's depth, shared weights, λ 0.1), None for the others; ValueError in
    one line for what cannot be built."""
    section: MtpConfig | None = model.mtp_config
    if not capabilities(model.type).multi_token_prediction:
        if section is not None and section.num_layers != 0:
            raise ValueError(
                f"model.mtp_config: multi-token prediction is built for model.type={families_with('multi_token_prediction')}, "
                f"not {model.type!r}; remove the key (or set num_layers=0)"
            )
        return None
    if section is None:
        depth = 0 if model.lora is not None else config_mtp_layers(model)
        return MtpConfig(num_layers=depth, share_weights=True)
    if section.num_layers is None:
        section = section.model_copy(update={"num_layers": config_mtp_layers(model)})
    if section.num_layers and model.lora is not None:
        raise ValueError(
            f"model.mtp_config.num_layers={section.num_layers} with model.lora: multi-token prediction is not built "
            "under LoRA (its checkpoint holds the adapters alone, PEFT's folder has no MTP block); set num_layers=0"
        )
    return section


def mtp_depth(model: Any) -> int:
    """The prediction depths of a resolved `model` section (0: off)."""
    return model.mtp_config.num_layers if model.mtp_config is not None else 0

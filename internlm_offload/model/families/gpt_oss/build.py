"""GPT-OSS from the `model` section: its config.json (a folder's, or `model.hf_config`), the model, the folder's
weights under the native names (MXFP4 experts dequantised), and the config.json of its `--hf` export; its balancing
loss (`model.balancing_loss` weighted by `loss.moe_loss_coeff`, else transformers' own weighted by
`router_aux_loss_coef` where config.json sets `output_router_logits`)."""

from typing import Any

import torch

from internlm_offload.config import ConfigError, ModelConfig, RunConfig
from internlm_offload.config.lora import native_targets
from internlm_offload.model.balancing import (
    chosen_loss,
    folder_coefficient,
    folder_loss_problem,
    loss_coefficients,
)
from internlm_offload.model.families.deepseek_v3.build import raw_config
from internlm_offload.model.families.gpt_oss.args import args_from_config
from internlm_offload.model.families.gpt_oss.hf_names import HF_GPT_OSS, read_experts, write_experts
from internlm_offload.model.families.gpt_oss.model import GptOss
from internlm_offload.model.families.gpt_oss.mxfp4 import piece_key
from internlm_offload.model.name_table import FolderFormat

CAUSAL_LM = "GptOssForCausalLM"


def transformers_config(cfg: ModelConfig) -> Any:
    """config.json (or `model.hf_config`) with transformers' defaults for the keys it leaves out; an MXFP4 folder's
    `quantization_config` dropped (its experts are dequantised on load)."""
    from transformers import AutoConfig

    raw = raw_config(cfg)
    raw.pop("quantization_config", None)
    return AutoConfig.for_model(**raw)


def build_model(cfg: ModelConfig, device: torch.device) -> GptOss:
    """The model in fp32 on `device`, every weight drawn from the seed; a folder's weights are read over them by the
    builder (`folder_format`)."""
    try:
        args = args_from_config(transformers_config(cfg))
        with torch.device(device):
            return GptOss(
                args, attn_impl=cfg.attn_impl, balancing_loss=chosen_loss(cfg.balancing_loss, args.router_aux_coef)
            )
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model.type='gpt_oss': {' '.join(str(exc).split())}") from None


def folder_format(model: GptOss) -> FolderFormat:
    """transformers' names, the experts re-laid-out (and MXFP4 dequantised) on the way in and out."""
    args = model.args
    return FolderFormat(
        HF_GPT_OSS,
        args.num_attention_heads,
        args.num_key_value_heads,
        args.num_layers,
        read_transform=read_experts,
        write_transform=write_experts,
        piece_key=piece_key,
    )


def folder_config(cfg: ModelConfig) -> Any:
    """The config.json of its `--hf` export: the one the model was built by, without quantisation (the experts are
    written as floats)."""
    config = transformers_config(cfg)
    config.architectures = [CAUSAL_LM]
    return config


def lora_targets(cfg: ModelConfig) -> list[str]:
    """`model.lora.target_modules` as the model names the attention's projections (transformers' names translated)."""
    assert cfg.lora is not None
    return native_targets(cfg.lora, cfg.type)


def check_run(cfg: RunConfig) -> None:
    """transformers' own balancing loss (config.json's `output_router_logits`) is refused under a pipeline in one line
    (it pools every sparse block's statistics); `model.balancing_loss` is refused there by the config's checks."""
    try:
        config = transformers_config(cfg.model)
    except ValueError:  # a missing or unreadable folder: the build names it in one line
        return
    problem = folder_loss_problem(cfg.model.balancing_loss, folder_coefficient(config), cfg.parallel.pipeline.size)
    if problem:
        raise ConfigError(problem)


def aux_loss_coefficients(cfg: RunConfig, model: GptOss) -> dict[str, float]:
    """`moe_aux`: `loss.moe_loss_coeff` for `model.balancing_loss`, the config's `router_aux_loss_coef` for
    transformers' own loss; none without a loss."""
    return loss_coefficients(cfg.model.balancing_loss, cfg.loss.moe_loss_coeff, model.args.router_aux_coef)

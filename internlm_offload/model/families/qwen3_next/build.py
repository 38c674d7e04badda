"""Qwen3-Next from the `model` section: its config.json (a folder's, or `model.hf_config`; a Qwen3.5 vision-language
folder's text model), the model (with multi-token prediction as `model.mtp_config` resolved it: the DeepSeek-V3
family's `mtp_settings`), the folder's weights under the native names (its `mtp.*` included), and the config.json of
its `--hf` export; its balancing loss (`model.balancing_loss` weighted by `loss.moe_loss_coeff`, else transformers'
own weighted by `router_aux_loss_coef` where config.json sets `output_router_logits`)."""

import json
from pathlib import Path
from typing import Any

import torch

from internlm_offload.config import ConfigError, ModelConfig, RunConfig
from internlm_offload.model.balancing import (
    chosen_loss,
    folder_coefficient,
    folder_loss_problem,
    loss_coefficients,
)
from internlm_offload.model.families.deepseek_v3.build import check_detached_head, mtp_settings, raw_config
from internlm_offload.model.families.qwen3_next import CAUSAL_LMS, MTP_LAYERS_KEY, VISION_LANGUAGE, text_config
from internlm_offload.model.families.qwen3_next.args import args_from_config
from internlm_offload.model.families.qwen3_next.folder_layout import (
    VISION_PREFIX,
    SourceConfig,
    SourceLayout,
    from_folder,
    read_layout,
)
from internlm_offload.model.families.qwen3_next.hf_names import HF_QWEN3_NEXT, HF_QWEN3_NEXT_MTP, mtp_in, mtp_out
from internlm_offload.model.families.qwen3_next.model import Qwen3Next
from internlm_offload.model.name_table import FolderFormat


def transformers_config(cfg: ModelConfig) -> Any:
    """The text model's config: config.json (or `model.hf_config`; a vision-language folder's `text_config`) with
    transformers' defaults for the keys it leaves out."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**text_config(raw_config(cfg)))


def source_layout(cfg: ModelConfig) -> SourceLayout:
    """How `model.hf_path` lays out the text model (folder_layout.py): the one an export writes back."""
    if cfg.hf_path is None:
        return SourceLayout()
    return read_layout(cfg.hf_path, vision_language=raw_config(cfg).get("model_type") in VISION_LANGUAGE)


def build_model(cfg: ModelConfig, device: torch.device) -> Qwen3Next:
    """The model in fp32 on `device`, every weight drawn from the seed; a folder's weights are read over them by the
    builder (`folder_format`)."""
    try:
        config = transformers_config(cfg)
        args = args_from_config(config)
        mtp = mtp_settings(cfg)
        if mtp is not None and getattr(config, "mtp_use_dedicated_embeddings", False):
            raise ValueError("mtp_use_dedicated_embeddings=True: MTP reads the shared embedding here (not built)")
        with torch.device(device):
            model = Qwen3Next(
                args,
                attn_impl=cfg.attn_impl,
                balancing_loss=chosen_loss(cfg.balancing_loss, args.router_aux_coef),
                mtp=mtp,
            )
        model.source_layout = source_layout(cfg)
        return model
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model.type='qwen3_next': {' '.join(str(exc).split())}") from None


def folder_format(model: Qwen3Next) -> FolderFormat:
    """transformers' names (the experts stacked from one tensor each) in the folder's layout (`model.source_layout`:
    a vision-language folder's `model.language_model.` prefix, fused experts), its vision tower not read and copied
    through on export; the folder's `mtp.*` tensors read as the MTP layer the model builds (renamed blocks past the
    stack on the way in, back on the way out: `mtp_in` / `mtp_out`), left out in one line where it builds none."""
    args, layout = model.args, model.source_layout
    return FolderFormat(
        HF_QWEN3_NEXT,
        args.num_attention_heads,
        args.num_key_value_heads,
        args.num_layers,
        mtp_layers=model.mtp.settings.physical if model.mtp is not None else 0,
        mtp_table=HF_QWEN3_NEXT_MTP,
        read_transform=lambda tensors: mtp_in(from_folder(tensors), num_layers=args.num_layers),
        write_transform=lambda tensors: layout.to_folder(mtp_out(tensors, num_layers=args.num_layers)),
        copied_through=(VISION_PREFIX,) if layout.vision_language else (),
        copied_what=f"the vision tower ({VISION_PREFIX}*)",
    )


def folder_config(cfg: ModelConfig) -> Any:
    """The config.json of its `--hf` export: the one the model was built by, its causal LM class named; a
    vision-language folder's config.json as it was (`SourceConfig`: its class and vision tower's config)."""
    if raw_config(cfg).get("model_type") in VISION_LANGUAGE:
        return SourceConfig(json.loads(Path(cfg.hf_path, "config.json").read_text()))
    config = transformers_config(cfg)
    config.architectures = [CAUSAL_LMS[config.model_type]]
    settings = mtp_settings(cfg)
    physical = settings.physical if settings is not None else 0
    if getattr(config, MTP_LAYERS_KEY, 0) != physical:  # the MTP layers the folder holds
        setattr(config, MTP_LAYERS_KEY, physical)
    return config


def check_run(cfg: RunConfig) -> None:
    """What is not built for Qwen3-Next, refused in one line: a tensor or isp group that does not divide the
    DeltaNet's key heads (each rank runs whole key-head groups); a pipeline with the embedding tied to the head;
    more than one physical MTP layer (the folder holds one `mtp.fc` and one set of its norms); the MTP head's detached
    weight under a tensor mode that splits the head; a balancing loss of a model without experts (`qwen3_5_text`), or
    transformers' own (config.json's `output_router_logits`) under a pipeline (`model.balancing_loss` is refused
    there by the config's checks). LoRA is refused by the family's capabilities."""
    config = transformers_config(cfg.model)
    check_balancing(cfg, config)
    check_detached_head(cfg)
    mtp = mtp_settings(cfg.model)
    if mtp is not None and mtp.physical > 1:
        raise ConfigError(
            f"model.mtp_config.num_layers={mtp.depth} with share_weights=False: {mtp.physical} MTP layers, but a "
            "Qwen3-Next folder holds one mtp.fc and one set of its norms; set share_weights=True (one layer at every "
            "depth) or num_layers=1"
        )
    tensor = cfg.parallel.tensor
    if tensor.size > 1:
        where = f"parallel.tensor.size={tensor.size} (mode {tensor.mode!r})"
        if config.linear_num_key_heads % tensor.size:
            raise ConfigError(
                f"{where}: the Gated DeltaNet's linear_num_key_heads={config.linear_num_key_heads} must be a multiple "
                "of it (each rank runs whole key-head groups)"
            )
    pipe = cfg.parallel.pipeline.size
    if pipe > 1 and config.tie_word_embeddings:
        raise ConfigError(
            f"parallel.pipeline.size={pipe} with the config's tie_word_embeddings=True: the embedding and the head "
            "sit on different stages; not built"
        )


def check_balancing(cfg: RunConfig, config: Any) -> None:
    """`model.balancing_loss` needs experts; transformers' own loss, which pools every sparse block's statistics
    before its product, does not split over pipeline stages."""
    kind = cfg.model.balancing_loss
    if kind is not None and not getattr(config, "num_experts", 0):
        raise ConfigError(
            f"model.balancing_loss={kind!r}: model_type={config.model_type!r} has no experts (a dense model); set None"
        )
    problem = folder_loss_problem(kind, folder_coefficient(config), cfg.parallel.pipeline.size)
    if problem:
        raise ConfigError(problem)


def aux_loss_coefficients(cfg: RunConfig, model: Qwen3Next) -> dict[str, float]:
    """`moe_aux`: `loss.moe_loss_coeff` for `model.balancing_loss`, the config's `router_aux_loss_coef` for
    transformers' own loss; none without a loss."""
    return loss_coefficients(cfg.model.balancing_loss, cfg.loss.moe_loss_coeff, model.args.router_aux_coef)

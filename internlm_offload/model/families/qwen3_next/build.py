"""Qwen3-Next from the `model` section: its config.json (a folder's, or `model.hf_config`), the model, the folder's
weights under the native names, and the config.json of its `--hf` export."""

from typing import Any

import torch

from internlm_offload.config import ConfigError, ModelConfig, RunConfig
from internlm_offload.model.families.deepseek_v3.build import raw_config
from internlm_offload.model.families.qwen3_next import CAUSAL_LMS
from internlm_offload.model.families.qwen3_next.args import args_from_config
from internlm_offload.model.families.qwen3_next.hf_names import HF_QWEN3_NEXT, drop_mtp
from internlm_offload.model.families.qwen3_next.model import Qwen3Next
from internlm_offload.model.name_table import FolderFormat


def transformers_config(cfg: ModelConfig) -> Any:
    """config.json (or `model.hf_config`) with transformers' defaults for the keys it leaves out."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**raw_config(cfg))


def build_model(cfg: ModelConfig, device: torch.device) -> Qwen3Next:
    """The model in fp32 on `device`, every weight drawn from the seed; a folder's weights are read over them by the
    builder (`folder_format`)."""
    try:
        args = args_from_config(transformers_config(cfg))
        with torch.device(device):
            return Qwen3Next(args, attn_impl=cfg.attn_impl)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model.type='qwen3_next': {' '.join(str(exc).split())}") from None


def folder_format(model: Qwen3Next) -> FolderFormat:
    """transformers' names (the experts stacked from one tensor each); the folder's `mtp.*` tensors dropped on the
    way in (`drop_mtp`)."""
    args = model.args
    return FolderFormat(
        HF_QWEN3_NEXT, args.num_attention_heads, args.num_key_value_heads, args.num_layers, read_transform=drop_mtp
    )


def folder_config(cfg: ModelConfig) -> Any:
    """The config.json of its `--hf` export: the one the model was built by, its causal LM class named."""
    config = transformers_config(cfg)
    config.architectures = [CAUSAL_LMS[config.model_type]]
    return config


def check_run(cfg: RunConfig) -> None:
    """What is not built for Qwen3-Next, refused in one line: LoRA; a tensor or isp group that does not divide the
    DeltaNet's key heads (each rank runs whole key-head groups); a pipeline with the embedding tied to the head. A
    balancing loss and multi-token prediction are refused by the family's capabilities (the config's checks)."""
    if cfg.model.lora is not None:
        raise ConfigError("model.lora with model.type='qwen3_next': adapters on Gated DeltaNet are not built")
    config = transformers_config(cfg.model)
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


def aux_loss_coefficients(cfg: RunConfig, model: Qwen3Next) -> dict[str, float]:
    """None: the model returns no auxiliary loss."""
    return {}


def lora_targets(cfg: ModelConfig) -> list[str]:
    """Never reached: `check_run` refuses model.lora."""
    raise ConfigError("model.lora with model.type='qwen3_next': not built")

"""The DeepSeek-V3 lineage from the `model` section: its config.json (a folder's, or `model.hf_config`), the
model (with multi-token prediction as `model.mtp_config` resolved it), the folder's weights under the native names
(its MTP blocks included); the router bias balances it, a balancing loss beside it is an option
(`model.balancing_loss`, weighted by `loss.moe_loss_coeff`)."""

import os
from typing import Any

import torch

from internlm_offload.config import ConfigError, ModelConfig, RunConfig
from internlm_offload.config.lora import resolved_targets
from internlm_offload.config.mtp import mtp_depth
from internlm_offload.config.pipeline import virtual_chunks
from internlm_offload.config.pipeline_partition import partition_uniform
from internlm_offload.log import get_logger
from internlm_offload.model.families.deepseek_v3 import DSA_TYPES
from internlm_offload.model.families.deepseek_v3.args import args_from_config
from internlm_offload.model.families.deepseek_v3.hf_names import (
    CAUSAL_LM,
    HF_DSA_MOE,
    HF_GQA_MOE,
    HF_MLA_MOE,
    KEEP_FP32,
    KEEP_FP32_DSA,
    MTP_COPIES,
    mtp_table,
)
from internlm_offload.model.families.deepseek_v3.model import DeepseekV3
from internlm_offload.model.mtp import MtpSettings
from internlm_offload.model.name_table import FolderFormat
from internlm_offload.model.output import MOE_AUX

logger = get_logger(__name__)


def raw_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's keys as written (a folder's, or `model.hf_config`); ValueError in one line naming a folder that
    is missing or whose config.json cannot be read."""
    from transformers import PretrainedConfig

    if not cfg.hf_path:
        return dict(cfg.hf_config)
    if not os.path.isdir(cfg.hf_path):  # transformers would take it for a Hub repo id and raise its own error
        raise ValueError(f"model.hf_path={cfg.hf_path!r} is not a local directory (nothing is downloaded)")
    if not os.path.isfile(os.path.join(cfg.hf_path, "config.json")):  # transformers reads a missing one as {}
        raise ValueError(f"model.hf_path={cfg.hf_path!r}: the folder has no config.json (a Hugging Face model folder)")
    try:
        return PretrainedConfig.get_config_dict(cfg.hf_path, local_files_only=True)[0]
    except (OSError, ValueError) as exc:
        raise ValueError(f"model.hf_path={cfg.hf_path!r}: no readable config.json in the folder ({exc})") from None


def transformers_config(cfg: ModelConfig) -> Any:
    """config.json (or `model.hf_config`) with transformers' defaults for the keys it leaves out. Kimi-K2's
    `kimi_k2`, which transformers does not register, is DeepSeek-V3's architecture: read as `deepseek_v3`."""
    from transformers import AutoConfig

    raw = raw_config(cfg)
    if raw.get("model_type") == "kimi_k2":
        raw["model_type"] = "deepseek_v3"
    return AutoConfig.for_model(**raw)


def mtp_settings(cfg: ModelConfig) -> MtpSettings | None:
    """Multi-token prediction as the resolved `model.mtp_config` asks (None: off)."""
    if not mtp_depth(cfg):
        return None
    section = cfg.mtp_config
    return MtpSettings(
        depth=section.num_layers,
        share_weights=section.share_weights,
        detach_inputs=section.detach_mtp_inputs,
        detach_head_weight=section.detach_mtp_lm_head_weight,
    )


def build_model(cfg: ModelConfig, device: torch.device) -> DeepseekV3:
    """The model in fp32 on `device`, every weight drawn from the seed; a folder's weights are read over them by the
    builder (`folder_format`)."""
    try:
        args = args_from_config(transformers_config(cfg))
        with torch.device(device):
            return DeepseekV3(args, attn_impl=cfg.attn_impl, mtp=mtp_settings(cfg), balancing_loss=cfg.balancing_loss)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model.type='deepseek_v3': {' '.join(str(exc).split())}") from None


def folder_format(model: DeepseekV3) -> FolderFormat:
    """How `model.hf_path`'s tensors are named: transformers' names of MLA or of GLM-4.5's attention (the router's
    weight and bias kept in fp32 on the way out, as transformers keeps them); the multi-token-prediction layers the
    model builds at blocks L + k, as DeepSeek-V3's files and XTuner's exports hold them."""
    args = model.args
    table = (HF_DSA_MOE if args.dsa else HF_MLA_MOE) if args.mla else HF_GQA_MOE
    return FolderFormat(
        table,
        args.num_attention_heads,
        args.num_key_value_heads,
        args.num_layers,
        keep_fp32=KEEP_FP32_DSA if args.dsa else KEEP_FP32,
        mtp_layers=model.mtp.settings.physical if model.mtp is not None else 0,
        mtp_table=mtp_table(table),
        mtp_copies=MTP_COPIES,
    )


def folder_config(cfg: ModelConfig) -> Any:
    """The config.json of its `--hf` export: the one the model was built by, its causal LM class named.

    Kimi-K2's is written as `deepseek_v3`, the architecture it is read as: transformers registers no `kimi_k2`, so
    an export that kept it would load only with Moonshot's remote code, which is not copied (nor is any `auto_map`
    kept, whose files the export lacks); the tensors' names are the same either way.
    """
    config = transformers_config(cfg)
    written = raw_config(cfg).get("model_type")
    if written != config.model_type:
        logger.warning(
            "config.json: model_type %r is written as %r (its architecture; transformers loads that without "
            "remote code)",
            written,
            config.model_type,
        )
    if hasattr(config, "auto_map"):
        delattr(config, "auto_map")
    config.architectures = [CAUSAL_LM[config.model_type]]
    settings = mtp_settings(cfg)
    physical = settings.physical if settings is not None else 0
    if getattr(config, "num_nextn_predict_layers", 0) != physical:  # the MTP blocks the folder holds
        config.num_nextn_predict_layers = physical
    return config


def check_run(cfg: RunConfig) -> None:
    """A pipeline puts the embedding on the first stage and the head on the last: a config that ties them (the
    section's `model.tie_word_embeddings`, which config/pipeline.py checks, does not apply here) is refused.
    `model.mtp_config.detach_mtp_lm_head_weight` needs the head whole on this rank: not under mtp / msp / fsp
    (which split it by the vocabulary)."""
    check_sparse_attention(cfg)
    pipe = cfg.parallel.pipeline.size
    if pipe > 1 and transformers_config(cfg.model).tie_word_embeddings:
        raise ConfigError(
            f"parallel.pipeline.size={pipe} with the config's tie_word_embeddings=True: the embedding and the head "
            "sit on different stages; not built"
        )
    check_detached_head(cfg)


def check_detached_head(cfg: RunConfig) -> None:
    """`model.mtp_config.detach_mtp_lm_head_weight` needs the head whole on this rank: not under mtp / msp / fsp."""
    tensor = cfg.parallel.tensor
    mtp = cfg.model.mtp_config
    if (
        mtp is not None
        and mtp.num_layers
        and mtp.detach_mtp_lm_head_weight
        and tensor.size > 1
        and tensor.mode != "isp"
    ):
        raise ConfigError(
            f"model.mtp_config.detach_mtp_lm_head_weight=True with parallel.tensor.mode={tensor.mode!r}: the head is "
            "split over the tensor ranks there; use isp, or detach_mtp_lm_head_weight=False"
        )


def check_sparse_attention(cfg: RunConfig) -> None:
    """DeepSeek Sparse Attention splits by every tensor mode (model/dsa.py: the indexer whole on each rank, over the
    whole sequence its attention's input already is, gathered under msp / fsp, gathered for it under isp) and by a
    pipeline whose every stage holds the full block each of its shared blocks takes the top-k of: a shared block whose
    source sits on an earlier stage is refused in one line (the top-k is not sent between stages)."""
    try:
        raw = raw_config(cfg.model)
    except ValueError:  # a missing or unreadable folder: the build names it in one line (model.type=...: ...)
        return
    pipe = cfg.parallel.pipeline
    if raw.get("model_type") not in DSA_TYPES or pipe.size == 1:
        return
    try:
        sources = args_from_config(transformers_config(cfg.model)).indexer_sources
    except (ValueError, TypeError, KeyError):  # a bad config: the build names it in one line
        return
    chunks = virtual_chunks(pipe.mode, cfg.model.num_chunks)
    try:
        ranges = partition_uniform(len(sources), pipe.size, chunks)
    except ValueError:  # a split the pipeline's own check refuses
        return
    for stage, (start, end) in enumerate(ranges):
        if sources[start] < start:
            raise ConfigError(
                f"parallel.pipeline.size={pipe.size}: stage {stage} begins at block {start}, which shares the top-k "
                f"of block {sources[start]} on an earlier stage (model.hf_config's indexer_types); DeepSeek sparse "
                "attention sends no top-k between stages: choose a size (or model.num_chunks) whose every stage "
                "begins at a 'full' block"
            )


def aux_loss_coefficients(cfg: RunConfig, model: DeepseekV3) -> dict[str, float]:
    """`moe_aux` (`model.balancing_loss`) weighs `loss.moe_loss_coeff` (InternEvo's key); none without one."""
    return {} if cfg.model.balancing_loss is None else {MOE_AUX: cfg.loss.moe_loss_coeff}


def lora_targets(cfg: ModelConfig) -> list[str]:
    """`model.lora.target_modules` as the model names its linears (MLA's are transformers' own)."""
    assert cfg.lora is not None
    return resolved_targets(cfg.lora)

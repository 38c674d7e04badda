"""A transformers causal LM from the `model` section: its arguments and errors, its losses' weights, LoRA targets."""

import torch

from internlm_offload.config import ConfigError, ModelConfig, RunConfig
from internlm_offload.config.lora import resolved_targets
from internlm_offload.model.families.hf_causal_lm.model import HFCausalLM, read_text_config, stateful_layers


def build_model(cfg: ModelConfig, device: torch.device) -> HFCausalLM:
    """The wrapped model in fp32 on `device`: a folder's weights, or a config's seeded init. A meta build (the
    planner's trace) has nowhere to read a folder's weights into: its config builds the modules."""
    with torch.device(device):
        try:
            return HFCausalLM(
                path=cfg.hf_path,
                config=cfg.hf_config,
                trust_remote_code=cfg.trust_remote_code,
                attn_impl=cfg.attn_impl,
                read_weights=device.type != "meta",
            )
        except ValueError as exc:  # the wrapper names its argument (model.<name>) and the fix
            raise ConfigError(config_message(str(exc))) from None


def config_message(error: str) -> str:
    """The wrapper's error as one line about a `model.*` key."""
    message = " ".join(error.split())
    if message.startswith(("hf_path", "hf_config", "attn_impl")):
        return f"model.{message}"  # the wrapper's messages start with its argument: a model.* key
    if not message.startswith("model."):
        return f"model.type='hf_causal_lm': {message}"
    return message


def folder_format(model: HFCausalLM) -> None:
    """None: transformers reads model.hf_path itself."""
    return None


def check_run(cfg: RunConfig) -> None:
    """Refuse rows of several documents kept apart by position ids for an `hf_causal_lm` model with layers that carry
    a state along the row (Gated DeltaNet, Mamba): they read no position ids, and transformers' torch path takes no
    document boundaries (`cu_seqlens`/`seq_idx` raise there without flash-linear-attention / causal-conv1d), so one
    document's state would run into the next."""
    data = cfg.data
    if not data.keeps_documents_apart:
        return
    model = cfg.model
    try:
        text = read_text_config(model.hf_path, model.hf_config, model.trust_remote_code)
    except ValueError:
        return  # build_model reports a bad folder or config in its own words
    layers = stateful_layers(text)
    if layers:
        kinds = sorted({text.layer_types[i] for i in layers})
        raise ConfigError(
            f"data.pack_sample_into_one=False (data.type={data.type!r}) packs several documents into a row kept "
            f"apart by position ids, which {text.model_type}'s {'/'.join(kinds)} layers {layers} do not read: each "
            "document's state would run into the next; set data.pack_sample_into_one=True (documents packed into "
            "rows of data.seq_len, attention across them too)"
        )


def aux_loss_coefficients(cfg: RunConfig, model: HFCausalLM) -> dict[str, float]:
    """What the model's own config says (`router_aux_loss_coef`, read by the wrapper)."""
    return dict(model.aux_loss_coefficients)


def lora_targets(cfg: ModelConfig) -> list[str]:
    """`model.lora.target_modules` as given (the model's own module names), or PEFT's default."""
    assert cfg.lora is not None
    return resolved_targets(cfg.lora)

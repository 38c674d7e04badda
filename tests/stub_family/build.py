"""The stub family's builder: a Llama folder's config.json as the decoder's arguments, its weights loaded."""

from pathlib import Path

import torch

from internlm_offload.config import ConfigError, ModelConfig, RunConfig
from internlm_offload.config.lora import resolved_targets
from internlm_offload.model.families.internlm2.model import InternLM2
from internlm_offload.weights.convert import Heads, to_native
from internlm_offload.weights.hf_folder import name_table, native_model_values, read_config, read_weights, weight_files


class StubLlama(InternLM2):
    """The dense decoder under the stub family's name."""


def build_model(cfg: ModelConfig, device: torch.device) -> StubLlama:
    """The folder's model in fp32 on `device`; on meta (the planner's trace) its modules alone."""
    if cfg.hf_path is None:
        raise ConfigError("model.type='stub_llama' needs model.hf_path: a Hugging Face Llama folder")
    folder = Path(cfg.hf_path)
    hf = read_config(folder)
    values = native_model_values(hf)
    if values is None or values["tie_word_embeddings"]:
        raise ConfigError(f"model.hf_path={cfg.hf_path!r}: the stub family reads untied Llama folders")
    with torch.device(device):
        model = StubLlama(**values, attn_impl=cfg.attn_impl)
    if device.type != "meta":
        heads = Heads(values["num_attention_heads"], values["num_kv_attention_heads"])
        foreign = read_weights(weight_files(folder))
        model.load_state_dict(to_native(foreign, name_table(folder, hf), heads, str(folder)))
    return model


def check_run(cfg: RunConfig) -> None:
    """Nothing beyond the schema's checks."""


def aux_loss_coefficients(cfg: RunConfig, model: StubLlama) -> dict[str, float]:
    return {}


def lora_targets(cfg: ModelConfig) -> list[str]:
    assert cfg.lora is not None
    return resolved_targets(cfg.lora)

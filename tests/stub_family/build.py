"""The stub family's builder: a Llama folder's config.json as the decoder's arguments; the builder reads the
folder's weights by `folder_format` (Llama's names)."""

import json
from pathlib import Path

import torch

from internlm_offload.config import ConfigError, ModelConfig
from internlm_offload.model.families.internlm2.hf_config import native_model_values
from internlm_offload.model.families.internlm2.hf_names import HF_LLAMA
from internlm_offload.model.families.internlm2.model import InternLM2
from internlm_offload.model.name_table import FolderFormat


class StubLlama(InternLM2):
    """The dense decoder under the stub family's name."""


def build_model(cfg: ModelConfig, device: torch.device) -> StubLlama:
    """The folder's model in fp32 on `device`, weights drawn from the seed (the builder reads the folder's over them)."""
    if cfg.hf_path is None:
        raise ConfigError("model.type='stub_llama' needs model.hf_path: a Hugging Face Llama folder")
    values = native_model_values(json.loads((Path(cfg.hf_path) / "config.json").read_text()))
    if values is None or values["tie_word_embeddings"]:
        raise ConfigError(f"model.hf_path={cfg.hf_path!r}: the stub family reads untied Llama folders")
    with torch.device(device):
        return StubLlama(**values, attn_impl=cfg.attn_impl)


def folder_format(model: StubLlama) -> FolderFormat:
    args = model.args
    return FolderFormat(HF_LLAMA, args.num_attention_heads, args.num_kv_attention_heads, args.num_layers)

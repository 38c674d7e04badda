"""GPT-OSS's architecture off a transformers GptOssConfig (config.json with transformers' defaults)."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from internlm_offload.model.balancing import folder_coefficient
from internlm_offload.model.families.gpt_oss import MODEL_TYPE

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' names of the layer types


@dataclass(frozen=True)
class GptOssArgs:
    """One GPT-OSS model (transformers' key names; `num_layers` is `num_hidden_layers`)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # each expert's
    num_local_experts: int
    num_experts_per_tok: int
    # transformers' balancing-loss weight where the config trains with it (`output_router_logits`), else None
    router_aux_coef: float | None
    sliding_window: int
    layer_types: tuple[str, ...]
    swiglu_alpha: float
    swiglu_limit: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope_parameters: Mapping[str, Any]
    max_position_embeddings: int
    initializer_range: float

    def window(self, i: int) -> int | None:
        """Block i's sliding window (None: full attention)."""
        return self.sliding_window if self.layer_types[i] == SLIDING else None


def args_from_config(config: Any) -> GptOssArgs:
    """The args of a transformers GptOssConfig; ValueError for a layer type that is neither kind."""
    if config.model_type != MODEL_TYPE:
        raise ValueError(f"model_type={config.model_type!r}: the gpt_oss family builds {MODEL_TYPE!r}")
    types = tuple(config.layer_types)
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown or len(types) != config.num_hidden_layers:
        raise ValueError(
            f"layer_types={list(types)}: one of {SLIDING!r} / {FULL!r} per layer ({config.num_hidden_layers} layers)"
        )
    return GptOssArgs(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        num_local_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        router_aux_coef=folder_coefficient(config),
        sliding_window=config.sliding_window,
        layer_types=types,
        swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
    )

"""The DeepSeek-V3 lineage's architecture off a transformers config (config.json with transformers' defaults),
every derived value resolved once: MLA or grouped-query attention, the dense-first blocks, the router, RoPE."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from internlm_offload.model.dsa import FULL, indexer_sources
from internlm_offload.model.families.deepseek_v3 import DSA_TYPES, MODEL_TYPES


@dataclass(frozen=True)
class DeepseekV3Args:
    """One model of the lineage (transformers' key names; `num_layers` is `num_hidden_layers`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int  # the dense blocks' SwiGLU
    moe_intermediate_size: int  # each routed expert's (and times n_shared_experts, the shared expert's)
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    dense_layers: tuple[int, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope_parameters: Mapping[str, Any]
    max_position_embeddings: int
    initializer_range: float
    # multi-head latent attention (deepseek_v3, glm4_moe_lite); kv_lora_rank None: grouped-query attention
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # grouped-query attention (glm4_moe)
    head_dim: int = 0
    use_qk_norm: bool = False
    # DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa); index_topk None: dense MLA
    index_topk: int | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_types: tuple[str, ...] = ()  # per block "full" (its own indexer) or "shared" (the last full one's top-k)
    indexer_rope_interleave: bool = True  # GLM-5's indexer RoPE; DeepSeek-V3.2's is half-split

    @property
    def dsa(self) -> bool:
        return self.index_topk is not None

    @property
    def indexer_sources(self) -> tuple[int, ...]:
        """Each block's source of top-k (model/dsa.py `indexer_sources`)."""
        return indexer_sources(self.indexer_types)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """The dims RoPE rotates per head: MLA's rope slice, or GLM-4.5's `partial_rotary_factor` of head_dim."""
        if self.mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0))

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)


def dense_layers(config: Any) -> tuple[int, ...]:
    """The dense blocks: `mlp_layer_types[i] == "dense"` where the config lists them (GLM-4.7-Flash), else the first
    `first_k_dense_replace`."""
    types = getattr(config, "mlp_layer_types", None)
    if types is not None:
        return tuple(i for i, kind in enumerate(types) if kind == "dense")
    return tuple(range(config.first_k_dense_replace))


def args_from_config(config: Any) -> DeepseekV3Args:
    """The args of a transformers DeepseekV3Config / Glm4MoeConfig / Glm4MoeLiteConfig."""
    if config.model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={config.model_type!r}: the deepseek_v3 family builds {', '.join(MODEL_TYPES)}")
    mla = getattr(config, "kv_lora_rank", None) is not None
    attention: dict[str, Any]
    if mla:
        attention = dict(
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            rope_interleave=getattr(config, "rope_interleave", True),
        )
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        attention = dict(head_dim=head_dim, use_qk_norm=config.use_qk_norm)
    return DeepseekV3Args(
        **sparse_attention(config),
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size,
        n_routed_experts=config.n_routed_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        n_shared_experts=config.n_shared_experts,
        n_group=config.n_group,
        topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor,
        norm_topk_prob=config.norm_topk_prob,
        dense_layers=dense_layers(config),
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        **attention,
    )


def sparse_attention(config: Any) -> dict[str, Any]:
    """The DSA keys of a DeepseekV32Config (every block full, half-split indexer RoPE) or GlmMoeDsaConfig (its
    `indexer_types`, interleaved); none for the other model types. ValueError naming a bad `indexer_types`."""
    if config.model_type not in DSA_TYPES:
        return {}
    layers = config.num_hidden_layers
    glm = config.model_type == "glm_moe_dsa"
    types = tuple(config.indexer_types) if glm else (FULL,) * layers
    if len(types) != layers:
        raise ValueError(f"indexer_types has {len(types)} entries for num_hidden_layers={layers}")
    if config.q_lora_rank is None:
        raise ValueError(f"q_lora_rank=None with model_type={config.model_type!r}: the DSA indexer reads the q latent")
    indexer_sources(types)  # the bad values named here, at the config
    return {
        "index_topk": config.index_topk,
        "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim,
        "indexer_types": types,
        "indexer_rope_interleave": glm,
    }

"""The DeepSeek-V3 lineage: DeepSeek-V3 / R1 and Kimi-K2 (`deepseek_v3`), GLM-4.7-Flash (`glm4_moe_lite`), both with
multi-head latent attention, DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`), MLA with DeepSeek Sparse
Attention (model/dsa.py: a lightning indexer, top-k sparse MLA, GLM-5's cross-layer top-k sharing), and GLM-4.5 / 4.6
/ 4.7 (`glm4_moe`, grouped-query attention with partial RoPE); all with dense-first blocks and the sigmoid router
balanced by a bias (noaux_tc), its un-gated shared expert. DSA splits by every tensor mode (the indexer whole on each
rank over the whole sequence: isp gathers its inputs, mtp / msp / fsp hand the attention its input whole) and by a
pipeline whose stages each begin at a block with an indexer (a stage beginning at a shared block refused in one line:
build.check_run).

Built from a Hugging Face folder alone (`model.hf_path`) or its config (`model.hf_config`, config.json's keys);
docs/deepseek.md. `tools.export --hf` writes its folder back (transformers' names and config.json; Kimi-K2's as
`deepseek_v3`). Its tensor plan (model.py) takes it through tensor parallel (mtp / msp / fsp / isp) and expert
parallel, and it splits into pipeline stages (each stage counts its own routers' choices; the partition counts the
config's `num_hidden_layers`, dense-first blocks as one each); the config checks count its experts and blocks off its
config (`routed_experts`, `blocks`). Multi-token prediction (`model.mtp_config`, model/mtp.py) follows config.json's
`num_nextn_predict_layers` where the section is unset (`mtp_layers`); the folder's MTP blocks (`model.layers.{L+k}.*`)
are read and exported; it is refused under a pipeline (its block would sit on the last stage) in one line.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from internlm_offload.family import Capabilities, FamilySpec, register_family

# config.json's model_type values this family reads (Kimi-K2's `kimi_k2`, which transformers does not register, is
# read as `deepseek_v3`: the same architecture).
MODEL_TYPES = ("deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
# those with DeepSeek Sparse Attention (model/dsa.py): a lightning indexer and top-k sparse MLA
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")
# transformers' n_routed_experts where a config leaves it out
DEFAULT_EXPERTS = {
    "deepseek_v3": 256,
    "kimi_k2": 256,
    "glm4_moe": 128,
    "glm4_moe_lite": 64,
    "deepseek_v32": 256,
    "glm_moe_dsa": 256,
}
# transformers' num_experts_per_tok where a config leaves it out
DEFAULT_TOP_K = {
    "deepseek_v3": 8,
    "kimi_k2": 8,
    "glm4_moe": 8,
    "glm4_moe_lite": 4,
    "deepseek_v32": 8,
    "glm_moe_dsa": 8,
}
# transformers' num_hidden_layers where a config leaves it out
DEFAULT_BLOCKS = {
    "deepseek_v3": 61,
    "kimi_k2": 61,
    "glm4_moe": 46,
    "glm4_moe_lite": 47,
    "deepseek_v32": 61,
    "glm_moe_dsa": 78,
}
# transformers' num_nextn_predict_layers where a config leaves it out (Glm4MoeLiteConfig, DeepseekV32Config and
# GlmMoeDsaConfig have no such key; GLM-4.7-Flash's config.json states 1)
DEFAULT_MTP_LAYERS = {
    "deepseek_v3": 1,
    "kimi_k2": 1,
    "glm4_moe": 1,
    "glm4_moe_lite": 0,
    "deepseek_v32": 0,
    "glm_moe_dsa": 0,
}
# transformers' dense-first blocks where a config names neither first_k_dense_replace nor mlp_layer_types
# (glm4_moe_lite has no first_k_dense_replace: its mlp_layer_types default to one dense block, then sparse ones)
DEFAULT_DENSE_FIRST = {
    "deepseek_v3": 3,
    "kimi_k2": 3,
    "glm4_moe": 1,
    "glm4_moe_lite": 1,
    "deepseek_v32": 3,
    "glm_moe_dsa": 3,
}
DENSE, SPARSE = "dense", "sparse"  # transformers' names of the kinds (`mlp_layer_types`)


def check_section(model: Any) -> None:
    """A folder or a config of one of MODEL_TYPES; the native decoder's keys do not apply."""
    if (model.hf_path is None) == (model.hf_config is None):
        raise ValueError("model.type='deepseek_v3' needs exactly one of model.hf_path and model.hf_config")
    if model.hf_config is not None and model.hf_config.get("model_type") not in MODEL_TYPES:
        raise ValueError(
            f"model.hf_config['model_type']={model.hf_config.get('model_type')!r}: model.type='deepseek_v3' builds "
            f"{', '.join(MODEL_TYPES)}"
        )
    if model.attn_impl == "eager":
        raise ValueError("model.attn_impl='eager' is for model.type='hf_causal_lm'; deepseek_v3 has sdpa and flash")


def folder_config(model: Any) -> dict[str, Any]:
    """`model.hf_config`, or the folder's config.json ({} where it cannot be read: the build reports the folder)."""
    if model.hf_config is not None:
        return model.hf_config
    try:
        return json.loads((Path(model.hf_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def blocks(model: Any) -> int:
    """The decoder blocks: config.json's `num_hidden_layers` (the multi-token-prediction block not counted)."""
    config = folder_config(model)
    return int(config.get("num_hidden_layers", DEFAULT_BLOCKS.get(config.get("model_type"), model.num_layers)))


def mtp_layers(model: Any) -> int:
    """The multi-token-prediction depth config.json asks for: `num_nextn_predict_layers` (0 where it cannot be read)."""
    config = folder_config(model)
    return int(config.get("num_nextn_predict_layers", DEFAULT_MTP_LAYERS.get(config.get("model_type"), 0)))


def block_kinds(model: Any) -> tuple[str, ...]:
    """Each block's kind, "dense" (a SwiGLU of `intermediate_size`) or "sparse" (the experts): `mlp_layer_types`
    where the config lists them, else the first `first_k_dense_replace` dense (what args.dense_layers builds)."""
    config = folder_config(model)
    if "mlp_layer_types" in config:
        return tuple(config["mlp_layer_types"])
    count = blocks(model)
    dense = min(count, int(config.get("first_k_dense_replace", DEFAULT_DENSE_FIRST.get(config.get("model_type"), 0))))
    return (DENSE,) * dense + (SPARSE,) * (count - dense)


def with_blocks(model: Any, kinds: Sequence[str]) -> Any | None:
    """The section of the same model with exactly `kinds` as its blocks, from `model.hf_config` (a folder's
    config.json copied there; its weights are not read): what the planner's reduced models and the kernel probe
    build. `mlp_layer_types` names each block's kind (args.dense_layers reads it first, whatever the model_type);
    None where the config cannot be read."""
    config = folder_config(model)
    if not config:
        return None
    leading = next((i for i, kind in enumerate(kinds) if kind != DENSE), len(kinds))
    config = {**config, "num_hidden_layers": len(kinds), "mlp_layer_types": list(kinds)}
    if "first_k_dense_replace" in config:  # kept consistent with the list for a reader of either
        config["first_k_dense_replace"] = leading
    if config.get("indexer_types"):  # GLM-5's schedule, its first blocks' (the first one full) repeated to the count
        types = config["indexer_types"]
        config["indexer_types"] = [types[i % len(types)] for i in range(len(kinds))]
    return model.model_copy(update={"hf_config": config, "hf_path": None, "num_layers": len(kinds)})


def routed_experts(model: Any) -> int:
    """The routed experts per sparse block, off `model.hf_config` or the folder's config.json (0 where it cannot be
    read: the build reports the folder)."""
    config = folder_config(model)
    return int(config.get("n_routed_experts", DEFAULT_EXPERTS.get(config.get("model_type"), 0)))


def experts_per_token(model: Any) -> int:
    """The experts each token is routed to, off the config (`num_experts_per_tok`; 0 where it cannot be read)."""
    config = folder_config(model)
    return int(config.get("num_experts_per_tok", DEFAULT_TOP_K.get(config.get("model_type"), 0)))


FAMILY = register_family(
    FamilySpec(
        name="deepseek_v3",
        entry="internlm_offload.model.families.deepseek_v3.build",
        summary="DeepSeek-V3 / Kimi-K2 / GLM-4.5 / GLM-4.7-Flash from a Hugging Face folder or config",
        capabilities=Capabilities(
            tensor_parallel=True,
            pipeline=True,
            init_per_param=True,
            folder_export=True,
            lora=True,
            balancing_loss=True,
            multi_token_prediction=True,
        ),
        check_section=check_section,
        routed_experts=routed_experts,
        experts_per_token=experts_per_token,
        blocks=blocks,
        mtp_layers=mtp_layers,
        block_kinds=block_kinds,
        with_blocks=with_blocks,
    )
)

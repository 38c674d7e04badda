"""Qwen3-Next (`qwen3_next`) and the Qwen3.5 text models (`qwen3_5_moe_text`, `qwen3_5_text`: the same design with
split DeltaNet projections; a dense MLP in `qwen3_5_text`) on the native decoder: three Gated DeltaNet blocks (model/gated_deltanet.py) for every
gated full-attention block (per-head output gate, zero-centred q/k norms, partial RoPE), zero-centred RMSNorms, and
mixtures of experts with a sigmoid-gated shared expert (softmax router, top-k renormalised).

Built from a Hugging Face folder alone (`model.hf_path`) or its config (`model.hf_config`); docs/qwen3_next.md.
A released Qwen3.5 vision-language folder builds its text model (the vision tower not read, said in one line).
`tools.export --hf` writes the folder back (a vision tower copied through unchanged). Tensor parallel splits by whole
DeltaNet key-head groups, isp exchanges them for whole sequences, a pipeline splits the stack (docs/qwen3_next.md,
"Layouts"). Multi-token prediction (`model.mtp_config`, model/mtp.py, the DeepSeek-V3 family's) follows config.json's
`mtp_num_hidden_layers` where the section is unset (`mtp_layers`); the folder's `mtp.*` tensors are read and exported.
A balancing loss: transformers' own where config.json sets `output_router_logits` (weighted by its
`router_aux_loss_coef`), or `model.balancing_loss` (transformers' or XTuner's; model/balancing.py). LoRA is
refused in one line (not built).
"""

from collections.abc import Sequence
from typing import Any

from internlm_offload.family import Capabilities, FamilySpec, register_family
from internlm_offload.model.families.gpt_oss import folder_config as config_json

MODEL_TYPE = "qwen3_next"
# config.json's model_type -> its causal LM class (the `--hf` export's architectures)
CAUSAL_LMS = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
}
# the released folders: a vision tower around the text model (its `text_config`), which is what builds and trains
VISION_LANGUAGE = ("qwen3_5", "qwen3_5_moe")
# transformers' Qwen3NextConfig defaults (Qwen3-Next-80B-A3B) for keys a config.json leaves out
DEFAULT_EXPERTS, DEFAULT_TOP_K, DEFAULT_BLOCKS = 512, 10, 48
# `model.balancing_loss` of its softmax router: transformers' loss, XTuner's over the global batch or the micro-batch
BALANCING_LOSSES = ("transformers", "global_batch", "micro_batch")
# config.json's multi-token-prediction layers (the released folders state 1; transformers' config classes have no
# such key, so a config without it has none)
MTP_LAYERS_KEY = "mtp_num_hidden_layers"


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json's text model: a vision-language folder's `text_config` (its model_type `<model_type>_text`, the
    head's tie from the outer config, which transformers' vision-language class ties by); any other as it is."""
    model_type = config.get("model_type")
    if model_type not in VISION_LANGUAGE:
        return config
    text = {"model_type": f"{model_type}_text", **(config.get("text_config") or {})}
    if "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def folder_config(model: Any) -> dict[str, Any]:
    """The text model's config.json keys (`model.hf_config`, or the folder's; a vision-language folder's
    `text_config`); {} where the folder's cannot be read (the build reports the folder)."""
    return text_config(config_json(model))


def check_section(model: Any) -> None:
    """A Qwen3-Next or Qwen3.5 text folder or config, or a Qwen3.5 vision-language folder (its text model built);
    a vision-language `model.hf_config` refused (the vision tower an export copies comes from a folder)."""
    if (model.hf_path is None) == (model.hf_config is None):
        raise ValueError("model.type='qwen3_next' needs exactly one of model.hf_path and model.hf_config")
    if model.hf_config is not None and model.hf_config.get("model_type") in VISION_LANGUAGE:
        raise ValueError(
            f"model.hf_config['model_type']={model.hf_config['model_type']!r}: a vision-language config is built from "
            "its folder (model.hf_path: the text model trains, the vision tower is copied through on export); give "
            "its text_config as model.hf_config to start its text model at random"
        )
    model_type = folder_config(model).get("model_type")
    if model.hf_config is not None and model_type not in CAUSAL_LMS:
        raise ValueError(
            f"model.hf_config['model_type']={model_type!r}: model.type='qwen3_next' builds {', '.join(CAUSAL_LMS)}"
        )
    if model.attn_impl == "eager":
        raise ValueError("model.attn_impl='eager': qwen3_next attends natively; use 'auto', 'sdpa' or 'flash'")


def blocks(model: Any) -> int:
    """config.json's `num_hidden_layers`."""
    return int(folder_config(model).get("num_hidden_layers", DEFAULT_BLOCKS))


def routed_experts(model: Any) -> int:
    """config.json's `num_experts` (none in the dense `qwen3_5_text`)."""
    config = folder_config(model)
    return int(config.get("num_experts", 0 if config.get("model_type") == "qwen3_5_text" else DEFAULT_EXPERTS))


def mtp_layers(model: Any) -> int:
    """The multi-token-prediction depth config.json asks for: `mtp_num_hidden_layers` (0 where it has none)."""
    return int(folder_config(model).get(MTP_LAYERS_KEY, 0))


def experts_per_token(model: Any) -> int:
    """config.json's `num_experts_per_tok` (none in the dense `qwen3_5_text`)."""
    config = folder_config(model)
    return int(config.get("num_experts_per_tok", 0 if config.get("model_type") == "qwen3_5_text" else DEFAULT_TOP_K))


def block_kinds(model: Any) -> tuple[str, ...]:
    """Each block's kind, "<mixer>/<feed-forward>": `linear_attention` (Gated DeltaNet) or `full_attention` (config.json's
    `layer_types`, else every `full_attention_interval`-th), then "sparse" (the experts) or "dense" (as args.py
    decides: Qwen3-Next's `decoder_sparse_step` / `mlp_only_layers`, none in `qwen3_5_text`). The kernel probe runs
    one block of each kind, the planner composes its reduced models from them."""
    config = folder_config(model)
    count = blocks(model)
    interval = int(config.get("full_attention_interval", 4))
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(count)
    ]
    step, dense_only = int(config.get("decoder_sparse_step", 1)), set(config.get("mlp_only_layers", ()))
    experts = routed_experts(model)
    sparse = [experts > 0 and (i + 1) % step == 0 and i not in dense_only for i in range(count)]
    return tuple(f"{kind}/{'sparse' if s else 'dense'}" for kind, s in zip(types, sparse, strict=True))


def with_blocks(model: Any, kinds: Sequence[str]) -> Any | None:
    """The section of the same model with exactly `kinds` as its blocks (`block_kinds`' names), from `model.hf_config`
    (a folder's config.json copied there; its weights are not read); None where the config cannot be read or cannot
    hold that order (a dense block in Qwen3.5-MoE, a sparse one in the dense Qwen3.5)."""
    config = folder_config(model)
    if not config:
        return None
    mixers, ffns = zip(*(kind.split("/") for kind in kinds), strict=True)
    config = {**config, "num_hidden_layers": len(kinds), "layer_types": list(mixers)}
    dense = [i for i, ffn in enumerate(ffns) if ffn == "dense"]
    if config.get("model_type") == "qwen3_next":
        config.update(decoder_sparse_step=1, mlp_only_layers=dense)
    elif (dense and len(dense) != len(kinds)) or (not dense) != bool(routed_experts(model)):
        return None  # Qwen3.5's blocks are all sparse (MoE) or all dense
    return model.model_copy(update={"hf_config": config, "hf_path": None, "num_layers": len(kinds)})


FAMILY = register_family(
    FamilySpec(
        name="qwen3_next",
        entry="internlm_offload.model.families.qwen3_next.build",
        summary="Qwen3-Next / Qwen3.5 text (Gated DeltaNet + gated attention, gated shared expert) from a Hugging Face folder",
        capabilities=Capabilities(
            tensor_parallel=True,
            pipeline=True,
            init_per_param=True,
            folder_export=True,
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
        balancing_losses=BALANCING_LOSSES,
    )
)

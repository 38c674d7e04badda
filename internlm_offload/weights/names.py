"""The name tables of InternEvo's and Meta's files against the native model's parameters; pure string maps.

A table is a `NameTable` (its templates, `{i}` a block index, `*` every expert of a mixture-of-experts block, and
the native names themselves: model/families/internlm2/names.py); the Hugging Face formats' tables are the native
family's Hugging Face side (model/families/internlm2/hf_names.py).
"""

import re

from internlm_offload.model.families.internlm2.names import (
    ATTENTION_BIASES,
    BLOCK,
    ENDS,
    FUSED_WQKV,
    QK_NORMS,
    SEPARATE_QKV,
    WO_BIAS,
)
from internlm_offload.model.name_table import NameTable, identity

# Names that hold no parameter: RoPE tables some writers save (the native model derives its own).
_DERIVED = re.compile(r"(^|\.)(inv_freq|rope\.freqs)$")


def bias_hint(name: str) -> str:
    """What to add to an error about a foreign name the model lacks, when it is a bias or a fused expert tensor."""
    if name.endswith(".bias"):
        return "; the folder's model has attention biases: model.attention_bias=True"
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return (
            "; transformers' in-memory fused experts (written by save_pretrained(save_original_format=False)): "
            "save the folder with transformers' default, one tensor per expert"
        )
    return ""


def is_derived(name: str) -> bool:
    """A saved RoPE table, not a parameter: skipped on the way in."""
    return _DERIVED.search(name) is not None


# InternEvo's own model files (and the fused layout its InternLM2 trains): the native names, wqkv fused.
INTERNEVO = NameTable("internevo", identity(*FUSED_WQKV, *BLOCK, WO_BIAS, *ENDS))

# InternEvo's InternLM2 with `enable_qkv_fusion=False` (InternLM3's configs): the native names exactly.
INTERNEVO_UNFUSED = NameTable("internevo", identity(*SEPARATE_QKV, *ATTENTION_BIASES, *BLOCK, WO_BIAS, *ENDS))

# InternEvo's InternLM v1 (`model_type="INTERNLM"`). Its fused `blocks.{i}.mixer.Wqkv` holds, per tensor-
# parallel rank, that rank's q rows, then k, then v; `internevo_files` cuts each rank's piece into the
# `Wq`/`Wk`/`Wv` named here before the pieces merge.
INTERNLM1 = NameTable(
    "internevo (InternLM v1)",
    (
        ("embedding.weight", "tok_embeddings.weight"),
        *(
            (f"blocks.{{i}}.mixer.W{part}.{kind}", f"layers.{{i}}.attention.w{part}.{kind}")
            for part in "qkv"
            for kind in ("weight", "bias")
        ),
        ("blocks.{i}.mixer.out_proj.weight", "layers.{i}.attention.wo.weight"),
        ("blocks.{i}.mixer.out_proj.bias", "layers.{i}.attention.wo.bias"),
        ("blocks.{i}.norm1.weight", "layers.{i}.attention_norm.weight"),
        ("blocks.{i}.norm2.weight", "layers.{i}.ffn_norm.weight"),
        *((f"blocks.{{i}}.mlp.{w}.weight", f"layers.{{i}}.feed_forward.{w}.weight") for w in ("w1", "w2", "w3")),
        ("norm.weight", "norm.weight"),
        ("head.weight", "output.weight"),
    ),
)

# Meta's consolidated Llama checkpoints: the native names, q/k/v separate (rows in Meta's RoPE order).
META_LLAMA = NameTable("llama", identity(*SEPARATE_QKV, *BLOCK, *ENDS), rope_interleaved=True)


# InternEvo's mixture-of-experts models. The gate and the shared expert (`residual_mlp`, mixed by `coefficient`)
# are in the dense files, each expert in its own file (`internevo_moe`); `*` is the global expert.
def _internevo_moe(block: str, ffn: str) -> tuple[tuple[str, str], ...]:
    moe = f"{block}.{{i}}.{ffn}"
    return (
        (f"{moe}.moe_layer.gate.wg.weight", "layers.{i}.feed_forward.router.weight"),
        *(
            (f"{moe}.moe_layer.experts.wrapped_experts.*.{w}.weight", f"layers.{{i}}.feed_forward.experts.{w}")
            for w in ("w1", "w2", "w3")
        ),
        *(
            (f"{moe}.residual_mlp.{w}.weight", f"layers.{{i}}.feed_forward.shared_experts.{w}.weight")
            for w in ("w1", "w2", "w3")
        ),
        *(
            (f"{moe}.coefficient.{kind}", f"layers.{{i}}.feed_forward.coefficient.{kind}")
            for kind in ("weight", "bias")
        ),
    )


# InternEvo's QWEN2MOE / QWEN3MOE: the native names (q, k, v apart, Qwen3's q/k norms), the MoE under `moe_layer`.
INTERNEVO_MOE = NameTable(
    "internevo",
    identity(*SEPARATE_QKV, *ATTENTION_BIASES, *QK_NORMS, *BLOCK, WO_BIAS, *ENDS)
    + _internevo_moe("layers", "feed_forward"),
)

# InternEvo's MIXTRALMOE: InternLM v1's block names (`blocks.{i}.mixer`, norm1, norm2, embedding, head), q, k, v apart.
INTERNEVO_MIXTRAL_MOE = NameTable(
    "internevo (MIXTRALMOE)",
    (
        ("embedding.weight", "tok_embeddings.weight"),
        *(
            (f"blocks.{{i}}.mixer.w{part}.{kind}", f"layers.{{i}}.attention.w{part}.{kind}")
            for part in "qkvo"
            for kind in ("weight", "bias")
        ),
        ("blocks.{i}.norm1.weight", "layers.{i}.attention_norm.weight"),
        ("blocks.{i}.norm2.weight", "layers.{i}.ffn_norm.weight"),
        *_internevo_moe("blocks", "mlp"),
        ("norm.weight", "norm.weight"),
        ("head.weight", "output.weight"),
    ),
)

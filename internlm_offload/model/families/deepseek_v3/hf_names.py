"""The DeepSeek-V3 lineage's Hugging Face names against the native ones (names.NameTable): transformers' decoder,
MLA's projections (kept under their own names), GLM-4.5's grouped-query attention, the dense-first SwiGLU, the
bias-balanced router and its experts one tensor each on disk (stacked here), the un-gated shared experts."""

from internlm_offload.model.mtp import MTP_PREFIX
from internlm_offload.model.name_table import NameTable

_SWIGLU = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
_MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_MLA_NORMS = ("q_a_layernorm", "kv_a_layernorm")
_LAYER = "model.layers.{i}"

_DECODER = (
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    (f"{_LAYER}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    (f"{_LAYER}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
)
_MLA_ATTENTION = (
    *(
        (f"{_LAYER}.self_attn.{n}.{kind}", f"layers.{{i}}.attention.{n}.{kind}")
        for n in _MLA
        for kind in ("weight", "bias")
    ),
    *((f"{_LAYER}.self_attn.{n}.weight", f"layers.{{i}}.attention.{n}.weight") for n in _MLA_NORMS),
)
_GQA_ATTENTION = (
    *(
        (f"{_LAYER}.self_attn.{hf}_proj.{kind}", f"layers.{{i}}.attention.{ours}.{kind}")
        for hf, ours in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo"))
        for kind in ("weight", "bias")
    ),
    *((f"{_LAYER}.self_attn.{n}.weight", f"layers.{{i}}.attention.{n}.weight") for n in ("q_norm", "k_norm")),
)
_FEED_FORWARD = (
    *((f"{_LAYER}.mlp.{hf}.weight", f"layers.{{i}}.feed_forward.{ours}.weight") for hf, ours in _SWIGLU),
    (f"{_LAYER}.mlp.gate.weight", "layers.{i}.feed_forward.router.weight"),
    (f"{_LAYER}.mlp.gate.e_score_correction_bias", "layers.{i}.feed_forward.router.e_score_correction_bias"),
    *((f"{_LAYER}.mlp.experts.*.{hf}.weight", f"layers.{{i}}.feed_forward.experts.{ours}") for hf, ours in _SWIGLU),
    *(
        (f"{_LAYER}.mlp.shared_experts.{hf}.weight", f"layers.{{i}}.feed_forward.shared_experts.{ours}.weight")
        for hf, ours in _SWIGLU
    ),
)

# DeepSeek Sparse Attention's indexer, on the blocks that own one (GLM-5's "full" ones, every DeepSeek-V3.2 block).
_INDEXER = tuple(
    (f"{_LAYER}.self_attn.indexer.{n}", f"layers.{{i}}.attention.indexer.{n}")
    for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
)

# DeepSeek-V3 / R1, Kimi-K2, GLM-4.7-Flash: MLA.
HF_MLA_MOE = NameTable("hf (deepseek_v3)", (*_DECODER, *_MLA_ATTENTION, *_FEED_FORWARD))
# DeepSeek-V3.2, GLM-5: MLA and its indexer.
HF_DSA_MOE = NameTable("hf (glm_moe_dsa / deepseek_v32)", (*_DECODER, *_MLA_ATTENTION, *_INDEXER, *_FEED_FORWARD))
# GLM-4.5 / 4.6 / 4.7: grouped-query attention.
HF_GQA_MOE = NameTable("hf (glm4_moe)", (*_DECODER, *_GQA_ATTENTION, *_FEED_FORWARD))

# Multi-token prediction's layer k (model/mtp.py), held in the folder as block L + k (weights/hf_folder.py moves the
# index): its own norms and projection, `shared_head.norm` its head norm.
_MTP_LAYER = f"{MTP_PREFIX}layers.{{i}}"
_MTP_OWN = (
    *((f"{_LAYER}.{n}.weight", f"{_MTP_LAYER}.{n}.weight") for n in ("enorm", "hnorm", "eh_proj")),
    (f"{_LAYER}.shared_head.norm.weight", f"{_MTP_LAYER}.head_norm.weight"),
)
# The shared embedding's and head's copies DeepSeek-V3's files hold in each MTP block (vLLM's MTP draft reads them).
MTP_COPIES = (("embed_tokens.weight", "tok_embeddings.weight"), ("shared_head.head.weight", "output.weight"))


def mtp_table(table: NameTable, own: tuple[tuple[str, str], ...] = _MTP_OWN) -> NameTable:
    """The names of the multi-token-prediction layers of a model named by `table`: their `own` (DeepSeek-V3's by
    default), and their decoder block's as `table` names block i's (`layers.{i}.X` -> `mtp.layers.{i}.block.X`)."""
    block = tuple(
        (foreign, f"{_MTP_LAYER}.block.{native.removeprefix('layers.{i}.')}")
        for foreign, native in table.rules
        if foreign.startswith(f"{_LAYER}.") and native.startswith("layers.{i}.")
    )
    return NameTable(f"{table.format}, multi-token prediction", (*own, *block))


# What transformers keeps in fp32 in these models (`_keep_in_fp32_modules_strict`): the router's weight and its bias.
KEEP_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
# DSA's models also keep the indexer's head weights in fp32 (`_keep_in_fp32_modules`)
KEEP_FP32_DSA = (*KEEP_FP32, "indexer.weights_proj.weight")
# The causal LM class of each model_type (config.json's `architectures`, which vLLM reads).
CAUSAL_LM = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}

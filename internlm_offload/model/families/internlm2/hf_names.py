"""The Hugging Face formats the native decoder loads and writes, by config.json's `model_type`: their names against
the native ones (`names.NameTable`)."""

from internlm_offload.model.families.internlm2.names import BLOCK, FUSED_WQKV, WO_BIAS
from internlm_offload.model.name_table import NameTable

# Hugging Face InternLM2 (`InternLM2ForCausalLM`): InternEvo's names under `model.`, the head outside it.
HF_INTERNLM2 = NameTable(
    "hf",
    tuple((f"model.{name}", name) for name in (*FUSED_WQKV, *BLOCK, WO_BIAS, "tok_embeddings.weight", "norm.weight"))
    + (("output.weight", "output.weight"),),
)

# The decoder of transformers' Llama-like models: embeddings, attention (q, k, v, o with their biases), norms, head.
_HF_DECODER = (
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    *(
        (f"model.layers.{{i}}.self_attn.{hf}_proj.{kind}", f"layers.{{i}}.attention.{ours}.{kind}")
        for hf, ours in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo"))
        for kind in ("weight", "bias")
    ),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
)
_SWIGLU = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
_DENSE_MLP = tuple(
    (f"model.layers.{{i}}.mlp.{hf}.weight", f"layers.{{i}}.feed_forward.{ours}.weight") for hf, ours in _SWIGLU
)

# Hugging Face Llama (`LlamaForCausalLM`), the architecture InternLM2's is; InternLM v1's HF port has the same
# names (with the attention biases).
HF_LLAMA = NameTable("hf_llama", (*_HF_DECODER, *_DENSE_MLP))

# Hugging Face mixture-of-experts decoders (transformers 5.x on disk: `save_pretrained` writes one tensor per
# expert, the names below; it fuses them into `experts.gate_up_proj` / `experts.down_proj` only in memory).
_QWEN_MOE = (
    *_HF_DECODER,
    *((f"model.layers.{{i}}.self_attn.{n}.weight", f"layers.{{i}}.attention.{n}.weight") for n in ("q_norm", "k_norm")),
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.feed_forward.router.weight"),
    *(
        (f"model.layers.{{i}}.mlp.experts.*.{hf}.weight", f"layers.{{i}}.feed_forward.experts.{ours}")
        for hf, ours in _SWIGLU
    ),
    *_DENSE_MLP,  # the dense blocks (Qwen's mlp_only_layers, decoder_sparse_step)
)

# Qwen3-MoE (`Qwen3MoeForCausalLM`): q/k norms per head, no shared expert.
HF_QWEN3_MOE = NameTable("hf (qwen3_moe)", _QWEN_MOE)

# Qwen2-MoE (`Qwen2MoeForCausalLM`): a shared expert mixed in by sigmoid(shared_expert_gate(x)).
HF_QWEN2_MOE = NameTable(
    "hf (qwen2_moe)",
    (
        *_QWEN_MOE,
        *(
            (
                f"model.layers.{{i}}.mlp.shared_expert.{hf}.weight",
                f"layers.{{i}}.feed_forward.shared_experts.{ours}.weight",
            )
            for hf, ours in _SWIGLU
        ),
        ("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.feed_forward.coefficient.weight"),
    ),
)

# Mixtral (`MixtralForCausalLM`): the block is `block_sparse_moe`, its experts' w1 (gate), w3 (up), w2 (down).
HF_MIXTRAL = NameTable(
    "hf (mixtral)",
    (
        *_HF_DECODER,
        ("model.layers.{i}.block_sparse_moe.gate.weight", "layers.{i}.feed_forward.router.weight"),
        *(
            (f"model.layers.{{i}}.block_sparse_moe.experts.*.{w}.weight", f"layers.{{i}}.feed_forward.experts.{w}")
            for w in ("w1", "w2", "w3")
        ),
    ),
)

# config.json's model_type -> its names. Dense: the native architecture (InternLM v1's port: Llama's names).
DENSE_TABLES = {"internlm2": HF_INTERNLM2, "llama": HF_LLAMA, "internlm": HF_LLAMA}
MOE_TABLES = {"qwen3_moe": HF_QWEN3_MOE, "qwen2_moe": HF_QWEN2_MOE, "mixtral": HF_MIXTRAL}
TABLES = {**DENSE_TABLES, **MOE_TABLES}

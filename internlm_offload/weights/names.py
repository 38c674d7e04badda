"""Name tables between the native model's parameters and other formats; pure string maps.

A table is a tuple of (foreign, native) templates where `{i}` stands for a block index. The native names
are `InternLM2.state_dict()`'s; `layers.{i}.attention.wqkv.weight` (and `.bias`) is the one name that is not
native: the fused projection that `qkv.split_wqkv` turns into wq, wk, wv. A table may name weights a given
model lacks (the attention biases); the model's own state dict decides which are expected.

A `*` in a foreign template stands for every expert of a mixture-of-experts block: the foreign format saves one
tensor per expert (`experts.0.`, `experts.1.`, ...) where the native model holds them stacked along dim 0
(`convert.stack_experts` / `convert.split_experts`).
"""

import re
from dataclasses import dataclass
from functools import cached_property

FUSED_WQKV = ("layers.{i}.attention.wqkv.weight", "layers.{i}.attention.wqkv.bias")

_BLOCK = (
    "layers.{i}.attention.wo.weight",
    "layers.{i}.attention_norm.weight",
    "layers.{i}.ffn_norm.weight",
    "layers.{i}.feed_forward.w1.weight",
    "layers.{i}.feed_forward.w2.weight",
    "layers.{i}.feed_forward.w3.weight",
)
_SEPARATE_QKV = tuple(f"layers.{{i}}.attention.{w}.weight" for w in ("wq", "wk", "wv"))
_ATTENTION_BIASES = tuple(f"layers.{{i}}.attention.{w}.bias" for w in ("wq", "wk", "wv"))
_WO_BIAS = "layers.{i}.attention.wo.bias"
_ENDS = ("tok_embeddings.weight", "norm.weight", "output.weight")

# Names that hold no parameter: RoPE tables some writers save (the native model derives its own).
_DERIVED = re.compile(r"(^|\.)(inv_freq|rope\.freqs)$")


@dataclass(frozen=True)
class NameTable:
    """One format's names: `rules` pairs each foreign template with its native one."""

    format: str
    rules: tuple[tuple[str, str], ...]
    rope_interleaved: bool = False  # Meta's row order for the query and key heads (see `qkv`)

    @cached_property
    def _patterns(self) -> list[tuple[re.Pattern, str, re.Pattern, str]]:
        return [(_pattern(foreign), native, _pattern(native), foreign) for foreign, native in self.rules]

    def to_native(self, name: str) -> str | None:
        """The native name of a foreign one; None for a name the format does not have."""
        return _translate(name, ((p, target) for p, target, _, _ in self._patterns))

    def to_foreign(self, name: str) -> str | None:
        """The foreign name of a native (or fused-wqkv) one; None when this format has no such name."""
        return _translate(name, ((p, target) for _, _, p, target in self._patterns))


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


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


def _translate(name: str, pairs) -> str | None:
    for pattern, target in pairs:
        match = pattern.match(name)
        if match is not None:
            return target.format(**match.groupdict())
    return None


def _identity(*names: str) -> tuple[tuple[str, str], ...]:
    return tuple((name, name) for name in names)


# InternEvo's own model files (and the fused layout its InternLM2 trains): the native names, wqkv fused.
INTERNEVO = NameTable("internevo", _identity(*FUSED_WQKV, *_BLOCK, _WO_BIAS, *_ENDS))

# InternEvo's InternLM2 with `enable_qkv_fusion=False` (InternLM3's configs): the native names exactly.
INTERNEVO_UNFUSED = NameTable("internevo", _identity(*_SEPARATE_QKV, *_ATTENTION_BIASES, *_BLOCK, _WO_BIAS, *_ENDS))

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
META_LLAMA = NameTable("llama", _identity(*_SEPARATE_QKV, *_BLOCK, *_ENDS), rope_interleaved=True)

# Hugging Face InternLM2 (`InternLM2ForCausalLM`): InternEvo's names under `model.`, the head outside it.
HF_INTERNLM2 = NameTable(
    "hf",
    tuple((f"model.{name}", name) for name in (*FUSED_WQKV, *_BLOCK, _WO_BIAS, "tok_embeddings.weight", "norm.weight"))
    + (("output.weight", "output.weight"),),
)

# Hugging Face Llama (`LlamaForCausalLM`), the architecture InternLM2's is; InternLM v1's HF port has the same
# names (with the attention biases).
HF_LLAMA = NameTable(
    "hf_llama",
    (
        ("model.embed_tokens.weight", "tok_embeddings.weight"),
        *(
            (f"model.layers.{{i}}.self_attn.{hf}_proj.{kind}", f"layers.{{i}}.attention.{ours}.{kind}")
            for hf, ours in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo"))
            for kind in ("weight", "bias")
        ),
        ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
        ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
        ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
        ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
        ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
        ("model.norm.weight", "norm.weight"),
        ("lm_head.weight", "output.weight"),
    ),
)


# Hugging Face mixture-of-experts decoders (transformers 5.x on disk: `save_pretrained` writes one tensor per
# expert, the names below; it fuses them into `experts.gate_up_proj` / `experts.down_proj` only in memory).
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
_QWEN_MOE = (
    *_HF_DECODER,
    *((f"model.layers.{{i}}.self_attn.{n}.weight", f"layers.{{i}}.attention.{n}.weight") for n in ("q_norm", "k_norm")),
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.feed_forward.router.weight"),
    *(
        (f"model.layers.{{i}}.mlp.experts.*.{hf}.weight", f"layers.{{i}}.feed_forward.experts.{ours}")
        for hf, ours in _SWIGLU
    ),
    # the dense blocks (Qwen's mlp_only_layers, decoder_sparse_step)
    *((f"model.layers.{{i}}.mlp.{hf}.weight", f"layers.{{i}}.feed_forward.{ours}.weight") for hf, ours in _SWIGLU),
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


_QK_NORMS = tuple(f"layers.{{i}}.attention.{n}.weight" for n in ("q_norm", "k_norm"))

# InternEvo's QWEN2MOE / QWEN3MOE: the native names (q, k, v apart, Qwen3's q/k norms), the MoE under `moe_layer`.
INTERNEVO_MOE = NameTable(
    "internevo",
    _identity(*_SEPARATE_QKV, *_ATTENTION_BIASES, *_QK_NORMS, *_BLOCK, _WO_BIAS, *_ENDS)
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

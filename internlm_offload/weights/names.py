"""Name tables between the native model's parameters and other formats; pure string maps.

A table is a tuple of (foreign, native) templates where `{i}` stands for a block index. The native names
are `InternLM2.state_dict()`'s; `layers.{i}.attention.wqkv.weight` is the one name that is not native: the
fused projection that `qkv.split_wqkv` turns into wq, wk, wv.
"""

import re
from dataclasses import dataclass
from functools import cached_property

FUSED_WQKV = "layers.{i}.attention.wqkv.weight"

_BLOCK = (
    "layers.{i}.attention.wo.weight",
    "layers.{i}.attention_norm.weight",
    "layers.{i}.ffn_norm.weight",
    "layers.{i}.feed_forward.w1.weight",
    "layers.{i}.feed_forward.w2.weight",
    "layers.{i}.feed_forward.w3.weight",
)
_SEPARATE_QKV = tuple(f"layers.{{i}}.attention.{w}.weight" for w in ("wq", "wk", "wv"))
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
INTERNEVO = NameTable("internevo", _identity(FUSED_WQKV, *_BLOCK, *_ENDS))

# Meta's consolidated Llama checkpoints: the native names, q/k/v separate (rows in Meta's RoPE order).
META_LLAMA = NameTable("llama", _identity(*_SEPARATE_QKV, *_BLOCK, *_ENDS), rope_interleaved=True)

# Hugging Face InternLM2 (`InternLM2ForCausalLM`): InternEvo's names under `model.`, the head outside it.
HF_INTERNLM2 = NameTable(
    "hf",
    tuple((f"model.{name}", name) for name in (FUSED_WQKV, *_BLOCK, "tok_embeddings.weight", "norm.weight"))
    + (("output.weight", "output.weight"),),
)

# Hugging Face Llama (`LlamaForCausalLM`), the architecture InternLM2's is.
HF_LLAMA = NameTable(
    "hf_llama",
    (
        ("model.embed_tokens.weight", "tok_embeddings.weight"),
        ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight"),
        ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attention.wk.weight"),
        ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attention.wv.weight"),
        ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
        ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
        ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
        ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
        ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
        ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
        ("model.norm.weight", "norm.weight"),
        ("lm_head.weight", "output.weight"),
    ),
)

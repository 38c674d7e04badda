"""The native decoder's parameter names, and `NameTable`: another format's names against them (pure string maps).

A table is a tuple of (foreign, native) templates where `{i}` stands for a block index. The native names are
`InternLM2.state_dict()`'s; `layers.{i}.attention.wqkv.weight` (and `.bias`) is the one name that is not native: the
fused projection that `weights/qkv.split_wqkv` turns into wq, wk, wv. A table may name weights a given model lacks
(the attention biases); the model's own state dict decides which are expected.

A `*` in a foreign template stands for every expert of a mixture-of-experts block: the foreign format saves one
tensor per expert (`experts.0.`, `experts.1.`, ...) where the native model holds them stacked along dim 0
(`weights/convert.stack_experts` / `split_experts`).

The tables themselves: Hugging Face's in `hf_names.py` (this family's Hugging Face side), InternEvo's and Meta's in
`weights/names.py`.
"""

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

FUSED_WQKV = ("layers.{i}.attention.wqkv.weight", "layers.{i}.attention.wqkv.bias")
BLOCK = (
    "layers.{i}.attention.wo.weight",
    "layers.{i}.attention_norm.weight",
    "layers.{i}.ffn_norm.weight",
    "layers.{i}.feed_forward.w1.weight",
    "layers.{i}.feed_forward.w2.weight",
    "layers.{i}.feed_forward.w3.weight",
)
SEPARATE_QKV = tuple(f"layers.{{i}}.attention.{w}.weight" for w in ("wq", "wk", "wv"))
ATTENTION_BIASES = tuple(f"layers.{{i}}.attention.{w}.bias" for w in ("wq", "wk", "wv"))
WO_BIAS = "layers.{i}.attention.wo.bias"
QK_NORMS = tuple(f"layers.{{i}}.attention.{n}.weight" for n in ("q_norm", "k_norm"))
ENDS = ("tok_embeddings.weight", "norm.weight", "output.weight")


@dataclass(frozen=True)
class NameTable:
    """One format's names: `rules` pairs each foreign template with its native one."""

    format: str
    rules: tuple[tuple[str, str], ...]
    rope_interleaved: bool = False  # Meta's row order for the query and key heads (see `weights/qkv`)

    @cached_property
    def _patterns(self) -> list[tuple[re.Pattern, str, re.Pattern, str]]:
        return [(_pattern(foreign), native, _pattern(native), foreign) for foreign, native in self.rules]

    def to_native(self, name: str) -> str | None:
        """The native name of a foreign one; None for a name the format does not have."""
        return _translate(name, ((p, target) for p, target, _, _ in self._patterns))

    def to_foreign(self, name: str) -> str | None:
        """The foreign name of a native (or fused-wqkv) one; None when this format has no such name."""
        return _translate(name, ((p, target) for _, _, p, target in self._patterns))


def identity(*names: str) -> tuple[tuple[str, str], ...]:
    """Rules of a format that keeps the native names."""
    return tuple((name, name) for name in names)


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


def _translate(name: str, pairs: Iterable[tuple[re.Pattern, str]]) -> str | None:
    for pattern, target in pairs:
        match = pattern.match(name)
        if match is not None:
            return target.format(**match.groupdict())
    return None

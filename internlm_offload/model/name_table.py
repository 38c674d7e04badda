"""`NameTable`: another format's parameter names against a model's (pure string maps), and `FolderFormat`: how a
family's Hugging Face folder is named, which the builder reads it by (weights/hf_folder.py).

A table is a tuple of (foreign, native) templates where `{i}` stands for a block index. A table may name weights a
given model lacks (the attention biases); the model's own state dict decides which are expected. A `*` in a foreign
template stands for every expert of a mixture-of-experts block: the foreign format saves one tensor per expert
(`experts.0.`, `experts.1.`, ...) where the model holds them stacked along dim 0 (`weights/convert.stack_experts` /
`split_experts`).
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property


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


@dataclass(frozen=True)
class FolderFormat:
    """A family's folder: its names, its query and kv heads (the fused and Meta layouts need them), and its blocks
    (tensors of a block at or past `num_layers + mtp_layers`, multi-token prediction not built, are left out)."""

    table: NameTable
    n_heads: int
    n_kv_heads: int
    num_layers: int
    # Foreign names ending so are written in fp32 whatever the export's dtype (a router's weight and bias, which
    # transformers keeps in fp32: a bias moves by 1e-3 a step, which bf16 would round away).
    keep_fp32: tuple[str, ...] = ()
    # Multi-token prediction's layers (model/mtp.py), which the folder holds as blocks `num_layers + k`: how many the
    # model builds, and their names with k for `{i}` (weights/hf_folder.py moves the index).
    mtp_layers: int = 0
    mtp_table: NameTable | None = None
    # (name inside such a block, the native tensor it copies): the shared embedding's and head's copies some folders
    # hold in each (DeepSeek-V3's); never read, written back where the folder read had them.
    mtp_copies: tuple[tuple[str, str], ...] = ()
    # A re-layout of the folder's tensors (foreign names to foreign names) before the table renames them on a read,
    # and its inverse after it on a write: GPT-OSS's interleaved, (in, out) experts and its MXFP4 pairs dequantised
    # (model/families/gpt_oss/hf_names.py). A read a piece at a time reads the tensors of one `piece_key` together
    # (None: one tensor, or the per-expert tensors of one stacked one).
    read_transform: Callable[[dict], dict] | None = None
    write_transform: Callable[[dict], dict] | None = None
    piece_key: Callable[[str], str] | None = None
    # Folder tensors (by name prefix) of a part the model does not build, a vision-language folder's vision tower:
    # not read (said in one line, `copied_what` naming them) and copied unchanged from `model.hf_path` into an export.
    copied_through: tuple[str, ...] = ()
    copied_what: str = ""

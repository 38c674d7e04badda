"""A whole state dict between native names and a format's (a `NameTable`), with the row orders of `qkv`
and the experts of a mixture-of-experts block stacked (native) or one tensor each (foreign `experts.{e}.`).

Renames, row moves, stacks and splits only: every tensor comes out bit for bit, so a round trip is exact.
"""

import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from internlm_offload.errors import CheckpointError
from internlm_offload.model.name_table import NameTable
from internlm_offload.weights.names import is_derived
from internlm_offload.weights.qkv import fuse_wqkv, halves_to_interleaved, interleaved_to_halves, split_wqkv

_WQKV = re.compile(r"layers\.(\d+)\.attention\.wqkv\.(weight|bias)$")
_QKV = re.compile(r"layers\.(\d+)\.attention\.w([qkv])\.(weight|bias)$")
_QUERY_KEY = re.compile(r"layers\.\d+\.attention\.w([qk])\.weight$")
# One expert's tensor in a foreign format: `...experts.{e}.rest` (Hugging Face), `...wrapped_experts.{e}.rest`
# (InternEvo); the stacked name puts `*` in place of e (`NameTable`).
_EXPERT = re.compile(r"^(.*experts\.)(\d+)(\..+)$")


@dataclass(frozen=True)
class Heads:
    """The attention shape the projections' row orders depend on."""

    n_heads: int
    n_kv_heads: int

    def of(self, name: str) -> int:
        """Heads of a native wq (query) or wk (key) name."""
        return self.n_heads if _QUERY_KEY.search(name).group(1) == "q" else self.n_kv_heads


def to_native(tensors: dict[str, torch.Tensor], table: NameTable, heads: Heads, where: str) -> dict[str, torch.Tensor]:
    """Native-named tensors from a format's; RoPE tables are dropped, an unknown name is an error naming `where`."""
    native: dict[str, torch.Tensor] = {}
    for name, tensor in stack_experts(tensors, where).items():
        if is_derived(name):
            continue
        target = table.to_native(name)
        if target is None:
            raise CheckpointError(f"{where}: {name!r} is not a {table.format} model weight this model has")
        fused = _WQKV.match(target)
        if fused is not None:
            block, kind = fused.groups()
            parts = split_wqkv(tensor, heads.n_heads, heads.n_kv_heads)
            native.update({f"layers.{block}.attention.w{p}.{kind}": t for p, t in zip("qkv", parts)})
        elif table.rope_interleaved and _QUERY_KEY.search(target):
            native[target] = interleaved_to_halves(tensor, heads.of(target))
        else:
            native[target] = tensor
    return native


def to_format(native: dict[str, torch.Tensor], table: NameTable, heads: Heads) -> dict[str, torch.Tensor]:
    """A format's tensors from native ones; the inverse of `to_native`."""
    fuses = table.to_foreign("layers.0.attention.wqkv.weight") is not None
    out: dict[str, torch.Tensor] = {}
    for name, tensor in native.items():
        query_key_value = _QKV.match(name)
        if fuses and query_key_value is not None:
            block, part, kind = query_key_value.groups()
            if part != "q":
                continue  # fused with its wq
            parts = (native[f"layers.{block}.attention.w{p}.{kind}"] for p in "qkv")
            out[table.to_foreign(f"layers.{block}.attention.wqkv.{kind}")] = fuse_wqkv(*parts, heads.n_kv_heads)
            continue
        if table.rope_interleaved and _QUERY_KEY.search(name):
            tensor = halves_to_interleaved(tensor, heads.of(name))
        foreign = table.to_foreign(name)
        if foreign is None:
            raise CheckpointError(f"{name!r} has no {table.format} name")
        out.update(split_experts(foreign, tensor))
    return out


def stack_experts(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Per-expert tensors (`...experts.{e}.rest`) stacked along a new dim 0 under `...experts.*.rest`, in expert
    order; other names as they are. Experts 0..n-1 must all be there (an error names the first one missing)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for name, tensor in tensors.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            head, expert, tail = match.groups()
            groups[f"{head}*{tail}"][int(expert)] = tensor
    for stacked, experts in groups.items():
        missing = next((e for e in range(max(experts) + 1) if e not in experts), None)
        if missing is not None:
            raise CheckpointError(
                f"{where}: no {stacked.replace('*', str(missing))!r} (the folder has experts "
                f"{sorted(experts)} of this tensor; every expert from 0 on must be there)"
            )
        out[stacked] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def stacked_name(name: str) -> str:
    """The name `stack_experts` files a foreign tensor under: `*` in place of an expert's index, else the name."""
    match = _EXPERT.match(name)
    return name if match is None else f"{match.group(1)}*{match.group(3)}"


def split_experts(foreign: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked tensor under a `*` name as one tensor per expert (`*` -> 0, 1, ...); else {foreign: tensor}.
    Each expert's tensor is a copy: writers would otherwise save (or refuse) the whole shared storage per expert."""
    if "*" not in foreign:
        return {foreign: tensor}
    return {foreign.replace("*", str(e)): piece.clone() for e, piece in enumerate(tensor.unbind(0))}

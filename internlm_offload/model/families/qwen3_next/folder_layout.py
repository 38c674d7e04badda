"""How a Qwen3.5 folder lays out the text model's tensors, both ways: the released vision-language folders
(`model_type` `qwen3_5` / `qwen3_5_moe`) hold them under `model.language_model.*` (the head at `lm_head.weight`) beside
the vision tower's `model.visual.*`, and the released files fuse each block's experts into `mlp.experts.gate_up_proj`
[E, 2I, D] (gate rows, then up) and `mlp.experts.down_proj` [E, D, I] (transformers' in-memory layout), where
transformers' save_pretrained writes one tensor per expert. A read takes either (`from_folder`); a write gives back the
layout the folder had (`SourceLayout.to_folder`). Only renames, slices and stacks: a round trip is bit for bit. A
vision-language folder's config.json is written back as it was (`SourceConfig`)."""

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TEXT_PREFIX = "model.language_model."  # the vision-language folders' text model (transformers' `model.` in its LMs)
VISION_PREFIX = "model.visual."
GATE_UP, DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"
_MAIN_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@dataclass(frozen=True)
class SourceLayout:
    """A folder's layout of the text model: under `model.language_model.` beside a vision tower, its experts fused."""

    vision_language: bool = False
    fused_experts: bool = False

    def to_folder(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' text-model names (one tensor per expert) in this layout (`from_folder`'s inverse)."""
        out = fused(tensors) if self.fused_experts else dict(tensors)
        if self.vision_language:
            out = {_prefixed(name): tensor for name, tensor in out.items()}
        return out


def from_folder(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A folder's text-model tensors (or a piece of them) under transformers' text-model names, one tensor per expert
    (views of a fused tensor's slices); a text folder's as they are."""
    out = {}
    for name, tensor in tensors.items():
        name = "model." + name.removeprefix(TEXT_PREFIX) if name.startswith(TEXT_PREFIX) else name
        if name.startswith("model.layers.") and name.endswith(GATE_UP):
            stem, inner = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = tensor[e, :inner]
                out[f"{stem}{e}.up_proj.weight"] = tensor[e, inner:]
        elif name.startswith("model.layers.") and name.endswith(DOWN):
            stem = name.removesuffix("down_proj")
            out.update({f"{stem}{e}.down_proj.weight": tensor[e] for e in range(tensor.shape[0])})
        else:
            out[name] = tensor
    return out


def fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The main blocks' per-expert tensors as the released files fuse them (the MTP layer's, `mtp.*`, stay one per
    expert, as they ship)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = _MAIN_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        stem, e, kind = match.groups()
        experts.setdefault(stem, {}).setdefault(kind, {})[int(e)] = tensor
    for stem, kinds in experts.items():
        gate, up, down = (torch.stack([kinds[k][e] for e in sorted(kinds[k])]) for k in ("gate", "up", "down"))
        out[f"{stem}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{stem}.down_proj"] = down
    return out


def _prefixed(name: str) -> str:
    """A text-model name under the vision-language folder's prefix (the head and `mtp.*` are outside the model)."""
    return TEXT_PREFIX + name.removeprefix("model.") if name.startswith("model.") else name


def read_layout(folder: str, vision_language: bool) -> SourceLayout:
    """The layout of `folder`'s weights: fused experts where a main block holds `mlp.experts.gate_up_proj` (read off
    the safetensors index or headers, no tensor read)."""
    names = _tensor_names(Path(folder))
    fused_experts = any(n.endswith(GATE_UP) and not n.startswith("mtp.") for n in names)
    return SourceLayout(vision_language=vision_language, fused_experts=fused_experts)


def _tensor_names(folder: Path) -> list[str]:
    """The names of the folder's safetensors tensors (none for .bin weights: one tensor per expert assumed)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    names: list[str] = []
    for path in sorted(folder.glob("model*.safetensors")):
        try:
            with path.open("rb") as f:
                names.extend(json.loads(f.read(int.from_bytes(f.read(8), "little"))))
        except (OSError, ValueError):
            continue  # a damaged file: the read names it
    return names


class SourceConfig:
    """A vision-language folder's config.json as an export writes it back: the file as it was (its class, its vision
    config, its keys as spelled, which transformers and vLLM read alike), the export's dtype recorded where the file
    records one (`hf_folder.set_dtype` sets `dtype`); the head's tie as the file says."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw
        self.tie_word_embeddings = bool(raw.get("tie_word_embeddings", False))
        self.dtype: Any = None

    def save_pretrained(self, folder: str) -> None:
        """config.json into `folder`."""
        out = json.loads(json.dumps(self.raw))  # a deep copy
        if self.dtype is not None:
            name = str(self.dtype).removeprefix("torch.")
            for section in (out, out.get("text_config")):
                if isinstance(section, dict):
                    keys = [k for k in ("dtype", "torch_dtype") if k in section] or (
                        ["dtype"] if section is out else []
                    )
                    section.update(dict.fromkeys(keys, name))
        Path(folder, "config.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")

"""Meta's consolidated Llama checkpoints: `params.json` and `consolidated.{00,01,...}.pth`, one per
model-parallel rank of Meta's reference code (pieces merged by `shards.merge_pieces`).

The names are the native ones; the query and key rows are in Meta's interleaved RoPE order (see `qkv`).
"""

from pathlib import Path

import torch

from internlm_offload.config import ModelConfig
from internlm_offload.errors import CheckpointError
from internlm_offload.weights.files import load_model_file, read_json_object
from internlm_offload.weights.names import is_derived
from internlm_offload.weights.shards import merge_pieces

PARAMS = "params.json"


def is_meta_folder(folder: Path) -> bool:
    return (folder / PARAMS).is_file() and any(folder.glob("consolidated.*.pth"))


def check_params(folder: Path, model: ModelConfig) -> None:
    """params.json must describe the configured model; every difference in one line."""
    path = folder / PARAMS
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {PARAMS}; a Meta Llama checkpoint folder has one")
    params = read_json_object(path)
    wanted = {
        "dim": (model.hidden_size, "model.hidden_size"),
        "n_layers": (model.num_layers, "model.num_layers"),
        "n_heads": (model.num_attention_heads, "model.num_attention_heads"),
        "n_kv_heads": (model.num_kv_attention_heads, "model.num_kv_attention_heads"),
        "norm_eps": (model.norm_eps, "model.norm_eps"),
        "rope_theta": (model.rope_base, "model.rope_base"),
    }
    found = {**params, "n_kv_heads": params.get("n_kv_heads") or params.get("n_heads")}
    found.setdefault("rope_theta", 10000.0)
    problems = [
        f"{key}={found.get(key)!r} (set {setting} to match; it gives {value!r})"
        for key, (value, setting) in wanted.items()
        if found.get(key) != value
    ]
    if params.get("use_scaled_rope"):
        problems.append("use_scaled_rope=True (the native model has plain RoPE)")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))


def weight_files(folder: Path) -> list[Path]:
    """The folder's consolidated files in model-parallel rank order."""
    return sorted(folder.glob("consolidated.*.pth"))


def read_meta_weights(folder: Path, files: list[Path], full_shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Full tensors under Meta's names from the folder's consolidated `files`, merged in file order."""
    states = [load_model_file(path) for path in files]
    names = [name for name in states[0] if not is_derived(name)]
    merged = {}
    for name in names:
        if name not in full_shapes:
            raise CheckpointError(f"{files[0]}: {name!r} is not a Llama weight of this model")
        if any(name not in state for state in states):
            raise CheckpointError(f"{folder}: {name!r} is in {files[0].name} and not in every consolidated file")
        merged[name] = merge_pieces([state[name] for state in states], full_shapes[name], f"{folder}: {name}")
    missing = sorted(full_shapes.keys() - merged.keys())
    if missing:
        raise CheckpointError(f"{folder}: no {missing[0]!r} in {files[0].name}")
    return merged

"""InternEvo's mixture-of-experts files: each sparse block's experts saved apart from the dense model files.

`internlm/checkpoint/components.py` (try_save_moe_checkpoint) writes `model_moe_layer{L}_expert{e}_{tp|wp}{r}.pt`
beside `model_tp{t}_pp{p}.pt` (which keeps everything else, the gates `moe_layer.gate.wg.weight` included):
- L is the sparse block's number (InternEvo's MoE models are sparse in every block, so L is the block);
- r is the expert tensor rank (`tp`, 0 under `parallel.expert.no_tp`) or, under ISP, the expert weight rank (`wp`);
- the keys keep the module path, `...moe_layer.experts.wrapped_experts.{e}.w1.weight`, with e the global expert.
Two forms of the experts' tensors, both read here:
- list (`use_grouped_mlp=False`): one file per expert e holding its `nn.Linear` weights, (out, in);
- grouped (InternEvo's default): `wrapped_experts` holds one grouped MLP per expert-parallel rank, so e is that
  rank and its tensors are (E / ep, in, out), the experts of the rank stacked and transposed.
An expert's pieces over r are contiguous chunks along one dim, merged by `shards.merge_pieces` as the dense files'.
"""

import re
from collections import defaultdict
from itertools import product
from pathlib import Path

import torch

from internlm_offload.errors import CheckpointError
from internlm_offload.weights.files import load_model_file
from internlm_offload.weights.shards import merge_pieces

EXPERT_FILE = re.compile(r"model_moe_layer(?P<layer>\d+)_expert(?P<expert>\d+)_(?P<mode>tp|wp)(?P<rank>\d+)\.pt$")
WRAPPED = ".moe_layer.experts.wrapped_experts."
# A key of an expert file: block prefix, (stage-local) block number, module path, expert, tensor.
_KEY = re.compile(
    r"^(?P<blocks>layers|blocks)\.\d+(?P<path>\..*" + re.escape(WRAPPED) + r")(?P<expert>\d+)(?P<rest>\..+)$"
)


def expert_files(entries: list[Path]) -> list[Path]:
    """The InternEvo expert files among a folder's entries."""
    return [path for path in entries if EXPERT_FILE.match(path.name)]


def check_expert_layout(folder: Path, entries: list[Path]) -> list[Path]:
    """The expert files when they form one complete layout (every block, expert and rank up to the largest
    found, one mode); a one-line error naming the first file missing."""
    files = expert_files(entries)
    found = {_index(path) for path in files}
    modes = {mode for _, _, mode, _ in found}
    if len(modes) > 1:
        raise CheckpointError(f"{folder}: expert files of both tp and wp ranks ({files[0].name}, {files[-1].name})")
    for layer, expert, rank in product(*(range(max(key[i] for key in found) + 1) for i in (0, 1, 3))):
        name = f"model_moe_layer{layer}_expert{expert}_{next(iter(modes))}{rank}.pt"
        if (layer, expert, next(iter(modes)), rank) not in found:
            raise CheckpointError(
                f"{folder}: {name} is missing (the folder has experts 0..{_largest(found, 1)} of "
                f"blocks 0..{_largest(found, 0)})"
            )
    return files


def read_expert_files(folder: Path, files: list[Path], list_shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Every expert's full tensors in the list form, `...wrapped_experts.{e}.w1.weight` (out, in) with global block
    numbers; `list_shapes` holds those names' full shapes (the model's), which decide how pieces merge."""
    pieces: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for path in sorted(files):
        layer, _, _, rank = _index(path)
        for key, tensor in load_model_file(path).items():
            match = _KEY.match(key)
            if match is None:
                raise CheckpointError(f"{path}: {key!r} is not an expert weight (`...{WRAPPED}{{e}}...`)")
            name = f"{match['blocks']}.{layer}{match['path']}{match['expert']}{match['rest']}"
            pieces[name][rank] = tensor
    experts_per_layer = len({_index(p)[1] for p in files})
    merged: dict[str, torch.Tensor] = {}
    for name, by_rank in pieces.items():
        parts = [by_rank[r] for r in sorted(by_rank)]
        if parts[0].dim() == 3:  # grouped: (E / ep, in, out) per expert-parallel rank
            merged.update(_ungroup(folder, name, parts, list_shapes, experts_per_layer))
        elif name in list_shapes:
            merged[name] = merge_pieces(parts, list_shapes[name], f"{folder}: {name}")
        else:
            merged[name] = parts[0]  # not this model's: named by the caller's check
    return merged


def _ungroup(
    folder: Path, name: str, parts: list[torch.Tensor], list_shapes: dict[str, torch.Size], ranks: int
) -> dict[str, torch.Tensor]:
    """One expert-parallel rank's grouped tensor as its experts' list-form tensors (out, in)."""
    match = _KEY.match(name)
    layer = name.split(".")[1]
    siblings = [
        n
        for n in list_shapes
        if (m := _KEY.match(n))
        and n.split(".")[1] == layer
        and m["path"] == match["path"]
        and m["rest"] == match["rest"]
    ]
    if not siblings:
        return {name: parts[0]}  # not this model's: named by the caller's check
    out_features, in_features = list_shapes[siblings[0]]
    experts = len(siblings)
    local = experts // ranks
    grouped = merge_pieces(parts, torch.Size((local, in_features, out_features)), f"{folder}: {name}")
    start = int(match["expert"]) * local
    head = name[: match.start("expert")]
    return {f"{head}{start + j}{match['rest']}": grouped[j].t().contiguous() for j in range(local)}


def write_expert_files(tensors: dict[str, torch.Tensor], folder: Path) -> list[Path]:
    """InternEvo's grouped expert files for one expert-parallel rank and one expert tensor rank: per sparse block
    L, `model_moe_layer{L}_expert0_tp0.pt` with `...wrapped_experts.0.w{1,2,3}.weight` (E, in, out). `tensors`:
    list-form expert tensors `...wrapped_experts.{e}...` (out, in)."""
    grouped: dict[tuple[int, str], dict[int, torch.Tensor]] = defaultdict(dict)
    for name, tensor in tensors.items():
        match = _KEY.match(name)
        layer = int(name.split(".")[1])
        grouped[(layer, f"{name[: match.start('expert')]}0{match['rest']}")][int(match["expert"])] = tensor
    by_layer: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    for (layer, name), experts in grouped.items():
        by_layer[layer][name] = torch.stack([experts[e].t() for e in range(len(experts))]).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for layer, state in sorted(by_layer.items()):
        path = folder / f"model_moe_layer{layer}_expert0_tp0.pt"
        torch.save(state, path)
        written.append(path)
    return written


def is_expert_name(name: str) -> bool:
    return WRAPPED in name


def _index(path: Path) -> tuple[int, int, str, int]:
    match = EXPERT_FILE.match(path.name)
    return int(match["layer"]), int(match["expert"]), match["mode"], int(match["rank"])


def _largest(found: set[tuple[int, int, str, int]], axis: int) -> int:
    return max(key[axis] for key in found)

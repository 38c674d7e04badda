"""InternEvo's model files: one torch.save'd state dict per model-parallel rank, read merged and written split.

The names in a folder (`internlm/checkpoint/components.py`, save_model_checkpoint):
- `model_tp{t}_pp{p}.pt`: tensor parallel (mtp, msp, fsp) rank t, pipeline stage p;
- `model_wp{w}_pp{p}.pt` (also read as `model_tp{t}_wp{w}_pp{p}.pt`): ISP, weight-parallel rank w; ISP's
  tensor ranks split the sequence, not the weights, so their copies are alike and tp 0's is read;
- `model_tp{t}_pp{p}_dp{d}.pt`: FSDP, data-parallel shard d of tensor rank t (FSDP splits along dim 0).
A pipeline stage's file numbers its blocks from 0; the stages are contiguous runs of blocks in stage order.
Tensor and weight parallel pieces are contiguous chunks along one dim, merged by `shards.merge_pieces`.
Files load with `weights_only=True`: data, never code.
"""

import re
from collections import defaultdict
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import torch

from internlm_offload.errors import CheckpointError
from internlm_offload.weights.files import load_model_file
from internlm_offload.weights.names import bias_hint, is_derived
from internlm_offload.weights.shards import merge_pieces, split_even

MODEL_FILE = re.compile(r"model_(?:tp(?P<tp>\d+)_)?(?:wp(?P<wp>\d+)_)?pp(?P<pp>\d+)(?:_dp(?P<dp>\d+))?\.pt$")
_LAYER = re.compile(r"^(layers|blocks)\.(\d+)\.")  # InternLM2's blocks, InternLM v1's
_V1_QKV = re.compile(r"^(blocks\.\d+\.mixer\.)Wqkv\.(weight|bias)$")

# How InternEvo's layers split their weights (`--internevo` export): (mtp dim, isp dim); None: replicated.
_SPLIT_DIMS = {
    "attention.wqkv": (0, 0),
    "attention.wo": (1, 0),
    "feed_forward.w1": (0, 0),
    "feed_forward.w3": (0, 0),
    "feed_forward.w2": (1, 0),
    "tok_embeddings": (1, 1),  # InternEvo's embed_split_hidden=True: the hidden dim
    "output": (0, 0),
}


@dataclass(frozen=True)
class ModelFile:
    path: Path
    tp: int
    wp: int | None
    pp: int
    dp: int | None


def list_folder(folder: Path) -> list[Path]:
    """The folder's entries, sorted: the one listing a load makes ([] when `folder` is not a folder)."""
    return sorted(folder.iterdir()) if folder.is_dir() else []


def model_files(entries: list[Path]) -> list[ModelFile]:
    """The InternEvo model files among a folder's `entries`."""
    found = []
    for path in entries:
        match = MODEL_FILE.match(path.name)
        if match is not None:
            index = {key: None if value is None else int(value) for key, value in match.groupdict().items()}
            found.append(ModelFile(path, index["tp"] or 0, index["wp"], index["pp"], index["dp"]))
    return found


def check_layout(folder: Path, entries: list[Path]) -> list[ModelFile]:
    """The model files among the folder's `entries` when they form one complete layout; a one-line error
    naming what is off."""
    files = model_files(entries)
    if not files:
        raise CheckpointError(f"{folder}: no InternEvo model files (model_tp*_pp*.pt, model_wp*_pp*.pt)")
    if len({(f.wp is None, f.dp is None) for f in files}) > 1:
        raise CheckpointError(f"{folder}: model files of two layouts ({files[0].path.name}, {files[-1].path.name})")
    if any(f.wp is not None and f.dp is not None for f in files):
        raise CheckpointError(f"{folder}: {files[0].path.name}: ISP files with FSDP shards are not an InternEvo layout")
    present = {(f.tp, f.wp, f.pp, f.dp) for f in files}
    for key in product(*(_indices({key[axis] for key in present}) for axis in range(4))):
        if key not in present:
            raise CheckpointError(f"{folder}: {_file_name(*key)} is missing")
    return files


def read_model_files(paths: list[Path]) -> dict[Path, dict[str, torch.Tensor]]:
    """The tensors of a checked layout's files (`check_layout`), each file read once, in order; ISP's tensor
    ranks above 0 are skipped (they hold rank 0's weights)."""
    files = model_files(paths)
    isp = files[0].wp is not None
    return {f.path: load_model_file(f.path) for f in files if not (isp and f.tp != 0)}


def merge_model_files(
    folder: Path, states: dict[Path, dict[str, torch.Tensor]], full_shapes: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """Full tensors under InternEvo's names (block numbers global) from `read_model_files`' states.
    `full_shapes`: each name's full shape, which decides how its pieces merge."""
    files = model_files(list(states))
    isp = files[0].wp is not None
    stages: dict[int, dict[tuple[int, int], list[ModelFile]]] = defaultdict(lambda: defaultdict(list))
    for f in files:
        stages[f.pp][(f.tp, f.wp or 0)].append(f)
    merged: dict[str, torch.Tensor] = {}
    first_block = 0
    for pp in sorted(stages):
        stage = {
            rank: _split_v1_qkv(_merge_dp_shards(sorted(group, key=lambda f: f.dp or 0), states))
            for rank, group in sorted(stages[pp].items())
        }
        names = next(iter(stage.values()))
        blocks = _renumber(names, first_block)
        for state in stage.values():
            if state.keys() != names.keys():
                extra = min(state.keys() ^ names.keys())
                raise CheckpointError(f"{folder}: stage {pp}: {extra!r} is in some ranks' files and not others")
        for name in names:
            if is_derived(name):
                continue
            global_name = blocks.get(name, name)
            if global_name in merged:
                raise CheckpointError(f"{folder}: {global_name!r} is in two pipeline stages' files")
            if global_name not in full_shapes:
                where = folder / _file_name(0, 0 if isp else None, pp, None)
                as_global = "" if global_name == name else f" (the folder's {global_name!r})"
                raise CheckpointError(
                    f"{where}: {name!r}{as_global} is not an InternEvo weight of this model{bias_hint(name)}"
                )
            pieces = [state[name] for state in stage.values()]
            merged[global_name] = merge_pieces(pieces, full_shapes[global_name], f"{folder}: stage {pp}: {name}")
        first_block += len({m.group(2) for m in map(_LAYER.match, names) if m})
    missing = sorted(full_shapes.keys() - merged.keys())
    if missing:
        raise CheckpointError(
            f"{folder}: no {missing[0]!r} in any model file (the model has {len(full_shapes)} weights)"
        )
    return merged


def write_internevo_files(tensors: dict[str, torch.Tensor], folder: Path, *, tp: int = 1, wp: int = 0) -> list[Path]:
    """Write InternEvo-named full tensors as InternEvo's files for `tp` tensor-parallel ranks (mtp), or for
    `wp` weight-parallel ranks (ISP, when wp > 0); one pipeline stage."""
    ranks, isp = (wp, True) if wp else (tp, False)
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(ranks)]
    for name, tensor in tensors.items():
        dims = _split_dims(name)
        pieces = [tensor] * ranks if dims is None or ranks == 1 else split_even(tensor, ranks, dims[isp], name)
        for state, piece in zip(per_rank, pieces):
            state[name] = piece.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for rank, state in enumerate(per_rank):
        path = folder / (_file_name(0, rank, 0, None) if isp else _file_name(rank, None, 0, None))
        torch.save(state, path)
        written.append(path)
    return written


def _split_dims(name: str) -> tuple[int, int] | None:
    """(mtp dim, isp dim) a weight is split along; None: whole on every rank. A column-parallel bias splits
    with its rows (wqkv's); a row-parallel bias (wo's) is whole."""
    if name.endswith("attention.wqkv.bias"):
        return _SPLIT_DIMS["attention.wqkv"]
    return next((dims for key, dims in _SPLIT_DIMS.items() if name.endswith(f"{key}.weight")), None)


def _indices(values: set[int | None]) -> list[int | None]:
    """Every index an axis must have: 0 to the largest found (None: the layout has no such axis)."""
    return [None] if values == {None} else list(range(max(values) + 1))


def _file_name(tp: int, wp: int | None, pp: int, dp: int | None) -> str:
    if wp is not None:
        return f"model_wp{wp}_pp{pp}.pt"
    return f"model_tp{tp}_pp{pp}" + ("" if dp is None else f"_dp{dp}") + ".pt"


def _merge_dp_shards(files: list[ModelFile], states: dict[Path, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One model-parallel rank's tensors; FSDP's data-parallel shards concatenated along dim 0."""
    if len(files) == 1:
        return states[files[0].path]
    first = states[files[0].path]
    for f in files[1:]:
        if states[f.path].keys() != first.keys():
            name = min(states[f.path].keys() ^ first.keys())
            holder = f if name in states[f.path] else files[0]
            raise CheckpointError(
                f"{holder.path}: {name!r} is in this FSDP shard and not in every other shard of the same rank "
                "(the shards of one rank hold the same names)"
            )
    return {name: torch.cat([states[f.path][name] for f in files], dim=0) for name in first}


def _split_v1_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """InternLM v1's per-rank `Wqkv` (that rank's q rows, k rows, v rows) cut into `Wq`, `Wk`, `Wv` pieces,
    which then merge across ranks like any column-parallel weight (`names.INTERNLM1`)."""
    out = {}
    for name, tensor in state.items():
        match = _V1_QKV.match(name)
        if match is None:
            out[name] = tensor
            continue
        for part, piece in zip("qkv", torch.chunk(tensor, 3, dim=0)):
            out[f"{match.group(1)}W{part}.{match.group(2)}"] = piece
    return out


def _renumber(names: dict[str, torch.Tensor], first_block: int) -> dict[str, str]:
    """Global names for one stage's block-local ones (`layers.0.` of stage p is block `first_block`)."""
    return {
        name: f"{match.group(1)}.{int(match.group(2)) + first_block}.{name[match.end() :]}"
        for name in names
        if (match := _LAYER.match(name)) is not None
    }

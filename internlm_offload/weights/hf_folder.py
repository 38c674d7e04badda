"""Hugging Face model folders of the formats the native decoder loads (InternLM2, Llama, InternLM v1, Qwen3-MoE,
Qwen2-MoE, Mixtral): config.json read and checked, the weights in (safetensors or .bin, sharded or not) and out (a
`LlamaForCausalLM` folder, or a `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM` / `MixtralForCausalLM` one).

What a config.json means and what it refuses, its names and the config.json of an export are the native family's
Hugging Face side (model/families/internlm2/hf_config.py, hf_names.py, hf_export.py); here, the files.
Any family's folder is read by its `FolderFormat` (`read_folder`: the builder's, for `model.hf_path`), its
multi-token-prediction layers from the blocks after the stack (`model.layers.{L+k}.*`, as DeepSeek-V3 ships them).
"""

import json
import re
import shutil
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from internlm_offload.config import ModelConfig
from internlm_offload.errors import CheckpointError
from internlm_offload.log import get_logger
from internlm_offload.model.families.internlm2 import hf_config
from internlm_offload.model.families.internlm2.hf_export import llama_config, moe_config
from internlm_offload.model.mtp import MTP_PREFIX
from internlm_offload.model.name_table import FolderFormat, NameTable
from internlm_offload.weights.convert import Heads, stacked_name, to_format, to_native
from internlm_offload.weights.files import load_model_file, read_json_object
from internlm_offload.weights.tensor_files import TensorFiles

logger = get_logger(__name__)
_BLOCK_INDEX = re.compile(r"^model\.layers\.(\d+)\.")

CONFIG = "config.json"
# Files of a tokenizer folder that go beside exported weights.
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.model",
    "chat_template*",
)


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG}; a Hugging Face model folder has one")
    return read_json_object(path)


def name_table(folder: Path, hf: dict[str, Any]) -> NameTable:
    """The names of the folder's architecture (config.json's model_type)."""
    return hf_config.name_table(str(folder / CONFIG), hf.get("model_type"))


def check_config(folder: Path, hf: dict[str, Any], model: ModelConfig) -> None:
    """The folder's model must be the configured one; every difference in one line, with the key to set."""
    hf_config.check_config(str(folder / CONFIG), hf, model)


def weight_files(folder: Path) -> list[Path]:
    """The folder's weight files: safetensors if any (listed by their index when sharded), else .bin."""
    for suffix, stem in (("safetensors", "model"), ("bin", "pytorch_model")):
        index = folder / f"{stem}.{suffix}.index.json"
        if index.is_file():
            return _indexed_files(folder, index)
        found = sorted(folder.glob(f"{stem}*.{suffix}"))
        if found:
            return found
    raise CheckpointError(f"{folder}: no model*.safetensors or pytorch_model*.bin weights")


def _indexed_files(folder: Path, index: Path) -> list[Path]:
    """The files a sharded folder's index names: each a file name inside `folder`."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f'{index}: not an index (JSON with a "weight_map" object)')
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{index}: weight_map[{key!r}] = {name!r}; each value must be a file name (a string)")
        # by the name alone: the files themselves may be links out of the folder (the Hugging Face cache's are)
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(
                f"{index}: weight_map[{key!r}] = {name!r} points outside {folder}; the files must be in the folder"
            )
    names = sorted(set(weight_map.values()))
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{index}: lists {missing[0]}, which is not in the folder")
    return [folder / name for name in names]


def read_folder(folder: Path, layout: FolderFormat) -> dict[str, torch.Tensor]:
    """`folder`'s tensors under a family's own names (`layout`), its multi-token-prediction layers' among them (blocks
    `num_layers + k`, k < `mtp_layers`; their copies of the shared embedding and head not read); those of blocks past
    them (multi-token prediction the model does not build) are left out, said in one line."""
    files = weight_files(folder)
    tensors = read_weights(files)
    skipped = [name for name in tensors if name.startswith(layout.copied_through)]
    say_not_read(folder, files, skipped, layout)
    kept = {n: t for n, t in tensors.items() if not n.startswith(layout.copied_through)}
    tensors = transformed(kept, layout, folder)
    built = layout.num_layers + layout.mtp_layers
    beyond = blocks_beyond(tensors, built)
    if beyond:
        logger.warning(
            "%s: %d tensors of blocks from %d on (multi-token prediction the model does not build: model.mtp_config "
            "builds %d layers) are left out",
            folder,
            len(beyond),
            built,
            layout.mtp_layers,
        )
    heads = Heads(layout.n_heads, layout.n_kv_heads)
    main = {n: t for n, t in tensors.items() if not _block_at_least(n, layout.num_layers)}
    native = to_native(main, layout.table, heads, str(folder))
    mtp = mtp_tensors(tensors, layout)
    if mtp:
        native.update(to_native(mtp, layout.mtp_table, heads, str(folder)))
    return native


def folder_pieces(folder: Path, layout: FolderFormat) -> Iterator[dict[str, torch.Tensor]]:
    """`read_folder`'s tensors a piece at a time, for a model whose ranks keep a shard of each: a piece is one of the
    folder's tensors under the family's names (the experts of one stacked tensor together: `to_native` stacks them),
    read alone from its file (`TensorFiles`: a file mapped from its first tensor read to its last), so the host holds
    one piece above what the caller keeps. The same renames and re-layouts as `read_folder`: the same values bit for
    bit; the tensors left out said in one line once every piece is read."""
    heads = Heads(layout.n_heads, layout.n_kv_heads)
    built = layout.num_layers + layout.mtp_layers
    files = TensorFiles(weight_files(folder))
    beyond = blocks_beyond(files.where, built)
    skipped = {name for name in files.where if name.startswith(layout.copied_through)}
    say_not_read(folder, weight_files(folder), skipped, layout)
    groups: dict[str, list[str]] = defaultdict(list)
    key = layout.piece_key or stacked_name
    for name in files.where:
        if not _block_at_least(name, built) and not _mtp_copy(name, layout) and name not in skipped:
            groups[key(name)].append(name)
    files.expect(name for names in groups.values() for name in names)
    try:
        for names in groups.values():
            tensors = transformed({name: files.read(name) for name in names}, layout, folder)
            beyond += blocks_beyond(tensors, built)  # those a read_transform renames past them (Qwen3-Next's mtp.*)
            main = {n: t for n, t in tensors.items() if not _block_at_least(n, layout.num_layers)}
            native = to_native(main, layout.table, heads, str(folder)) if main else {}
            mtp = mtp_tensors(tensors, layout)
            if mtp:
                native.update(to_native(mtp, layout.mtp_table, heads, str(folder)))
            yield native
    finally:
        files.close()
    if beyond:
        logger.warning(
            "%s: %d tensors of blocks from %d on (multi-token prediction the model does not build: "
            "model.mtp_config builds %d layers) are left out",
            folder,
            len(beyond),
            built,
            layout.mtp_layers,
        )


def say_not_read(folder: Path, files: list[Path], names: Collection[str], layout: FolderFormat) -> None:
    """One line for the folder's tensors of a part the model does not build (`layout.copied_through`): how many,
    their bytes on disk, and that an export copies them through unchanged."""
    if names:
        logger.warning(
            "%s: %d tensors of %s (%d bytes, %.1f MiB) are not read: it is not built or trained here; an --hf "
            "export copies them unchanged from the folder",
            folder,
            len(names),
            layout.copied_what or "a part the model does not build",
            size := stored_bytes(files, names),
            size / 2**20,
        )


def stored_bytes(files: list[Path], names: Collection[str]) -> int:
    """The bytes the tensors `names` take in the folder's weight files (safetensors: read off the headers)."""
    wanted, total = set(names), 0
    for path in files:
        if path.suffix == ".safetensors":
            with path.open("rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k in wanted)
        else:
            total += sum(t.nbytes for k, t in load_model_file(path).items() if k in wanted)
    return total


def read_copied_through(folder: Path, layout: FolderFormat) -> dict[str, torch.Tensor]:
    """The folder's tensors of `layout.copied_through`, as stored (an export writes them unchanged)."""
    if not layout.copied_through:
        return {}
    files = TensorFiles(weight_files(folder))
    names = [name for name in files.where if name.startswith(layout.copied_through)]
    files.expect(names)
    try:
        return {name: files.read(name) for name in names}
    finally:
        files.close()


def transformed(tensors: dict[str, torch.Tensor], layout: FolderFormat, folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors through the family's `read_transform` (none: as they are); its refusal names the
    folder."""
    if layout.read_transform is None:
        return tensors
    try:
        return layout.read_transform(tensors)
    except ValueError as exc:
        raise CheckpointError(f"{folder}: {exc}") from None


def _mtp_copy(name: str, layout: FolderFormat) -> bool:
    """A multi-token-prediction block's copy of the shared embedding or head (never read: `mtp_tensors`)."""
    m = _BLOCK_INDEX.match(name)
    copies = {rest for rest, _ in layout.mtp_copies}
    return m is not None and 0 <= int(m.group(1)) - layout.num_layers < layout.mtp_layers and name[m.end() :] in copies


def mtp_tensors(tensors: dict[str, torch.Tensor], layout: FolderFormat) -> dict[str, torch.Tensor]:
    """The multi-token-prediction layers' tensors of a folder, block `num_layers + k` renamed block k (what
    `layout.mtp_table` names), the shared tensors' copies left out."""
    copies = tuple(name for name, _ in layout.mtp_copies)
    out = {}
    for name, tensor in tensors.items():
        m = _BLOCK_INDEX.match(name)
        if m is None or not 0 <= (k := int(m.group(1)) - layout.num_layers) < layout.mtp_layers:
            continue
        rest = name[m.end() :]
        if rest not in copies:
            out[f"model.layers.{k}.{rest}"] = tensor
    return out


def absent_mtp_layers(native: Iterable[str], layout: FolderFormat) -> list[int]:
    """The multi-token-prediction layers (0-based) of which `native` (a folder read by `read_folder`) holds no tensor:
    a folder transformers saved (its causal LMs never build MTP) holds none."""
    names = list(native)
    prefixes = [f"{MTP_PREFIX}layers.{k}." for k in range(layout.mtp_layers)]
    return [k for k, prefix in enumerate(prefixes) if not any(n.startswith(prefix) for n in names)]


def blocks_beyond(names: Iterable[str], num_layers: int) -> list[str]:
    """The names of tensors of blocks at or past `num_layers` (`model.layers.{i}.`): multi-token prediction's."""
    return [n for n in names if _block_at_least(n, num_layers)]


def _block_at_least(name: str, index: int) -> bool:
    m = _BLOCK_INDEX.match(name)
    return m is not None and int(m.group(1)) >= index


def tensor_names(files: list[Path]) -> list[str]:
    """The tensor names of a folder's weight files, without reading the tensors of safetensors files."""
    from safetensors import safe_open

    names: list[str] = []
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                names.extend(f.keys())
        else:
            names.extend(load_model_file(path))
    return names


def read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's weight files (`weight_files`), by the folder's names (data only: no pickled
    code)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix == ".safetensors":
            try:
                tensors.update(load_file(str(path)))
            except Exception as exc:  # noqa: BLE001  safetensors raises its own type for a damaged header or body
                raise CheckpointError(
                    f"{path}: not a readable safetensors file ({' '.join(str(exc).split())[:200]})"
                ) from None
            continue
        tensors.update(load_model_file(path))
    return tensors


def write_llama_folder(
    tensors: dict[str, torch.Tensor], model: ModelConfig, out: Path, dtype: torch.dtype, max_positions: int
) -> None:
    """config.json + model.safetensors of a `LlamaForCausalLM`; `tensors` under Hugging Face Llama's names."""
    from transformers import LlamaConfig

    config = LlamaConfig(**llama_config(model, max_positions, str(out)))
    _write_folder(config, tensors, model, out, dtype)


def write_moe_folder(
    tensors: dict[str, torch.Tensor], model: ModelConfig, family: str, out: Path, dtype: torch.dtype, max_positions: int
) -> None:
    """config.json + model.safetensors of transformers' `family` (`hf_names.MOE_TABLES`); `tensors` under its names,
    one per expert, as transformers' save_pretrained writes them and its from_pretrained reads them."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, **moe_config(model, family, max_positions))
    _write_folder(config, tensors, model, out, dtype)


def _write_folder(
    config: Any, tensors: dict[str, torch.Tensor], model: ModelConfig, out: Path, dtype: torch.dtype
) -> None:
    """A transformers `config` and `tensors` in `dtype` into `out` (a tied head left out: restored from the
    embeddings)."""
    from safetensors.torch import save_file

    set_dtype(config, dtype)
    if model.tie_word_embeddings:
        tensors = {name: t for name, t in tensors.items() if name != "lm_head.weight"}
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(
        {name: t.to(dtype).contiguous() for name, t in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )


def write_family_folder(
    native: dict[str, torch.Tensor],
    layout: FolderFormat,
    config: Any,
    out: Path,
    dtype: torch.dtype,
    *,
    mtp_copies: bool = False,
    copied: dict[str, torch.Tensor] | None = None,
) -> int:
    """A family's own folder (`layout`, the names its `model.hf_path` is read by): `config` as config.json and
    `native` under the folder's names in `dtype` (those ending in `layout.keep_fp32` in fp32), multi-token prediction's
    layers as blocks `num_layers + k` (with `mtp_copies`, each with its copies of the shared embedding and head, as
    DeepSeek-V3's files hold them); a tied head left out (transformers restores it from the embeddings); `copied` (the
    source folder's tensors of a part not built: `read_copied_through`) as they are, dtype included. The number of
    tensors written."""
    from safetensors.torch import save_file

    heads = Heads(layout.n_heads, layout.n_kv_heads)
    main = {n: t for n, t in native.items() if not n.startswith(MTP_PREFIX)}
    tensors = to_format(main, layout.table, heads)
    mtp = {n: t for n, t in native.items() if n.startswith(MTP_PREFIX)}
    if mtp:
        for name, tensor in to_format(mtp, layout.mtp_table, heads).items():
            m = _BLOCK_INDEX.match(name)
            tensors[f"model.layers.{layout.num_layers + int(m.group(1))}.{name[m.end() :]}"] = tensor
        for k in range(layout.mtp_layers if mtp_copies else 0):
            for rest, shared in layout.mtp_copies:
                tensors[f"model.layers.{layout.num_layers + k}.{rest}"] = native[shared].clone()  # saved apart
    if layout.write_transform is not None:
        tensors = layout.write_transform(tensors)
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    set_dtype(config, dtype)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    tensors = {n: t.to(torch.float32 if n.endswith(layout.keep_fp32) else dtype) for n, t in tensors.items()}
    tensors.update(copied or {})
    save_file(
        {n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return len(tensors)


def set_dtype(config: Any, dtype: torch.dtype) -> None:
    """Record the weights' dtype in a transformers config (`dtype` since 4.56, `torch_dtype` before)."""
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)


def copy_tokenizer(tokenizer: str, out: Path) -> list[str]:
    """Copy a tokenizer folder's files beside exported weights; the names copied (none for the byte tokenizer)."""
    source = Path(tokenizer)
    if not source.is_dir():
        return []
    copied = sorted({p.name for pattern in TOKENIZER_FILES for p in source.glob(pattern) if p.is_file()})
    for name in copied:
        shutil.copy2(source / name, out / name)
    return copied

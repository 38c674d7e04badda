"""The weights a `ckpt.load_ckpt_info` names when they are not this trainer's own checkpoint: which format,
checked before anything is built, then read as native full tensors and loaded into the built model.

| ckpt_type  | folder                                             | read by           |
|------------|----------------------------------------------------|-------------------|
| internevo  | InternEvo's `model_tp*_pp*.pt` / `model_wp*_pp*.pt` (+ `model_moe_layer*_expert*_tp*.pt`) | `internevo_files`, `internevo_moe` |
| hf         | Hugging Face InternLM2, Llama, Qwen3-MoE, Qwen2-MoE, Mixtral (config.json) | `hf_folder` |
| hf_llama   | the same                                           | `hf_folder`       |
| llama      | Meta's params.json + consolidated.*.pth            | `meta_llama`      |

(`internevo` on any other folder is this trainer's own DCP checkpoint, `engine.checkpoint`'s business.)
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from internlm_offload.config import LoadCkptInfo, ModelConfig
from internlm_offload.errors import CheckpointError
from internlm_offload.log import get_logger
from internlm_offload.model.lora import base_keys, has_adapters
from internlm_offload.model.name_table import NameTable
from internlm_offload.model.quantized import full_weight_shapes
from internlm_offload.weights import hf_folder, internevo_moe, meta_llama
from internlm_offload.weights.convert import Heads, to_format, to_native
from internlm_offload.weights.internevo_files import (
    check_layout,
    list_folder,
    merge_model_files,
    model_files,
    read_model_files,
)
from internlm_offload.weights.names import (
    INTERNEVO,
    INTERNEVO_MIXTRAL_MOE,
    INTERNEVO_MOE,
    INTERNEVO_UNFUSED,
    INTERNLM1,
    META_LLAMA,
    bias_hint,
    is_derived,
)

logger = get_logger(__name__)

KINDS = ("dcp", "internevo", "hf", "meta_llama")


@dataclass(frozen=True)
class WeightsSource:
    """A folder of model weights a run starts from; `kind` is one of KINDS (`dcp`: this trainer's own).
    `files`: a foreign folder's weight files, listed and checked once by `foreign_source`."""

    path: Path
    kind: str
    files: tuple[Path, ...] = ()


def foreign_source(info: LoadCkptInfo, model: ModelConfig) -> WeightsSource | None:
    """The foreign weights `info` names, their layout and config checked against `model`; None for this
    trainer's own checkpoints. Refuses a full resume (`content=("all",)`) of foreign weights."""
    path = Path(info.path)
    entries = list_folder(path) if info.ckpt_type == "internevo" else []
    if info.ckpt_type == "internevo" and not model_files(entries):
        return None
    if not path.is_dir():
        raise CheckpointError(f"ckpt.load_ckpt_info.path={str(path)!r}: no such folder")
    if info.ckpt_type == "internevo":
        dense = [f.path for f in check_layout(path, entries)]
        source = WeightsSource(path, "internevo", tuple(dense + _expert_layout(path, entries, model)))
    elif info.ckpt_type == "llama" and not meta_llama.is_meta_folder(path):
        hint = ' (a Hugging Face folder: ckpt_type="hf_llama")' if (path / hf_folder.CONFIG).is_file() else ""
        raise CheckpointError(f"{path}: no params.json and consolidated.*.pth of a Meta Llama checkpoint{hint}")
    elif info.ckpt_type == "llama":
        meta_llama.check_params(path, model)
        source = WeightsSource(path, "meta_llama", tuple(meta_llama.weight_files(path)))
    else:
        hf = hf_folder.read_config(path)
        hf_folder.name_table(path, hf)
        hf_folder.check_config(path, hf, model)
        source = WeightsSource(path, "hf", tuple(hf_folder.weight_files(path)))
    if info.content != ["model"]:
        raise CheckpointError(
            f"ckpt.load_ckpt_info: {path} holds another trainer's model weights ({source.kind}); they start a "
            'run with content=("model",); its optimizer and data states do not resume here'
        )
    return source


def read_native_weights(
    source: WeightsSource, model: ModelConfig, full_shapes: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """The source's weights as native full tensors, every name and shape checked against `full_shapes`."""
    heads = Heads(model.num_attention_heads, model.num_kv_attention_heads)
    expected = {name: torch.empty(shape, device="meta") for name, shape in full_shapes.items()}
    if model.tie_word_embeddings:
        expected.pop("output.weight", None)  # tied: the embeddings alone are saved (where a format allows)
    table, shapes, foreign = _read_foreign(source, expected, heads)
    if model.tie_word_embeddings:
        foreign.pop(table.to_foreign("output.weight"), None)  # a writer may save the tied head too
    _check_names_and_shapes(foreign, shapes, table, source.path)
    native = to_native(foreign, table, heads, str(source.path))
    if model.tie_word_embeddings:
        native["output.weight"] = native["tok_embeddings.weight"]
    return native


def _read_foreign(
    source: WeightsSource, expected: dict[str, torch.Tensor], heads: Heads
) -> tuple[NameTable, dict[str, torch.Size], dict[str, torch.Tensor]]:
    """The source's tensors under its own names, with its name table and the shapes `expected` (native, on
    the meta device) has under them; each file of `source.files` read once."""
    files = list(source.files)
    if source.kind == "internevo":
        states = read_model_files(files)
        table = internevo_table(list(next(iter(states.values()))))  # the first file's names tell the model
        shapes = {name: t.shape for name, t in to_format(expected, table, heads).items()}
        experts = {name: shape for name, shape in shapes.items() if internevo_moe.is_expert_name(name)}
        dense = {name: shape for name, shape in shapes.items() if name not in experts}
        merged = merge_model_files(source.path, states, dense)
        expert_paths = internevo_moe.expert_files(files)
        return table, shapes, {**merged, **internevo_moe.read_expert_files(source.path, expert_paths, experts)}
    if source.kind == "meta_llama":
        shapes = {name: t.shape for name, t in to_format(expected, META_LLAMA, heads).items()}
        return META_LLAMA, shapes, meta_llama.read_meta_weights(source.path, files, shapes)
    table = hf_folder.name_table(source.path, hf_folder.read_config(source.path))
    shapes = {name: t.shape for name, t in to_format(expected, table, heads).items()}
    return table, shapes, hf_folder.read_weights(files)


def internevo_table(names: list[str]) -> NameTable:
    """The names of the InternEvo model that wrote files holding `names`: a mixture of experts (`moe_layer`; Mixtral's
    under `blocks.*`, Qwen2/3-MoE's under `layers.*`), InternLM v1 (`blocks.*`), InternLM2 with a fused wqkv (the
    default), or with q, k, v apart (`enable_qkv_fusion=False`)."""
    if any(".moe_layer." in name for name in names):
        return INTERNEVO_MIXTRAL_MOE if any(name.startswith("blocks.") for name in names) else INTERNEVO_MOE
    if any(name.startswith("blocks.") for name in names):
        return INTERNLM1
    if any(".attention.wq." in name for name in names):
        return INTERNEVO_UNFUSED
    return INTERNEVO


def _expert_layout(folder: Path, entries: list[Path], model: ModelConfig) -> list[Path]:
    """The folder's InternEvo expert files, checked complete; there are some iff the model has experts."""
    found = internevo_moe.check_expert_layout(folder, entries) if internevo_moe.expert_files(entries) else []
    if found and not model.num_experts:
        raise CheckpointError(f"{found[0]}: MoE expert files; the configured model has none (model.num_experts=0)")
    if model.num_experts and not found:
        raise CheckpointError(
            f"{folder}: no model_moe_layer*_expert*_tp*.pt files; model.num_experts={model.num_experts} needs them"
        )
    return found


def load_weights(model: nn.Module, source: WeightsSource, config: ModelConfig) -> None:
    """Load the source's weights into `model` (plain, DDP's or FSDP2-sharded: each rank takes its part).

    Under several processes rank 0 alone reads the files; torch's `broadcast_from_rank0` sends each tensor to
    the other ranks, which keep their shard of it. Every rank holding a full copy at once is what this avoids.
    """
    shapes = {name: t.shape for name, t in get_model_state_dict(model).items()}
    shapes.update(full_weight_shapes(model))  # QLoRA: a 4-bit weight takes its file's [out, in] and quantizes it
    # LoRA: the files hold the base, by its names without adapters; the adapters keep their init
    keys = base_keys(shapes) if has_adapters(model) else {name: name for name in shapes}
    full_shapes = {name: shapes[key] for name, key in keys.items()}
    strict = len(keys) == len(shapes)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if not distributed:
        tensors = read_native_weights(source, config, full_shapes)
    else:
        tensors = _read_on_rank0(source, config, full_shapes)
    tensors = {keys[name]: t for name, t in tensors.items()}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed, strict=strict)
    set_model_state_dict(model, tensors, options=options)
    logger.info("Loaded %s model weights from %s; starting a new run at step 1", source.kind, source.path)


def _read_on_rank0(
    source: WeightsSource, config: ModelConfig, full_shapes: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """Rank 0: the native tensors; other ranks: {}. A rank-0 failure is raised on every rank (the others would
    otherwise wait in the broadcast for tensors that never come)."""
    tensors: dict[str, torch.Tensor] = {}
    failure: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            tensors = read_native_weights(source, config, full_shapes)
        except Exception as exc:
            failure[0] = str(exc) if isinstance(exc, CheckpointError) else f"rank 0 failed reading {source.path}"
            dist.broadcast_object_list(failure, src=0)
            raise
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise CheckpointError(failure[0])
    return tensors


def _check_names_and_shapes(
    foreign: dict[str, torch.Tensor], shapes: dict[str, torch.Size], table: NameTable, folder: Path
) -> None:
    for name, tensor in foreign.items():
        if is_derived(name):
            continue
        if name not in shapes:
            raise CheckpointError(f"{folder}: {name!r} is not a {table.format} weight of this model{bias_hint(name)}")
        if tensor.shape != shapes[name]:
            raise CheckpointError(
                f"{folder}: {name!r} has shape {tuple(tensor.shape)}; this model's is {tuple(shapes[name])}"
            )
    missing = sorted(shapes.keys() - foreign.keys())
    if missing:
        raise CheckpointError(f"{folder}: no {missing[0]!r} ({len(missing)} of the model's weights missing)")

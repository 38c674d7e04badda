"""Export a checkpoint's weights: safetensors, a Hugging Face folder, or InternEvo's model files.

    python -m internlm_offload.tools.export CKPT OUT.safetensors [--dtype bfloat16]
    python -m internlm_offload.tools.export CKPT OUT_DIR --hf                 # transformers, vLLM, ...
    python -m internlm_offload.tools.export CKPT OUT_DIR --internevo [--tp N | --wp N]   # back to InternEvo
    python -m internlm_offload.tools.export CKPT OUT_DIR --peft               # a LoRA run's PEFT adapter folder
    python -m internlm_offload.tools.export CKPT OUT_DIR --hf --merge         # a LoRA run's merged weights

CKPT is a run's checkpoint folder (its latest checkpoint is taken) or one `step_*` folder, written by
any world size and parallel mode: DCP reassembles the full tensors in this one process, without a
model or a process group. The weights are the fp32 masters; `--dtype` casts them on the way out.
`--hf` writes `config.json` and `model.safetensors` that `AutoModelForCausalLM.from_pretrained` loads
without remote code: a native `internlm2` run as `LlamaForCausalLM` (its architecture; the run's
tokenizer folder is copied beside it), one with experts as `Qwen3MoeForCausalLM`, `Qwen2MoeForCausalLM`
or `MixtralForCausalLM` (the native family's hf_export.family_of: the one whose fixed options it has; one
tensor per expert, as transformers saves them), a `deepseek_v3` run (a family that reads its own folder,
`Capabilities.folder_export`) as its folder's architecture (`DeepseekV3ForCausalLM`, `Glm4MoeForCausalLM`,
`Glm4MoeLiteForCausalLM`; Kimi-K2's `kimi_k2` written as `deepseek_v3`, which transformers loads without Moonshot's
remote code) under transformers' names, the router's weight and bias in fp32 whatever `--dtype`, and an
`hf_causal_lm` run as its own architecture.
`--internevo` writes InternEvo's layout of a native run (`model_tp{t}_pp0.pt` with InternEvo's names
and fused wqkv, split for `--tp` tensor-parallel ranks, or `model_wp{w}_pp0.pt` for `--wp` ISP
weight-parallel ranks), which InternEvo's `load_ckpt_info` reads; a run with experts as InternEvo's
Qwen2/3-MoE (q, k, v apart) with each sparse block's experts in `model_moe_layer{L}_expert0_tp0.pt`,
grouped as InternEvo's default `use_grouped_mlp=True` holds them (one rank). A folder is written beside OUT_DIR
and renamed into place when complete. A LoRA run's checkpoint (docs/lora.md, tools/export_lora.py) holds the
adapters: `--peft` writes them as PEFT's adapter folder, `--hf` / `--internevo` write the base the run started
from, `--merge` with the adapters folded in. Exit codes: 0 written, 2 bad input (one `error:` line).
"""

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import ValidationError
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from internlm_offload.builder.model import folder_layout
from internlm_offload.config import ModelConfig
from internlm_offload.engine.checkpoint import CheckpointError, read_train_state, resolve_checkpoint_path
from internlm_offload.engine.checkpoint_reader import read_checkpoint, read_metadata
from internlm_offload.family import capabilities, families_with, family_spec
from internlm_offload.log import get_logger
from internlm_offload.model.families.hf_causal_lm.model import text_config
from internlm_offload.model.families.hf_causal_lm.routers import BIAS
from internlm_offload.model.families.internlm2.hf_export import export_family
from internlm_offload.model.families.internlm2.hf_names import TABLES as HF_TABLES
from internlm_offload.tools.export_lora import base_weights, is_lora_run, merged, write_peft_folder
from internlm_offload.weights.convert import Heads, to_format
from internlm_offload.weights.hf_folder import (
    blocks_beyond,
    copy_tokenizer,
    read_copied_through,
    set_dtype,
    tensor_names,
    weight_files,
    write_family_folder,
    write_llama_folder,
    write_moe_folder,
)
from internlm_offload.weights.internevo_files import write_internevo_files
from internlm_offload.weights.internevo_moe import is_expert_name, write_expert_files
from internlm_offload.weights.names import INTERNEVO, INTERNEVO_MOE

MODEL_PREFIX = "model."
HF_PREFIX = "hf_model."
logger = get_logger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model tensors of a checkpoint, by parameter name."""
    metadata = read_metadata(path).state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"checkpoint {path} holds no model weights")
    read_checkpoint(path, state, no_dist=True)
    return {key.removeprefix(MODEL_PREFIX): tensor for key, tensor in state.items()}


def run_config(path: Path) -> dict:
    """The resolved config the checkpoint was written with."""
    return read_train_state(path)["config"]


def export_safetensors(
    weights: dict[str, torch.Tensor], out: Path, dtype: torch.dtype, source: Path, keep_fp32: tuple[str, ...] = ()
) -> None:
    """`keep_fp32`: names ending so stay fp32 (a router bias moves by 1e-3 a step: bf16 would round its training
    away; transformers loads it as fp32)."""
    from safetensors.torch import save_file

    tensors = {name: t.to(t.dtype if name.endswith(keep_fp32) else dtype).contiguous() for name, t in weights.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": "pt", "source": str(source)})


def export_hf(weights: dict[str, torch.Tensor], out_dir: Path, dtype: torch.dtype, run: dict) -> None:
    """A folder `AutoModelForCausalLM.from_pretrained(out_dir)` loads: a native run as Llama (plus its
    tokenizer), a family that reads its own folder as that folder, an hf_causal_lm run as its own architecture."""
    model_cfg = run["model"]
    if capabilities(model_cfg["type"]).folder_export:
        export_family_folder(weights, out_dir, dtype, run)
        return
    if capabilities(model_cfg["type"]).native_names:
        model = native_model_config(model_cfg)
        heads = Heads(model.num_attention_heads, model.num_kv_attention_heads)
        family = export_family(model)
        if model.num_experts and model.moe_type == "GShard":
            logger.warning("%s computes every routed choice: GShard's capacity drops do not carry over", family)
        tensors = to_format(weights, HF_TABLES[family], heads)
        if model.num_experts:
            write_moe_folder(tensors, model, family, out_dir, dtype, max_positions=run["data"]["seq_len"])
        else:
            write_llama_folder(tensors, model, out_dir, dtype, run["data"]["seq_len"])
        copy_tokenizer(run["data"]["tokenizer"], out_dir)
        return
    from transformers import AutoConfig

    if model_cfg.get("hf_path"):
        hf_config = AutoConfig.from_pretrained(
            model_cfg["hf_path"], local_files_only=True, trust_remote_code=model_cfg.get("trust_remote_code", False)
        )
    else:
        hf_config = AutoConfig.for_model(**model_cfg["hf_config"])
    hf_config = text_config(hf_config)  # a vision-language config's text model is what trained
    set_dtype(hf_config, dtype)
    hf_weights = {name.removeprefix(HF_PREFIX): t for name, t in weights.items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        hf_weights.pop("lm_head.weight", None)  # tied: transformers restores it from the embeddings
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out_dir))
    export_safetensors(hf_weights, out_dir / "model.safetensors", dtype, out_dir, keep_fp32=(BIAS,))


def export_family_folder(weights: dict[str, torch.Tensor], out_dir: Path, dtype: torch.dtype, run: dict) -> None:
    """The folder of a family that reads its own (`Capabilities.folder_export`): config.json from its
    `folder_config`, the tensors under the names of its `folder_format` (the table `model.hf_path` is read by; the
    multi-token-prediction layers the run trained at blocks L + k, with the copies of the shared embedding and head
    where the run's folder held them), the tensors of a part the run did not build (`FolderFormat.copied_through`: a
    vision tower) copied unchanged from the run's folder, the run's tokenizer folder beside them. A multi-token-prediction block the
    folder had and the run did not build (left out on load) is not in it: said in one line."""
    model = native_model_config(run["model"])
    layout = folder_layout(model)
    source = tensor_names(weight_files(Path(model.hf_path))) if model.hf_path else []
    built = layout.num_layers + layout.mtp_layers
    copies = {
        f"model.layers.{layout.num_layers + k}.{rest}"
        for k in range(layout.mtp_layers)
        for rest, _ in layout.mtp_copies
    }
    copied = read_copied_through(Path(model.hf_path), layout) if model.hf_path else {}
    written = write_family_folder(
        weights,
        layout,
        family_spec(model.type).module().folder_config(model),
        out_dir,
        dtype,
        mtp_copies=bool(copies) and copies <= set(source),
        copied=copied,
    )
    if copied:
        logger.info(
            "%d tensors of %s copied unchanged from %s (not trained)", len(copied), layout.copied_what, model.hf_path
        )
    copy_tokenizer(run["data"]["tokenizer"], out_dir)
    left_out = blocks_beyond(source, built)
    if left_out:
        logger.warning(
            "The export holds %d tensors (%s); %s's %d multi-token-prediction tensors (blocks from %d on, left out "
            "on load, not trained) are not in it",
            written,
            layout.table.format,
            model.hf_path,
            len(left_out),
            built,
        )


def export_internevo(
    weights: dict[str, torch.Tensor], out_dir: Path, dtype: torch.dtype, run: dict, *, tp: int, wp: int
) -> None:
    """InternEvo's model files of a native run: its names, fused wqkv, split for `tp` (or ISP's `wp`) ranks."""
    if not capabilities(run["model"]["type"]).native_names:
        raise CheckpointError(
            f"--internevo needs a run of model.type={families_with('native_names')}; this one is "
            f"{run['model']['type']!r}"
        )
    model = native_model_config(run["model"])
    if tp > 1 and not wp and model.num_kv_attention_heads % tp:
        raise CheckpointError(
            f"--tp {tp}: the model's {model.num_kv_attention_heads} kv heads do not split into {tp} ranks (InternEvo's "
            "tensor ranks hold whole kv groups of wqkv)"
        )
    heads = Heads(model.num_attention_heads, model.num_kv_attention_heads)
    if model.num_experts:
        if tp > 1 or wp:
            raise CheckpointError(
                f"--tp {tp} / --wp {wp} with model.num_experts={model.num_experts}: InternEvo's expert files are "
                "written for one rank here; export without --tp / --wp"
            )
        tensors = {name: t.to(dtype) for name, t in to_format(weights, INTERNEVO_MOE, heads).items()}
        write_internevo_files({n: t for n, t in tensors.items() if not is_expert_name(n)}, out_dir)
        write_expert_files({n: t for n, t in tensors.items() if is_expert_name(n)}, out_dir)
        return
    tensors = to_format(weights, INTERNEVO, heads)
    write_internevo_files({name: t.to(dtype) for name, t in tensors.items()}, out_dir, tp=tp, wp=wp)


def native_model_config(model_cfg: dict) -> ModelConfig:
    """The run's `model` section as the schema (the checkpoint records it resolved)."""
    try:
        return ModelConfig.model_validate(model_cfg, strict=False)
    except ValidationError as exc:
        raise CheckpointError(f"the checkpoint's model config does not validate: {exc.errors()[0]['msg']}") from None


def write_folder(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Run `write` into a new folder beside `out_dir`, then rename it into place: no half-written export."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"{out_dir} exists and is not an empty folder; choose a new output folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(staging)
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoint folder (latest taken) or a step_* folder")
    p.add_argument("out", type=Path, help="OUT.safetensors, or a folder with --hf / --internevo")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--hf", action="store_true", help="write a Hugging Face model folder")
    kind.add_argument("--internevo", action="store_true", help="write InternEvo's model files (native runs)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--tp", type=int, default=1, help="--internevo: tensor-parallel ranks to split for (mtp)")
    split.add_argument("--wp", type=int, default=0, help="--internevo: ISP weight-parallel ranks to split for")
    kind.add_argument("--peft", action="store_true", help="LoRA runs: write PEFT's adapter folder")
    p.add_argument("--merge", action="store_true", help="LoRA runs, with --hf / --internevo: fold the adapters in")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the written weights")
    args = p.parse_args(argv)
    try:
        if (args.tp != 1 or args.wp) and not args.internevo:
            raise ValueError("--tp and --wp split InternEvo's files: pass --internevo")
        if args.tp < 1 or args.wp < 0:
            raise ValueError(f"--tp={args.tp} / --wp={args.wp}: tp must be >= 1 and wp >= 0")
        if args.merge and not (args.hf or args.internevo):
            raise ValueError("--merge writes full weights: pass --hf or --internevo")
        path = resolve_checkpoint_path(args.checkpoint)
        weights = load_weights(path)
        dtype = DTYPES[args.dtype]
        run = run_config(path) if args.hf or args.internevo or args.peft or args.merge else {}
        if (args.peft or args.merge) and not is_lora_run(run):
            raise ValueError("--peft and --merge need a LoRA run's checkpoint (model.lora); this run has none")
        if (args.hf or args.internevo) and is_lora_run(run):
            # the checkpoint holds the adapters: the full weights are the base (from where the run's config names
            # it), with the adapters folded in under --merge
            base = base_weights(run, load_weights)
            weights = merged(base, weights, run) if args.merge else base
        if args.peft:
            write_folder(args.out, lambda out: write_peft_folder(weights, out, dtype, run))
        elif args.hf:
            write_folder(args.out, lambda out: export_hf(weights, out, dtype, run))
        elif args.internevo:
            write_folder(args.out, lambda out: export_internevo(weights, out, dtype, run, tp=args.tp, wp=args.wp))
        else:
            if args.out.suffix != ".safetensors":
                raise CheckpointError(f"{args.out}: the output file must end in .safetensors (or pass --hf)")
            export_safetensors(weights, args.out, dtype, path)
    except (CheckpointError, OSError, KeyError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps({"checkpoint": str(path), "out": str(args.out), "tensors": len(weights)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

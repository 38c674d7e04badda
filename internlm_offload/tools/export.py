"""Export a checkpoint's weights: one consolidated safetensors file, or a Hugging Face model folder.

    python -m internlm_offload.tools.export CKPT OUT.safetensors [--dtype bfloat16]
    python -m internlm_offload.tools.export CKPT OUT_DIR --hf            # hf_causal_lm runs only

CKPT is a run's checkpoint folder (its latest checkpoint is taken) or one `step_*` folder, written by
any world size and parallel mode: DCP reassembles the full tensors in this one process, without a
model or a process group. The weights are the fp32 masters; `--dtype` casts them on the way out.
`--hf` writes `config.json` (from the run's `model.hf_config` or `model.hf_path`) and
`model.safetensors` with Hugging Face's parameter names, which `AutoModelForCausalLM.from_pretrained`
loads. Exit codes: 0 written, 2 bad input (one `error:` line).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from internlm_offload.engine.checkpoint import CheckpointError, read_train_state, resolve_checkpoint_path
from internlm_offload.engine.checkpoint_reader import read_checkpoint, read_metadata

MODEL_PREFIX = "model."
HF_PREFIX = "hf_model."
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


def export_safetensors(weights: dict[str, torch.Tensor], out: Path, dtype: torch.dtype, source: Path) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.to(dtype).contiguous() for name, t in weights.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": "pt", "source": str(source)})


def export_hf(weights: dict[str, torch.Tensor], out_dir: Path, dtype: torch.dtype, model_cfg: dict) -> None:
    """config.json + model.safetensors that `AutoModelForCausalLM.from_pretrained(out_dir)` loads."""
    from transformers import AutoConfig

    if model_cfg["type"] != "hf_causal_lm":
        raise CheckpointError(f"--hf needs a run of model.type='hf_causal_lm'; this one is {model_cfg['type']!r}")
    if model_cfg.get("hf_path"):
        hf_config = AutoConfig.from_pretrained(
            model_cfg["hf_path"], local_files_only=True, trust_remote_code=model_cfg.get("trust_remote_code", False)
        )
    else:
        hf_config = AutoConfig.for_model(**model_cfg["hf_config"])
    hf_config.torch_dtype = dtype
    hf_weights = {name.removeprefix(HF_PREFIX): t for name, t in weights.items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        hf_weights.pop("lm_head.weight", None)  # tied: transformers restores it from the embeddings
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out_dir))
    export_safetensors(hf_weights, out_dir / "model.safetensors", dtype, out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoint folder (latest taken) or a step_* folder")
    p.add_argument("out", type=Path, help="OUT.safetensors, or a folder with --hf")
    p.add_argument("--hf", action="store_true", help="write a Hugging Face model folder (hf_causal_lm runs)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the written weights")
    args = p.parse_args(argv)
    try:
        path = resolve_checkpoint_path(args.checkpoint)
        weights = load_weights(path)
        dtype = DTYPES[args.dtype]
        if args.hf:
            export_hf(weights, args.out, dtype, run_config(path)["model"])
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

"""Hugging Face model folders of InternLM2 and Llama, and of the mixture-of-experts families in `hf_moe`:
config.json against the native model's config, and the weights in (safetensors or .bin, sharded or not) and out
(a `LlamaForCausalLM` folder, or a `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM` / `MixtralForCausalLM` one).

InternLM2's architecture is Llama's (RMSNorm, rotate-half RoPE, GQA, SwiGLU, no biases); its HF port only
fuses wq, wk, wv (see `qkv`). So a dense native model goes out as Llama, which transformers, vLLM and the rest
load without remote code, and both kinds come in.
"""

import shutil
from pathlib import Path
from typing import Any

import torch

from internlm_offload.config import ModelConfig, intermediate_size
from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.internlm2.hf_names import HF_INTERNLM2, HF_LLAMA
from internlm_offload.model.families.internlm2.names import NameTable
from internlm_offload.weights import hf_moe
from internlm_offload.weights.files import load_model_file, read_json_object

CONFIG = "config.json"
TABLES = {"internlm2": HF_INTERNLM2, "llama": HF_LLAMA, "internlm": HF_LLAMA}  # InternLM v1's port: Llama's names
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

# config.json key -> the model.* key(s) that set it here.
_SHAPE_KEYS = {
    "hidden_size": "model.hidden_size",
    "num_hidden_layers": "model.num_layers",
    "num_attention_heads": "model.num_attention_heads",
    "num_key_value_heads": "model.num_kv_attention_heads",
    "intermediate_size": "model.mlp_ratio and model.multiple_of",
    "vocab_size": "model.vocab_size",
    "rms_norm_eps": "model.norm_eps",
    "rope_theta": "model.rope_base",
    "tie_word_embeddings": "model.tie_word_embeddings",
    "attention_bias": "model.attention_bias",
}


def llama_values(model: ModelConfig) -> dict[str, Any]:
    """The config.json values (Llama's and InternLM2's keys) the native model `model` has."""
    return {
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_attention_heads,
        "intermediate_size": intermediate_size(model.hidden_size, model.mlp_ratio, model.multiple_of),
        "vocab_size": model.vocab_size,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_base,
        "tie_word_embeddings": model.tie_word_embeddings,
        "attention_bias": model.attention_bias,
    }


def native_model_values(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The `model.*` settings of the native model a config.json describes; None when its architecture is not
    the native one (another model_type, MLP biases, scaled RoPE, ...)."""
    if hf.get("model_type") not in TABLES or _unsupported(hf):
        return None
    hidden, intermediate = hf["hidden_size"], hf["intermediate_size"]
    ratio = intermediate / hidden
    # the largest rounding that gives the folder's width back from hidden_size * mlp_ratio (any width: itself)
    multiple_of = next(
        m for m in (256, 128, 64, 32, 16, 8, 1, intermediate) if intermediate_size(hidden, ratio, m) == intermediate
    )
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hidden,
        "num_attention_heads": hf["num_attention_heads"],
        "num_kv_attention_heads": _hf_value(hf, "num_key_value_heads"),
        "vocab_size": hf["vocab_size"],
        "mlp_ratio": ratio,
        "multiple_of": multiple_of,
        "norm_eps": _hf_value(hf, "rms_norm_eps"),
        "rope_base": float(_hf_value(hf, "rope_theta")),
        "tie_word_embeddings": bool(_hf_value(hf, "tie_word_embeddings")),
        "attention_bias": bool(_hf_value(hf, "attention_bias")),
    }


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG}; a Hugging Face model folder has one")
    return read_json_object(path)


def name_table(folder: Path, hf: dict[str, Any]) -> NameTable:
    """The names of the folder's architecture (config.json's model_type)."""
    model_type = hf.get("model_type")
    tables = {**TABLES, **hf_moe.TABLES}
    if model_type not in tables:
        raise CheckpointError(
            f"{folder / CONFIG}: model_type={model_type!r}; the native model loads {', '.join(tables)} folders "
            "(other architectures train as model.type='hf_causal_lm' with model.hf_path)"
        )
    return tables[model_type]


def check_config(folder: Path, hf: dict[str, Any], model: ModelConfig) -> None:
    """The folder's model must be the configured one; every difference in one line, with the key to set."""
    if hf.get("model_type") in hf_moe.TABLES:
        hf_moe.check_config(str(folder / CONFIG), hf, model)
        return
    problems = (
        [f"model.num_experts={model.num_experts} (the folder's model is dense: set 0)"] if model.num_experts else []
    )
    problems += [
        f"{key}={found!r} (set {_SHAPE_KEYS[key]} to match; it gives {wanted!r})"
        for key, wanted in llama_values(model).items()
        if (found := _hf_value(hf, key)) != wanted
    ]
    problems += _unsupported(hf)
    if problems:
        raise CheckpointError(f"{folder / CONFIG}: " + "; ".join(problems))


def _hf_value(hf: dict[str, Any], key: str) -> Any:
    """A config.json value with transformers' defaults (kv heads = heads, rope_theta 1e4, untied, eps 1e-6)."""
    if key == "rope_theta":
        return hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    if key == "attention_bias":  # InternLM2's and InternLM v1's configs call it `bias`
        return hf.get("attention_bias", hf.get("bias", False))
    if key == "num_key_value_heads":
        return hf.get(key) or hf.get("num_attention_heads")
    defaults = {"tie_word_embeddings": False, "rms_norm_eps": 1e-6}
    return hf.get(key, defaults.get(key))


def _unsupported(hf: dict[str, Any]) -> list[str]:
    """What the native model does not build: MLP biases, another activation, scaled RoPE, another head_dim."""
    problems = ["mlp_bias=True (the native model's MLP has no biases)"] if hf.get("mlp_bias") else []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (the native model's MLP is SwiGLU: silu)")
    scaling = hf.get("rope_scaling") or {}
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        problems.append(f"RoPE scaling {rope_type!r} (the native model has plain RoPE)")
    heads, hidden, head_dim = hf.get("num_attention_heads"), hf.get("hidden_size"), hf.get("head_dim")
    if head_dim is not None and heads and hidden and head_dim != hidden // heads:
        problems.append(f"head_dim={head_dim} (the native model's is hidden_size / num_attention_heads)")
    return problems


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
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    qkv_bias = model.attention_bias if model.qkv_bias is None else model.qkv_bias
    o_bias = model.attention_bias if model.o_bias is None else model.o_bias
    if qkv_bias != o_bias or model.qk_norm or model.num_experts:
        # Llama's attention_bias is on q, k, v and o alike, and it has no q/k norms or experts: its folder would
        # load without those weights (transformers drops unexpected names with a warning)
        raise CheckpointError(
            f"{out}: a LlamaForCausalLM folder cannot hold model.qkv_bias={qkv_bias} with model.o_bias={o_bias}, "
            f"model.qk_norm={model.qk_norm} or model.num_experts={model.num_experts}; export to safetensors instead"
        )
    config = LlamaConfig(
        **llama_values(model),
        head_dim=model.head_dim or model.hidden_size // model.num_attention_heads,
        max_position_embeddings=max_positions,
        hidden_act="silu",
        mlp_bias=False,
        architectures=["LlamaForCausalLM"],
    )
    set_dtype(config, dtype)
    if model.tie_word_embeddings:
        tensors = {name: t for name, t in tensors.items() if name != "lm_head.weight"}  # restored from the embeddings
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(
        {name: t.to(dtype).contiguous() for name, t in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )


def write_moe_folder(
    tensors: dict[str, torch.Tensor], model: ModelConfig, family: str, out: Path, dtype: torch.dtype, max_positions: int
) -> None:
    """config.json + model.safetensors of transformers' `family` (`hf_moe.TABLES`); `tensors` under its names, one
    per expert, as transformers' save_pretrained writes them and its from_pretrained reads them."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, **hf_moe.export_config(model, family, max_positions))
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

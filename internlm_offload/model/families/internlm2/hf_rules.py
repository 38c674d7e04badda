"""The rules a Hugging Face config.json leaves implicit, each written once: what an unset key means and what
follows from the keys (which blocks are sparse, a head's width, the attention biases, RoPE's base, an expert's width,
the shared experts), on a config.json's side (`hf`, its dict) and on the native `model` section's.

`hf_config.py` reads folders with them, `hf_export.py` writes config.json files with them, and xtuner/models.py maps
XTuner's Qwen3 classes with them. Values read off a config.json are kept as written (an int RoPE base stays one):
the messages that compare them quote the file.
"""

from collections.abc import Iterable
from typing import Any, Protocol

from internlm_offload.config import intermediate_size


class NativeKeys(Protocol):
    """The native model's keys the `model_*` rules read: a `model` section (config.ModelConfig) or the decoder's own
    arguments (args.InternLM2Args), which name them alike."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    head_dim: int | None
    attention_bias: bool
    qkv_bias: bool | None
    o_bias: bool | None
    mlp_ratio: float
    multiple_of: int
    num_experts: int
    mlp_only_layers: Any
    decoder_sparse_step: int
    dense_intermediate_size: int | None


# transformers' defaults (Llama's) of the keys a config.json may leave out.
_DEFAULTS = {"tie_word_embeddings": False, "rms_norm_eps": 1e-6}


def rope_base(hf: dict[str, Any]) -> Any:
    """RoPE's base: `rope_theta`, or transformers 5's `rope_parameters["rope_theta"]`; 1e4 (transformers' default)
    when neither."""
    return hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def rope_scaling(hf: dict[str, Any]) -> Any:
    """The RoPE scaling asked for: `rope_parameters["rope_type"]` (transformers 5), else `rope_scaling`'s `rope_type`
    (or its older `type`); None or "default" is plain RoPE."""
    scaling = hf.get("rope_scaling") or {}
    return (hf.get("rope_parameters") or {}).get("rope_type") or scaling.get("rope_type") or scaling.get("type")


def kv_heads(hf: dict[str, Any]) -> Any:
    """`num_key_value_heads`; unset (or null): one per query head."""
    return hf.get("num_key_value_heads") or hf.get("num_attention_heads")


def attention_bias(hf: dict[str, Any]) -> Any:
    """`attention_bias` (Llama's, on q, k, v and o), which InternLM2's and InternLM v1's configs call `bias`; False
    when neither."""
    return hf.get("attention_bias", hf.get("bias", False))


def hf_value(hf: dict[str, Any], key: str) -> Any:
    """A config.json's value of `key` as transformers reads it: the rules above, else the key's default."""
    rules = {"rope_theta": rope_base, "attention_bias": attention_bias, "num_key_value_heads": kv_heads}
    return rules[key](hf) if key in rules else hf.get(key, _DEFAULTS.get(key))


def head_dim(hidden: int, heads: int, given: int | None = None) -> int:
    """A head's width: `given` (Qwen3's `head_dim`, `model.head_dim`), else hidden_size / num_attention_heads."""
    return given or hidden // heads


def model_head_dim(model: NativeKeys) -> int:
    """The native model's head width (`head_dim` over `model.head_dim`)."""
    return head_dim(model.hidden_size, model.num_attention_heads, model.head_dim)


def folder_biases(hf: dict[str, Any]) -> tuple[bool, bool]:
    """(q/k/v, o) biases of a config.json: Qwen2-MoE's `qkv_bias` (True unless set) on q, k, v alone; Mixtral none;
    Qwen3-MoE's `attention_bias` on all four, as the dense formats' (`attention_bias`, which reads `bias` too)."""
    family = hf.get("model_type")
    if family == "qwen2_moe":
        return bool(hf.get("qkv_bias", True)), False
    if family == "mixtral":
        return False, False
    biased = bool(hf.get("attention_bias", False) if family == "qwen3_moe" else attention_bias(hf))
    return biased, biased


def model_biases(model: NativeKeys) -> tuple[bool, bool]:
    """(q/k/v, o) biases of the native model: `model.qkv_bias` and `model.o_bias` (InternEvo's), each
    `model.attention_bias` (Llama's) unless set."""
    qkv = model.attention_bias if model.qkv_bias is None else model.qkv_bias
    o = model.attention_bias if model.o_bias is None else model.o_bias
    return qkv, o


def sparse_blocks(num_layers: int, mlp_only_layers: Iterable[int], decoder_sparse_step: int) -> list[int]:
    """Qwen's rule: block i is sparse iff i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0."""
    dense = set(mlp_only_layers)
    return [i for i in range(num_layers) if i not in dense and (i + 1) % decoder_sparse_step == 0]


def folder_sparse_blocks(hf: dict[str, Any]) -> list[int]:
    """A mixture-of-experts config.json's sparse blocks: Mixtral's are all; Qwen's by `sparse_blocks` (no
    `mlp_only_layers` and a step of 1 unless set)."""
    layers = hf["num_hidden_layers"]
    if hf.get("model_type") == "mixtral":
        return list(range(layers))
    return sparse_blocks(layers, hf.get("mlp_only_layers") or (), hf.get("decoder_sparse_step") or 1)


def model_sparse_blocks(model: NativeKeys) -> list[int]:
    """The native model's sparse blocks: none without experts, else by `sparse_blocks` of its keys."""
    if not model.num_experts:
        return []
    return sparse_blocks(model.num_layers, model.mlp_only_layers, model.decoder_sparse_step)


def dense_blocks(num_layers: int, sparse: Iterable[int]) -> list[int]:
    """The blocks `sparse` leaves dense, in order (Qwen's `mlp_only_layers` with a step of 1)."""
    return sorted(set(range(num_layers)) - set(sparse))


def first_dense(k: int) -> list[int]:
    """`first_k_dense_replace` (DeepSeek's, XTuner's): blocks [0, k) are dense, as `mlp_only_layers`."""
    return list(range(k))


def expert_width(hf: dict[str, Any]) -> int:
    """An expert's hidden width: Mixtral's `intermediate_size` (its blocks all sparse), Qwen's `moe_intermediate_size`
    (its `intermediate_size` is the dense blocks')."""
    return hf["intermediate_size"] if hf.get("model_type") == "mixtral" else hf["moe_intermediate_size"]


def model_expert_width(model: NativeKeys) -> int:
    """The native model's expert (or dense MLP) width: hidden_size * mlp_ratio, rounded to `multiple_of`."""
    return intermediate_size(model.hidden_size, model.mlp_ratio, model.multiple_of)


def model_dense_width(model: NativeKeys) -> int:
    """A dense block's width beside sparse ones: `model.dense_intermediate_size`, the expert width unless set."""
    return model.dense_intermediate_size or model_expert_width(model)


def whole_experts(shared_width: int, width: int) -> bool:
    """Whether Qwen2-MoE's `shared_expert_intermediate_size` is a whole number of experts (the native shared expert
    is `num_shared_experts` experts wide)."""
    return shared_width % width == 0


def shared_experts(shared_width: int, width: int) -> int | float:
    """Qwen2-MoE's shared expert as a number of experts: shared_expert_intermediate_size / expert width (a fraction
    stays one, so that the comparison names it)."""
    return shared_width // width if whole_experts(shared_width, width) else shared_width / width


def mlp_width(hidden: int, width: int) -> dict[str, Any]:
    """`model.mlp_ratio` and `model.multiple_of` that give `width` back from `hidden`: the largest rounding that does
    (any width: itself)."""
    ratio = width / hidden
    multiple_of = next(m for m in (256, 128, 64, 32, 16, 8, 1, width) if intermediate_size(hidden, ratio, m) == width)
    return {"mlp_ratio": ratio, "multiple_of": multiple_of}

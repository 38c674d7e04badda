"""Qwen3-Next's Hugging Face names against the native ones (name_table.NameTable): the Gated DeltaNet's under
their own names (its conv as `conv_weight`), the gated attention's, the router, the experts one tensor each on disk
(stacked here) and the gated shared expert; the folder's multi-token prediction (`mtp.*`) by the DeepSeek-V3
family's MTP names (`mtp_table`) once renamed blocks past the stack (`mtp_in` / `mtp_out`)."""

import re

import torch

from internlm_offload.model.families.deepseek_v3.hf_names import mtp_table
from internlm_offload.model.mtp import MTP_PREFIX
from internlm_offload.model.name_table import NameTable

MTP = "mtp."  # the released folders' multi-token-prediction layers, which transformers does not read

_SWIGLU = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
_LAYER = "model.layers.{i}"
# Qwen3-Next's fused projections and Qwen3.5's split ones: a folder holds one set
_FUSED = "in_proj_qkvz.weight", "in_proj_ba.weight"
_SPLIT = "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"
_LINEAR = *_FUSED, *_SPLIT, "out_proj.weight", "A_log", "dt_bias", "norm.weight"

HF_QWEN3_NEXT = NameTable(
    "hf (qwen3_next / qwen3_5_text / qwen3_5_moe_text)",
    (
        ("model.embed_tokens.weight", "tok_embeddings.weight"),
        (f"{_LAYER}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
        (f"{_LAYER}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
        *((f"{_LAYER}.linear_attn.{n}", f"layers.{{i}}.attention.{n}") for n in _LINEAR),
        (f"{_LAYER}.linear_attn.conv1d.weight", "layers.{i}.attention.conv_weight"),
        *(
            (f"{_LAYER}.self_attn.{hf}_proj.weight", f"layers.{{i}}.attention.{ours}.weight")
            for hf, ours in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo"))
        ),
        *((f"{_LAYER}.self_attn.{n}.weight", f"layers.{{i}}.attention.{n}.weight") for n in ("q_norm", "k_norm")),
        *((f"{_LAYER}.mlp.{hf}.weight", f"layers.{{i}}.feed_forward.{ours}.weight") for hf, ours in _SWIGLU),
        (f"{_LAYER}.mlp.gate.weight", "layers.{i}.feed_forward.router.weight"),
        *((f"{_LAYER}.mlp.experts.*.{hf}.weight", f"layers.{{i}}.feed_forward.experts.{ours}") for hf, ours in _SWIGLU),
        *(
            (f"{_LAYER}.mlp.shared_expert.{hf}.weight", f"layers.{{i}}.feed_forward.shared_experts.{ours}.weight")
            for hf, ours in _SWIGLU
        ),
        (f"{_LAYER}.mlp.shared_expert_gate.weight", "layers.{i}.feed_forward.coefficient.weight"),
        ("model.norm.weight", "norm.weight"),
        ("lm_head.weight", "output.weight"),
    ),
)


# The folder's multi-token prediction (`mtp.*`, which transformers does not read): one `fc` and three norms around its
# layers `mtp.layers.{k}`. On a read they are renamed blocks past the stack (`mtp_in`: layer k as block L + k, the
# four around it in block L), which weights/hf_folder.py reads as MTP layer k (`HF_QWEN3_NEXT_MTP`); `mtp_out`
# renames them back on a write.
_MTP_OWN = {
    "fc.weight": "eh_proj",
    "pre_fc_norm_embedding.weight": "enorm",
    "pre_fc_norm_hidden.weight": "hnorm",
    "norm.weight": "head_norm",
}
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")
HF_QWEN3_NEXT_MTP = mtp_table(
    HF_QWEN3_NEXT,
    own=tuple(
        (f"{_LAYER}.{foreign}", f"{MTP_PREFIX}layers.{{i}}.{native}.weight") for foreign, native in _MTP_OWN.items()
    ),
)


def mtp_in(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A folder's tensors (or a piece of them) with its `mtp.*` ones renamed blocks past the stack: `mtp.layers.{k}.X`
    as `model.layers.{L + k}.X`, `mtp.fc` and the three norms inside block L (an unknown `mtp.*` name kept: the read
    names it)."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(MTP) and (rest := name[len(MTP) :]) in _MTP_OWN:
            name = f"model.layers.{num_layers}.{rest}"
        elif (m := _MTP_LAYER.match(name)) is not None:
            name = f"model.layers.{num_layers + int(m.group(1))}.{name[m.end() :]}"
        out[name] = tensor
    return out


def mtp_out(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """`mtp_in`'s inverse: blocks at or past L (the MTP layers an export writes) back under `mtp.`; ValueError for a
    second layer's fc or norms (the folder holds one set: build.check_run refuses more than one physical layer)."""
    out = {}
    for name, tensor in tensors.items():
        m = _BLOCK.match(name)
        if m is not None and (k := int(m.group(1)) - num_layers) >= 0:
            rest = name[m.end() :]
            if rest in _MTP_OWN and k:
                raise ValueError(f"{name}: a Qwen3-Next folder holds one mtp.{rest} (MTP layer 0's)")
            name = f"{MTP}{rest}" if rest in _MTP_OWN else f"{MTP}layers.{k}.{rest}"
        out[name] = tensor
    return out

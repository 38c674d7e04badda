"""Qwen3-Next's Hugging Face names against the native ones (name_table.NameTable): the Gated DeltaNet's under
their own names (its conv as `conv_weight`), the gated attention's, the router, the experts one tensor each on disk
(stacked here) and the gated shared expert."""

import logging

import torch

from internlm_offload.model.name_table import NameTable

logger = logging.getLogger(__name__)
MTP = "mtp."  # the released folders' multi-token-prediction layer, which transformers does not read either

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


def drop_mtp(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A folder's tensors (or a piece of them) without the `mtp.*` ones, said in one line: multi-token prediction is
    not built for this family (transformers ignores them too), so an export leaves them out."""
    dropped = [name for name in tensors if name.startswith(MTP)]
    if dropped:
        logger.warning(
            "%d mtp.* tensors of the folder are not read: multi-token prediction is not built for qwen3_next (an "
            "--hf export leaves them out)",
            len(dropped),
        )
    return {name: tensor for name, tensor in tensors.items() if not name.startswith(MTP)}

"""GPT-OSS's Hugging Face names against the native ones (name_table.NameTable), and the experts' re-layout both ways.

transformers holds each block's experts as `mlp.experts.gate_up_proj` (E, D, 2I), its columns gate and up
**interleaved** (gate = [..., 0::2], up = [..., 1::2]), `down_proj` (E, I, D), both (in, out), and their biases
`gate_up_proj_bias` (E, 2I, interleaved alike) and `down_proj_bias` (E, D). The native experts (model/experts.py)
hold w1, w3 (E, I, D), w2 (E, D, I) and b1, b3, b2. `read_experts` splits and transposes into the intermediate names
the table maps (`*_linear`, `*_bias_half`); `write_experts` puts them back. Only slicing, transposes and copies: a
round trip is bit for bit.
"""

import torch

from internlm_offload.model.families.gpt_oss.mxfp4 import dequantize_folder
from internlm_offload.model.name_table import NameTable

_LAYER = "model.layers.{i}"
_EXPERTS = f"{_LAYER}.mlp.experts"
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"

HF_GPT_OSS = NameTable(
    "hf (gpt_oss)",
    (
        ("model.embed_tokens.weight", "tok_embeddings.weight"),
        (f"{_LAYER}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
        (f"{_LAYER}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
        *(
            (f"{_LAYER}.self_attn.{hf}_proj.{kind}", f"layers.{{i}}.attention.{ours}.{kind}")
            for hf, ours in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo"))
            for kind in ("weight", "bias")
        ),
        (f"{_LAYER}.self_attn.sinks", "layers.{i}.attention.sinks"),
        (f"{_LAYER}.mlp.router.weight", "layers.{i}.feed_forward.router.weight"),
        (f"{_LAYER}.mlp.router.bias", "layers.{i}.feed_forward.router.bias"),
        (f"{_EXPERTS}.gate_linear", "layers.{i}.feed_forward.experts.w1"),
        (f"{_EXPERTS}.up_linear", "layers.{i}.feed_forward.experts.w3"),
        (f"{_EXPERTS}.down_linear", "layers.{i}.feed_forward.experts.w2"),
        (f"{_EXPERTS}.gate_bias_half", "layers.{i}.feed_forward.experts.b1"),
        (f"{_EXPERTS}.up_bias_half", "layers.{i}.feed_forward.experts.b3"),
        (f"{_EXPERTS}.down_proj_bias", "layers.{i}.feed_forward.experts.b2"),
        ("model.norm.weight", "norm.weight"),
        ("lm_head.weight", "output.weight"),
    ),
)


def read_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A folder's tensors (or a piece of them) with MXFP4 pairs dequantised and the experts in the native layout
    under the table's intermediate names; everything else as it is."""
    out = {}
    for name, tensor in dequantize_folder(tensors).items():
        if name.endswith(GATE_UP):
            stem = name.removesuffix("gate_up_proj")
            out[stem + "gate_linear"] = tensor[..., 0::2].transpose(1, 2).contiguous()
            out[stem + "up_linear"] = tensor[..., 1::2].transpose(1, 2).contiguous()
        elif name.endswith(GATE_UP + "_bias"):
            stem = name.removesuffix("gate_up_proj_bias")
            out[stem + "gate_bias_half"], out[stem + "up_bias_half"] = tensor[:, 0::2], tensor[:, 1::2]
        elif name.endswith(DOWN):
            out[name.removesuffix("down_proj") + "down_linear"] = tensor.transpose(1, 2).contiguous()
        else:
            out[name] = tensor
    return out


def write_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `read_experts` (without quantising: the experts are written as floats)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("experts.gate_linear"):
            stem = name.removesuffix("gate_linear")
            up = tensors[stem + "up_linear"]
            gate_up = tensor.new_empty(tensor.shape[0], tensor.shape[2], 2 * tensor.shape[1])
            gate_up[..., 0::2], gate_up[..., 1::2] = tensor.transpose(1, 2), up.transpose(1, 2)
            out[stem + "gate_up_proj"] = gate_up
        elif name.endswith("experts.gate_bias_half"):
            stem = name.removesuffix("gate_bias_half")
            up = tensors[stem + "up_bias_half"]
            bias = tensor.new_empty(tensor.shape[0], 2 * tensor.shape[1])
            bias[:, 0::2], bias[:, 1::2] = tensor, up
            out[stem + "gate_up_proj_bias"] = bias
        elif name.endswith("experts.down_linear"):
            out[name.removesuffix("down_linear") + "down_proj"] = tensor.transpose(1, 2).contiguous()
        elif not name.endswith(("experts.up_linear", "experts.up_bias_half")):
            out[name] = tensor
    return out

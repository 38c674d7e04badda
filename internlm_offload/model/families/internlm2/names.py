"""The native decoder's parameter names, which other formats' `model/name_table.NameTable`s map to.

The native names are `InternLM2.state_dict()`'s; `layers.{i}.attention.wqkv.weight` (and `.bias`) is the one name that is not native: the
fused projection that `weights/qkv.split_wqkv` turns into wq, wk, wv. A table may name weights a given model lacks
(the attention biases); the model's own state dict decides which are expected.

The tables themselves: Hugging Face's in `hf_names.py` (this family's Hugging Face side), InternEvo's and Meta's in
`weights/names.py`.
"""

FUSED_WQKV = ("layers.{i}.attention.wqkv.weight", "layers.{i}.attention.wqkv.bias")
BLOCK = (
    "layers.{i}.attention.wo.weight",
    "layers.{i}.attention_norm.weight",
    "layers.{i}.ffn_norm.weight",
    "layers.{i}.feed_forward.w1.weight",
    "layers.{i}.feed_forward.w2.weight",
    "layers.{i}.feed_forward.w3.weight",
)
SEPARATE_QKV = tuple(f"layers.{{i}}.attention.{w}.weight" for w in ("wq", "wk", "wv"))
ATTENTION_BIASES = tuple(f"layers.{{i}}.attention.{w}.bias" for w in ("wq", "wk", "wv"))
WO_BIAS = "layers.{i}.attention.wo.bias"
QK_NORMS = tuple(f"layers.{{i}}.attention.{n}.weight" for n in ("q_norm", "k_norm"))
ENDS = ("tok_embeddings.weight", "norm.weight", "output.weight")

"""Model weights in and out of other trainers' formats: InternEvo's model files, Hugging Face and Meta folders.

Every reader ends in the native model's parameter names with full (unsharded) tensors; every writer starts
from them. The pieces, each usable alone:
- `names`: InternEvo's and Meta's name tables (foreign name <-> native name; Hugging Face's are the native family's,
  model/families/internlm2/hf_names.py);
- `qkv`: the attention projections' foreign layouts (InternLM2's fused wqkv, Meta's interleaved RoPE rows);
- `shards`: tensor-parallel pieces merged into full tensors and split back out;
- `safe_pickle`: pickles unpickled as data, never code (also the engine's checkpoint reader's);
- `files`: one foreign file read as data (a state dict of tensors, a JSON object) or one line naming it;
- `internevo_files`, `hf_folder`, `meta_llama`: one format's files each;
- `sources`: which format a `ckpt.load_ckpt_info` names, and loading it into a built model (read on rank 0,
  broadcast to the others).
"""

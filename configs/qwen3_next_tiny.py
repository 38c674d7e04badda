# A tiny Qwen3-Next on the native family (model/families/qwen3_next; docs/qwen3_next.md), built from a config dict
# (nothing downloaded; with a Hugging Face folder give model.hf_path instead): 4 blocks, three Gated DeltaNet
# (linear attention: causal conv, chunked gated delta rule, gated output norm) then one gated full attention (per-head
# output gate, zero-centred q/k norms, RoPE on a quarter of each head), every block 8 experts (top-2, renormalised)
# beside a sigmoid-gated shared expert. seq_len 128: two chunks of the delta rule per document.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "qwen3_next_tiny"
model = dict(
    _delete_=True,
    type="qwen3_next",
    hf_config=dict(
        model_type="qwen3_next",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=259,
        max_position_embeddings=4096,
    ),
    dtype="torch.float32",
    checkpoint=0.0,
)

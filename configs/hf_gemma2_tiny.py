# A tiny Gemma2 (built from a config dict, nothing downloaded). Gemma2 refuses sdpa attention in
# transformers: model.attn_impl="auto" picks eager and says so in the log.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "hf_gemma2_tiny"
model = dict(
    _delete_=True,
    type="hf_causal_lm",
    hf_config=dict(
        model_type="gemma2",
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=259,
    ),
    attn_impl="auto",
    dtype="torch.float32",
    checkpoint=0.0,
)

# A tiny GPT-OSS on the native family (model/families/gpt_oss; docs/gpt_oss.md), built from a config dict (nothing
# downloaded; with a Hugging Face folder, its MXFP4 release included, give model.hf_path instead): attention with
# q/k/v/o biases and one learned sink per head, sliding-window layers (a 32-token window here, 128 in the release)
# alternating with full ones (config.json's layer_types; transformers' default: even layers slide), YaRN RoPE, and in
# every block 8 experts with biases and the clamped SwiGLU, chosen by the router with a bias (top-2 of the raw logits,
# softmax over the 2). seq_len 128 > the window: the sliding layers mask what they should.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "gpt_oss_tiny"
model = dict(
    _delete_=True,
    type="gpt_oss",
    hf_config=dict(
        model_type="gpt_oss",
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=32,
        vocab_size=259,
        max_position_embeddings=4096,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=1024,
        ),
    ),
    dtype="torch.float32",
    checkpoint=0.0,
)

# A tiny InternLM2-style decoder: trains 100+ steps on 2 CPU cores in a few minutes.
model = dict(
    type="internlm2",
    num_layers=4,
    hidden_size=128,
    num_attention_heads=4,
    num_kv_attention_heads=2,
    mlp_ratio=8 / 3,
    vocab_size=259,  # the byte tokenizer's 256 bytes + bos/eos/pad
    dtype="torch.float32",
    checkpoint=0.0,
)

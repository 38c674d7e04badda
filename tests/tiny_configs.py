"""Tiny model configs the unit tests share (import as `from tiny_configs import ...`; tests/ is on the path)."""

# A Hugging Face Llama config.json small enough for a test step in milliseconds; override `vocab_size` and the rest.
TINY_HF_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 259,
}

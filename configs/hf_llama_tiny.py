# A Hugging Face causal LM (built from a config dict, nothing downloaded) trained with the same keys.
# For your own model use `hf_path="/path/to/local/model"` instead of `hf_config`.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "hf_llama_tiny"
model = dict(
    _delete_=True,
    type="hf_causal_lm",
    hf_config=dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=259,
        tie_word_embeddings=False,
    ),
    dtype="torch.float32",
    checkpoint=0.0,
)

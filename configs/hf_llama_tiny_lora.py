# LoRA on a Hugging Face Llama (docs/lora.md): PEFT's adapters on the attention projections of `hf_llama_tiny`,
# the base frozen in bf16. For your own model set `model.hf_path="/path/to/local/model"` in place of `hf_config`;
# `tools.export --peft` then writes an adapter folder that `PeftModel.from_pretrained` loads on that folder.
_base_ = ["./hf_llama_tiny.py"]
JOB_NAME = "hf_llama_tiny_lora"
model = dict(
    dtype="torch.bfloat16",
    lora=dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
)
adam = dict(lr=1e-3, weight_decay=0.0)

# LoRA on the tiny InternLM2 (docs/lora.md): PEFT's adapters on every attention and MLP projection, the base frozen
# in bf16 (no gradient, no master, no optimizer state), the adapters with fp32 masters and AdamW states. The base
# here is the seeded init; fine-tune a trained one with `ckpt.load_ckpt_info` (this trainer's checkpoint, an HF
# Llama folder or InternEvo files), or use `model.type="hf_causal_lm"` with `model.hf_path`.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "internlm2_tiny_lora"
model = dict(
    dtype="torch.bfloat16",
    lora=dict(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
)
adam = dict(lr=1e-3, weight_decay=0.0)

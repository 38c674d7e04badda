# Template: train a Hugging Face causal LM from a local folder, bf16 compute with fp32 masters, FSDP2:
#   torchrun --nproc_per_node=8 train.py --config configs/hf_template_bf16.py \
#       --cfg-options model.hf_path=/models/my-model data.tokenizer=/models/my-model data.paths=[/data/train]
# Nothing is downloaded: hf_path must be a local directory (config.json + weights).
JOB_NAME = "hf_template_bf16"
seed = 1024
deterministic = False
device = "cuda"

model = dict(
    type="hf_causal_lm",
    hf_path="/path/to/local/model",
    trust_remote_code=False,  # True for checkpoints that ship their own modelling code (InternLM2)
    attn_impl="auto",  # sdpa, or eager where the architecture refuses sdpa; "flash" for flash_attention_2
    dtype="torch.bfloat16",  # compute dtype; the weights load in fp32 and stay fp32 as masters
    checkpoint=1.0,  # fine-tuning a large model: recompute every block, keep only block inputs
)
mixed_precision = dict(master_weights=True)

data = dict(
    type="text",
    paths=["/path/to/train"],
    tokenizer="/path/to/local/model",
    seq_len=4096,
    micro_bsz=1,
    global_bsz=64,
    total_steps=2000,
)

adam = dict(lr=2e-5, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.0)
lr_scheduler = dict(warmup_ratio=0.03, eta_min=2e-6)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
parallel = dict(mode="fsdp2", reshard_after_forward=True)

# ---- memory features (see configs/internlm2_7b.py for what each costs) ----
cpu_offloading = dict(enable=False, num_layers=0)  # with checkpoint=1.0 only block inputs remain to offload
swap_optimizer = False  # AdamW states on the host, swapped in during step()
swap_optimizer_times = 16
hybrid_optimizer = dict(enable=False, offload_fraction=0.5)

ckpt = dict(checkpoint_every=200, keep_last=2, auto_resume=True)
monitor = dict(log_every=10, progress_bar="off")

# InternLM2-7B shape, bf16 compute with fp32 masters, FSDP2 over 8 GPUs:
#   torchrun --nproc_per_node=8 train.py --config configs/internlm2_7b.py
# Set data.paths and data.tokenizer (a local InternLM2 tokenizer folder) first. Nothing here is
# downloaded. Per-rank memory below is for 8 ranks of 80 GB (7.74e9 parameters, AdamW).
JOB_NAME = "internlm2_7b"
seed = 1024
deterministic = False  # bitwise reproducibility costs throughput at this size; keep True to debug
device = "cuda"

model = dict(
    type="internlm2",
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_kv_attention_heads=8,
    mlp_ratio=3.5,  # 14336 = 3.5 * 4096, already a multiple of 256
    multiple_of=256,
    vocab_size=92544,
    norm_eps=1e-5,
    rope_base=1000000.0,
    dtype="torch.bfloat16",  # compute dtype; masters and AdamW states stay fp32 (mixed_precision below)
    attn_impl="auto",  # flash-attn when installed
    # Activation checkpointing: fraction of the 32 blocks recomputed in backward. At seq_len 4096 and
    # micro_bsz 1 a block saves ~0.6 GB of bf16 activations with flash attention (~18 GB for all 32);
    # 1.0 keeps only block inputs (~1 GB) for ~33 % more compute.
    checkpoint=0.0,
)
mixed_precision = dict(master_weights=True)  # False: pure bf16, 8 B/param instead of 16 (loses small updates)

data = dict(
    type="text",
    paths=["data/train"],  # .txt/.jsonl files or folders of them
    tokenizer="tokenizers/internlm2",  # a local Hugging Face tokenizer folder
    seq_len=4096,
    micro_bsz=1,
    global_bsz=256,  # 1M tokens per step; micro_num is derived per world size (32 on 8 ranks)
    total_steps=50000,
)

adam = dict(lr=3e-4, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1)
lr_scheduler = dict(warmup_ratio=0.01, eta_min=3e-5)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)

# FSDP2 over the 8 ranks: fp32 shards are the masters (3.9 GB/rank), fp32 grads (3.9 GB/rank),
# AdamW states (7.7 GB/rank): ~15.5 GB/rank of model state before activations. The memory planner
# predicts a 45.2 GiB device peak per rank as configured here (python -m internlm_offload.tools.plan
# --config configs/internlm2_7b.py --world-size 8; add --device-memory 24GiB to have it choose knobs).
parallel = dict(mode="fsdp2", reshard_after_forward=True, fsdp_cpu_offload=False)

# ---- memory features, off by default; each trades device memory for time ----
# Activation offload: saved activations of the first N blocks go to pinned host memory during forward
# (~0.49 GB per block per micro-batch at this shape) and come back, prefetched, in backward.
cpu_offloading = dict(enable=False, num_layers=0, mode="async", prefetch_layers=1, pin_memory=True)
selective_checkpoint = False  # checkpointed blocks keep matmul/attention outputs, recompute the rest
selective_checkpoint_offload = False  # and send what they keep to host memory
# Swap optimizer: AdamW states (7.7 GB/rank) live on the host, 1/swap_optimizer_times of them visit the
# device at a time inside step(); costs two host transfers of the states per step.
swap_optimizer = False
swap_optimizer_times = 16
use_pinned_optimizer_offload = False  # True pins their host slab: copies overlap on a GPU
# Hybrid optimizer: the first offload_fraction of the parameters are stepped by AdamW on the CPU.
hybrid_optimizer = dict(enable=False, offload_fraction=0.5)

ckpt = dict(checkpoint_every=500, keep_last=3, auto_resume=True)
monitor = dict(log_every=10, progress_bar="off")
max_skipped_steps = 20

# InternEvo's combined plan with 4 blocks: block 0 offloaded, block 1 selectively checkpointed
# (int(4 * 0.5) = 2 blocks under checkpointing, minus the offloaded one), blocks 2-3 plain.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "internlm2_tiny_ckpt_offload"
model = dict(checkpoint=0.5)
selective_checkpoint = True
cpu_offloading = dict(enable=True, num_layers=1)

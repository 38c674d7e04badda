# Everything at once: activation offload of block 0, selective checkpointing of blocks 1-2 with the kept
# matmul/attention outputs on the host, swap optimizer with its states in one coalesced host arena.
# Still bitwise the baseline's loss curve.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "internlm2_tiny_all_offload"
model = dict(checkpoint=0.75)
selective_checkpoint = True
selective_checkpoint_offload = True
cpu_offloading = dict(enable=True, num_layers=1)
swap_optimizer = True
swap_optimizer_times = 4
use_pinned_optimizer_offload = True

# Seeds, determinism, parallelism, checkpoints, logging. The memory features stay off here:
# configs that enable them inherit this file and override one section.
seed = 1024
deterministic = True
device = "auto"
# parallel.mode is left to its default ("none"): a `parallel.tensor` / `parallel.weight` section given without a mode
# then takes the wrapper InternEvo picks for it (isp: DDP, or FSDP2 with weight parallel), named in the start-up log.
ckpt = dict(checkpoint_every=50, keep_last=2, auto_resume=False)
monitor = dict(log_every=10, progress_bar="auto")
cpu_offloading = dict(enable=False, num_layers=0)
selective_checkpoint = False
selective_checkpoint_offload = False
swap_optimizer = False
swap_optimizer_times = 16
use_pinned_optimizer_offload = False
hybrid_optimizer = dict(enable=False, offload_fraction=0.5)

# Activation offload of the first 3 of 4 blocks: their saved activations live in host memory
# between forward and backward. The loss curve is bitwise the one of internlm2_tiny.py.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "internlm2_tiny_act_offload"
cpu_offloading = dict(enable=True, num_layers=3, mode="async", min_offload_bytes=1024, prefetch_layers=1)

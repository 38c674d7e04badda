# Hybrid optimizer: half of the parameter elements are stepped by a fused AdamW on the CPU (grads go
# D2H, updated params H2D, overlapped), the rest on the device. On a CPU-only run both sides use the
# same kernel, so the loss curve is bitwise the baseline's.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "internlm2_tiny_hybrid"
hybrid_optimizer = dict(enable=True, offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=True)

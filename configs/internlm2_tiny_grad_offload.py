# Gradient offload (ZeRO-Offload's schedule): each gradient goes to host memory as backward produces it
# and is accumulated there in fp32; the hybrid optimizer steps every parameter on the CPU from those host
# gradients, so the device holds the model's parameters and activations only. Bitwise = baseline.
_base_ = ["./internlm2_tiny.py"]
JOB_NAME = "internlm2_tiny_grad_offload"
hybrid_optimizer = dict(enable=True, offload_fraction=1.0)
grad_offload = True
grad_offload_bucket_mb = 0.25  # the tiny model's gradients are 3.3 MiB: several buckets per backward

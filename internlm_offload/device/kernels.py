"""Which fused kernels a device has: the one place model code asks before it takes a device-specific path."""

import torch

# torch's grouped GEMM reads its operands with 16-byte aligned strides (torch 2.13, cpu and cuda).
GROUPED_MM_ALIGN_BYTES = 16


def has_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.nn.functional.grouped_mm` runs forward and backward for `dtype` on `device`.

    cpu: fp32 and bf16 (checked on torch 2.13); cuda: bf16 on SM 8.0 or newer (torch's documented range); meta:
    bf16; anything else (npu, fp16, older GPUs): no.
    """
    if not hasattr(torch.nn.functional, "grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if device.type == "meta":  # torch 2.13's meta kernel (shape inference, the planner's trace) takes bf16 only
        return dtype == torch.bfloat16
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return False


def grouped_mm_aligned(dtype: torch.dtype, *dims: int) -> bool:
    """Whether rows of each width in `dims` start on 16-byte boundaries, as the grouped GEMM requires."""
    size = torch.empty((), dtype=dtype).element_size()
    return all(dim * size % GROUPED_MM_ALIGN_BYTES == 0 for dim in dims)

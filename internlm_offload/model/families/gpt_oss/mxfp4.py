"""GPT-OSS's MXFP4 expert weights (the official release's format) dequantised to floats on load.

A quantised `{proj}` (gate_up_proj or down_proj) is stored as `{proj}_blocks` uint8 (E, out, in / 32, 16), two
FP4 e2m1 values per byte, low nibble first, and `{proj}_scales` uint8 (E, out, in / 32), one E8M0 exponent (bias
127) per block of 32 values. The value is e2m1(nibble) * 2^(scale - 127); the result is transposed to the float
layout (E, in, out) of `{proj}`. Every such value is exact in bf16 and fp32 (a 2-bit mantissa times a power of 2),
so the dequantised tensor, and an export of it in bf16, is exact.
"""

import torch

BLOCKS, SCALES = "_blocks", "_scales"
# e2m1: sign bit 3, then 2 exponent bits and 1 mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
EXPONENT_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(E, in, out) floats of MXFP4 `blocks` (E, out, G, 16) uint8 and `scales` (E, out, G) uint8, in = 32 G."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype}: "
            "want uint8 (E, out, G, 16) and uint8 (E, out, G)"
        )
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # (E, out, G, 32): low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - EXPONENT_BIAS)
    return values.flatten(-2).transpose(1, 2).contiguous().to(dtype)  # (E, in, out)


def dequantize_folder(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The folder's tensors with every `{proj}_blocks` / `{proj}_scales` pair replaced by the float `{proj}`; a
    lone half of a pair is an error naming it."""
    out = {name: t for name, t in tensors.items() if not name.endswith((BLOCKS, SCALES))}
    for name, blocks in tensors.items():
        if not name.endswith(BLOCKS):
            continue
        stem = name.removesuffix(BLOCKS)
        if stem + SCALES not in tensors:
            raise ValueError(f"{name!r} has no {stem + SCALES!r}: an MXFP4 tensor needs both")
        out[stem] = dequantize(blocks, tensors[stem + SCALES])
    lone = [n for n in tensors if n.endswith(SCALES) and n.removesuffix(SCALES) + BLOCKS not in tensors]
    if lone:
        raise ValueError(f"{lone[0]!r} has no {lone[0].removesuffix(SCALES) + BLOCKS!r}: an MXFP4 tensor needs both")
    return out


def piece_key(name: str) -> str:
    """The folder piece a tensor is read with: a pair's blocks and scales together (under the float name)."""
    return name.removesuffix(BLOCKS).removesuffix(SCALES)

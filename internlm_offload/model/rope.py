"""Rotary position embeddings: the frequencies, the (cos, sin) of positions, and the rotate-half rotation."""

import torch


def rope_inv_freq(dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies 1 / base^(2i/d) for i in [0, d/2), in float32."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (base**exponents)


def float32_inv_freq(inv_freq: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """`inv_freq` in float32: model.to(bf16) casts buffers, and bf16 frequencies skew long-T angles."""
    if inv_freq.dtype == torch.float32:
        return inv_freq
    return rope_inv_freq(dim, base, inv_freq.device)


def rope_cos_sin(
    inv_freq: torch.Tensor, seq_len: int, dtype: torch.dtype, position_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) for positions 0..T-1, each (T, D), or for `position_ids` (B, T), each (B, T, D); D = 2 x the
    frequencies. Computed in float32 (`inv_freq` must be: bf16 frequencies skew long-T angles), cast to `dtype`."""
    if position_ids is None:
        positions = torch.arange(seq_len, dtype=torch.float32, device=inv_freq.device)
    else:
        positions = position_ids.to(inv_freq.device, torch.float32)
    freqs = positions[..., None] * inv_freq  # (..., T, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (..., T, D): rotate-half pairs dim i with i + D/2
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map the two halves (x1, x2) of the last dim to (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by the per-position angles cos, sin: (T, D), or (B, T, D) for per-row positions."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B or 1, T, 1, D) broadcasts over heads
    return x * cos + rotate_half(x) * sin

"""Rotary position embeddings: the frequencies (plain and YaRN), the (cos, sin) of positions, and the rotations
(rotate-half, interleaved pairs, partial).

Every rotation takes the (cos, sin) of `rope_cos_sin`, whose last dim D holds each pair's angle twice
([angles | angles]), and rotates D dims of each head.
"""

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

# Makes a decoder's float32 inverse frequencies from (rope_dim, rope_base, device): `rope_inv_freq`, or a scaled
# variant with its parameters bound (`functools.partial(yarn_inv_freq, factor=...)`).
InvFreqFn = Callable[[int, float, torch.device | None], torch.Tensor]


def rope_inv_freq(dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies 1 / base^(2i/d) for i in [0, d/2), in float32."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (base**exponents)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when the context is not stretched)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(
    factor: float,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
) -> float:
    """What YaRN multiplies cos and sin by (transformers' `_compute_yarn_parameters`): an explicit
    `attention_factor`, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (DeepSeek:
    1 when they are equal), else mscale(factor)."""
    if attention_factor is not None:
        return attention_factor
    if mscale and mscale_all_dim:
        return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
    return yarn_get_mscale(factor)


def yarn_inv_freq(
    dim: int,
    base: float,
    device: torch.device | None = None,
    *,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN's float32 inverse frequencies (transformers' `_compute_yarn_parameters`): the high frequencies kept,
    the low ones divided by `factor`, a linear ramp between the dims that turn `beta_fast` and `beta_slow` times
    over the original context."""

    def correction_dim(rotations: float) -> float:
        """The dim whose frequency turns `rotations` times over the original context."""
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width 0 divides by 0
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    extrapolation = 1 - ramp  # 1 where the frequency is kept, 0 where it is interpolated
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_from_parameters(rope_parameters: Mapping[str, Any], max_position_embeddings: int) -> tuple[InvFreqFn, float]:
    """The inverse-frequency maker and the cos/sin attention factor of a transformers `rope_parameters` dict
    (rope_type "default" or "yarn"); ValueError for another rope type."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        return rope_inv_freq, 1.0
    if rope_type != "yarn":
        raise ValueError(f"rope_type={rope_type!r}: only 'default' and 'yarn' are supported")
    original = rope_parameters["original_max_position_embeddings"]
    # DeepSeek-V3 may leave `factor` out: the ratio of the context lengths then
    factor = rope_parameters.get("factor") or max_position_embeddings / original
    inv_freq_fn = functools.partial(
        yarn_inv_freq,
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=rope_parameters.get("beta_fast") or 32.0,
        beta_slow=rope_parameters.get("beta_slow") or 1.0,
        truncate=rope_parameters.get("truncate", True),
    )
    factors = (rope_parameters.get(k) for k in ("mscale", "mscale_all_dim", "attention_factor"))
    return inv_freq_fn, yarn_attention_factor(factor, *factors)


def softmax_mscale(rope_parameters: Mapping[str, Any]) -> float:
    """The factor whose square multiplies an MLA softmax scale (transformers' `yarn_apply_mscale`):
    mscale(factor, mscale_all_dim) for a scaled rope with `mscale_all_dim` set, else 1."""
    if rope_parameters.get("rope_type", "default") == "default":
        return 1.0
    mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
    return yarn_get_mscale(rope_parameters["factor"], mscale_all_dim) if mscale_all_dim else 1.0


def float32_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, make: InvFreqFn = rope_inv_freq) -> torch.Tensor:
    """`inv_freq` in float32: model.to(bf16) casts buffers, and bf16 frequencies skew long-T angles; `make` remakes
    them as the model made them."""
    if inv_freq.dtype == torch.float32:
        return inv_freq
    return make(dim, base, inv_freq.device)


def rope_cos_sin(
    inv_freq: torch.Tensor,
    seq_len: int,
    dtype: torch.dtype,
    position_ids: torch.Tensor | None = None,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) for positions 0..T-1, each (T, D), or for `position_ids` (B, T), each (B, T, D); D = 2 x the
    frequencies. Computed in float32 (`inv_freq` must be: bf16 frequencies skew long-T angles), times
    `attention_factor` (YaRN's), cast to `dtype`."""
    if position_ids is None:
        positions = torch.arange(seq_len, dtype=torch.float32, device=inv_freq.device)
    else:
        positions = position_ids.to(inv_freq.device, torch.float32)
    freqs = positions[..., None] * inv_freq  # (..., T, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (..., T, D): rotate-half pairs dim i with i + D/2
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map the two halves (x1, x2) of the last dim to (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _per_head(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of (T, D) or (B, T, D) as (B or 1, T, 1, D), which broadcasts over the heads of (B, T, H, D)."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    return cos[:, :, None, :], sin[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by the per-position angles cos, sin: (T, D), or (B, T, D) for per-row positions."""
    cos, sin = _per_head(cos, sin)
    return x * cos + rotate_half(x) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the adjacent pairs (x0, x1), (x2, x3), ... of x (B, T, H, D) (DeepSeek's layout), returned
    de-interleaved as [rotated evens | rotated odds] like transformers' `apply_rotary_pos_emb_interleave`: q and k
    are permuted alike, so q.k is that of the interleaved rotation."""
    cos, sin = _per_head(cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2])  # one angle per pair
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (half-split) the first cos.shape[-1] dims of each head of x (B, T, H, D) and pass the rest through
    (GLM-4.5's `partial_rotary_factor`)."""
    rotary_dim = cos.shape[-1]
    return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)

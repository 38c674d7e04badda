"""Muon as an update rule: torch.optim.Muon's step, extended to stacked experts and to fused row blocks.

One step of a parameter, as `torch.optim.Muon` (torch 2.13) takes it: the momentum buffer is an EMA of the
gradients (`buf.lerp_(grad, 1 - momentum)`), the update is the Nesterov mix `grad.lerp(buf, momentum)` (or the
buffer), Newton-Schulz orthogonalises it in bf16, the weight decays with the unadjusted lr, and the weight moves by
`lr * ratio` times the orthogonal update. On a plain `[out, in]` matrix every op is torch's own (its private
`_zeropower_via_newtonschulz` and `_adjust_lr`, as `AdamWRule` calls torch's `adam`), so it is bitwise torch's.
A group's `ns_dtype` "torch.float32" runs the same iteration in fp32 instead (`newton_schulz`): bf16 rounds the last
bits of differently reduced gradients (another world size, another layout) far apart (muon.md trip-wire 4); fp32
keeps sharded runs within fp32 noise of one process, at ~2x the FLOP time and twice the gathered bytes.

What torch does not do, and this rule does, per *logical matrix*:
- a stacked expert weight `[E, out, in]` is E matrices: each expert is orthogonalised (and its lr ratio taken)
  alone; orthogonalising the stack as one `[E * out, in]` matrix couples the experts (XTuner's bug #1582);
- a group's `row_splits` (a tuple of row counts summing to `out`) cuts each matrix into row blocks that are
  orthogonalised and lr-scaled apart: MLA's `q_b_proj` per head (nope, rope), `kv_a_proj_with_mqa` (latent, rope)
  and `kv_b_proj` per head (nope, v), as XTuner's MuonSplit does. The model declares them
  (model/hooks.py `SplitsMuonRows`); the param groups carry them (optim/adamw.py `param_groups`).
So each block's result is what `torch.optim.Muon` gives that block as a parameter of its own. A DTensor
parameter (FSDP2, tensor or expert parallel) has its logical matrices gathered whole first (optim/muon_sharded.py).

Momentum convention: torch's EMA (XTuner, Moonlight and Dion keep the classic `mu * buf + grad`, 1/(1 - mu) times
larger): a state dict moves between this rule and `torch.optim.Muon` as it is, not to XTuner's without rescaling.
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from internlm_offload.optim.dtensor import is_dtensor
from internlm_offload.optim.rules import Group, StateSpec, UpdateRule

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")  # torch's; None is "original" (Keller's)
ROW_SPLITS_KEY = "row_splits"  # a group key: the row blocks each matrix of its params is orthogonalised in
NS_DTYPE_KEY = "ns_dtype"  # a group key (ours, not torch's): the dtype Newton-Schulz runs in, by its config name
NS_DTYPES = {"torch.bfloat16": torch.bfloat16, "torch.float32": torch.float32}  # torch's (and XTuner's) is bf16
# torch.optim.Muon's defaults (torch/optim/_muon.py)
MUON_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": (3.4445, -4.775, 2.0315),
    "eps": 1e-7,
    "ns_steps": 5,
    "adjust_lr_fn": None,
}
NS_DTYPE_DEFAULT = "torch.bfloat16"  # torch.optim.Muon's; a group without the key (torch's state dicts) runs it


class MuonRule(UpdateRule):
    """torch's Muon, one `momentum_buffer` per parameter; matrices `[out, in]` and expert stacks `[E, out, in]`."""

    name = "muon"
    whole_params = True  # Newton-Schulz reads a whole matrix: chunking tiers never split one, nor take a shard
    # (the plain and swap tiers hand it DTensors, whose matrices it gathers whole: optim/muon_sharded.py)
    update_bytes = 20  # elementwise part: read param, grad, buffer; write param, buffer (fp32); NS is extra
    # the planner counts its elements by the momentum update, one per parameter, whose first argument is the buffer
    # (shaped as the parameter); Newton-Schulz's matmuls are counted as FLOPs (planner/cost.py)
    kernel_ops = ("aten.lerp_.Scalar",)

    def state_keys(self, group: Group) -> tuple[str, ...]:
        return ("momentum_buffer",)

    def state_specs(self, param: torch.Tensor, group: Group) -> list[StateSpec]:
        return [StateSpec("momentum_buffer", param.shape, param.dtype)]

    def defaults(self) -> dict[str, Any]:
        return dict(MUON_DEFAULTS)

    def step(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: Mapping[str, list[torch.Tensor]],
        group: Group,
        *,
        has_complex: bool = False,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        if has_complex:
            raise ValueError("Muon does not support complex parameters")
        if grad_scale is not None or found_inf is not None:
            raise ValueError("Muon takes unscaled gradients: unscale them before step (no fused grad scaler)")
        lr = float(group["lr"])
        momentum, wd = group["momentum"], group["weight_decay"]
        for param, grad, buf in zip(params, grads, states["momentum_buffer"], strict=True):
            check_shape(param.shape, group.get(ROW_SPLITS_KEY))
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            if is_dtensor(param):  # each logical matrix gathered whole
                from internlm_offload.optim.muon_sharded import sharded_matrix_step  # torch with distributed only

                sharded_matrix_step(
                    param,
                    update,
                    lambda shape: matrix_blocks(shape, group.get(ROW_SPLITS_KEY)),
                    lambda block: orthogonalise(block, group),
                    lambda shape: _adjust_lr(lr, group["adjust_lr_fn"], shape),
                    1 - lr * wd,
                    ns_dtype(group),
                )
                continue
            if param.ndim == 2 and not group.get(ROW_SPLITS_KEY):
                # torch.optim.Muon's own ops, in its order
                update = orthogonalise(update, group)
                adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], param.shape)
                param.mul_(1 - lr * wd)
                param.add_(update, alpha=-adjusted_lr)
                continue
            blocks = list(matrix_blocks(param.shape, group.get(ROW_SPLITS_KEY)))
            orthogonal = [orthogonalise(update[index], group) for index in blocks]
            param.mul_(1 - lr * wd)
            for index, block in zip(blocks, orthogonal):
                param[index].add_(block, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], block.shape))

    def state_bytes(self, dtype: torch.dtype, group: Group) -> int:
        return dtype.itemsize  # one buffer, half of AdamW's two


MUON = MuonRule()  # stateless: shared


def ns_dtype(group: Group) -> torch.dtype:
    """The dtype a group's Newton-Schulz runs in."""
    return NS_DTYPES[group.get(NS_DTYPE_KEY, NS_DTYPE_DEFAULT)]


def orthogonalise(block: torch.Tensor, group: Group) -> torch.Tensor:
    """Newton-Schulz of one matrix with the group's hyper-parameters: torch's own in bf16 (bitwise
    torch.optim.Muon), `newton_schulz` in fp32."""
    hyper = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    if ns_dtype(group) == torch.bfloat16:
        return _zeropower_via_newtonschulz(block, *hyper)
    return newton_schulz(block, *hyper, dtype=ns_dtype(group))


def newton_schulz(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, *, dtype: torch.dtype
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration torch.optim.Muon runs (X <- aX + (bG + cG^2)X with G = XX^T, on the wide
    orientation, after dividing by the Frobenius norm clamped at `eps`), in `dtype`; returns `dtype`."""
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.to(dtype).mT if tall else matrix.to(dtype)  # the Gram matrix is min(out, in) square
    x = x / x.norm().clamp(min=eps)  # a new tensor: the caller's update is left alone
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def check_shape(shape: torch.Size, row_splits: tuple[int, ...] | None = None) -> None:
    """Muon steps matrices `[out, in]` and expert stacks `[E, out, in]`; row blocks must add up to `out`."""
    if len(shape) not in (2, 3):
        raise ValueError(
            f"Muon steps matrices [out, in] or stacked experts [E, out, in]; got a parameter of shape "
            f"{tuple(shape)}: give it to AdamW"
        )
    if row_splits and sum(row_splits) != shape[-2]:
        raise ValueError(f"row_splits={tuple(row_splits)} add up to {sum(row_splits)}, not the {shape[-2]} rows")


def matrix_blocks(shape: torch.Size, row_splits: tuple[int, ...] | None = None) -> list[tuple]:
    """Index of each logical matrix of a parameter: every expert of a stack, every row block of each."""
    rows = tuple(row_splits) if row_splits else (shape[-2],)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    per_matrix = [slice(start, start + count) for start, count in zip(starts, rows)]
    if len(shape) == 2:
        return [(block,) for block in per_matrix]
    return [(expert, block) for expert in range(shape[0]) for block in per_matrix]


def block_shapes(shape: torch.Size, row_splits: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """The `(rows, cols)` of each logical matrix Newton-Schulz orthogonalises for a parameter of `shape`."""
    rows = tuple(row_splits) if row_splits else (shape[-2],)
    return [(count, shape[-1]) for count in rows] * (shape[0] if len(shape) == 3 else 1)


def orthogonalise_zeros(shapes: set[tuple[int, int]], group: Group, device: torch.device) -> None:
    """Newton-Schulz once on zeros of each shape: its kernels' first use, which on cpu leaves oneDNN's caches of
    about 2 MiB per shape behind (the kernel probe counts them as the runtime's: engine/runtime_memory.py)."""
    hyper = {**MUON_DEFAULTS, **group}
    for shape in sorted(shapes):
        orthogonalise(torch.zeros(shape, device=device), hyper)


def check_hyperparameters(
    lr: float, weight_decay: float, momentum: float, ns_coefficients: tuple, ns_steps: int, adjust_lr_fn: Any
) -> None:
    """torch.optim.Muon's constructor checks (and the two it leaves to `step`), as ValueErrors."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    for name, value in (("learning rate", lr), ("weight decay", weight_decay), ("momentum", momentum)):
        if not 0.0 <= value:
            raise ValueError(f"Invalid {name}: {value}")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported; use {ADJUST_LR_FNS}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be 3 values (a, b, c); got {tuple(ns_coefficients)}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps={ns_steps} must be in 0..99")


def ns_dtype_name(value: torch.dtype | str) -> str:
    """`ns_dtype` as a group holds it ("torch.bfloat16" / "torch.float32"), from a dtype or that name."""
    name = str(value) if isinstance(value, torch.dtype) else value
    if name not in NS_DTYPES:
        raise ValueError(f"ns_dtype={value}: Newton-Schulz runs in {', '.join(NS_DTYPES)}")
    return name

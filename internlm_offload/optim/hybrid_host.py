"""The hybrid optimizer's CPU side: which params it steps, their host buffers, and the pieces it steps them in.

Placement (`offload_mask`, or a mask the caller computed once), the per-param host slots (master copy,
grad landing buffer, staging buffer), the CPU sub-optimizers (`CpuUnit`) with the slab that holds their
states, and the cut of the CPU share into pieces that are stepped as soon as their own grads land.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.optim import Optimizer

from internlm_offload.device import Accelerator, Event, HostArena
from internlm_offload.optim.adamw import consecutive_runs
from internlm_offload.optim.dtensor import laid_out_like, local_nbytes, local_shard
from internlm_offload.optim.records import ParamRecord

# With overlap the CPU share is stepped in this many pieces (fewer when it has fewer params), each as
# soon as its own grads have landed: enough to hide all but the first piece's copy, few enough that a
# CPU optimizer's per-step overhead stays small.
CPU_STEP_PIECES = 4


@dataclass
class HostSlot:
    """One CPU-stepped param: its host master copy and the host buffers its grad and update travel through.

    For a DTensor param (FSDP2) the host buffers hold this rank's shard: `local(param)` / `local(param.grad)`.
    """

    param: torch.Tensor  # the param the hybrid optimizer steps, on the device (a DTensor under FSDP2)
    master: torch.Tensor  # host copy the CPU optimizer updates (fp32 when updated in fp32)
    grad: torch.Tensor | None  # host grad in the master dtype (None: grads arrive as the record's `host_grad`)
    staging: torch.Tensor | None  # host buffer in the param dtype when it differs from the master's
    has_grad: bool = False  # whether `param.grad` existed at the start of the current step
    record: ParamRecord | None = None  # the masters layer's record of `param`, when it was handed one

    @property
    def resident(self) -> bool:
        """The param lives on the host and is its own master (see optim.hybrid)."""
        return self.record is not None and self.record.on_host

    @property
    def local_param(self) -> torch.Tensor:
        """The device tensor the master mirrors: the param, or its local shard (an alias) for a DTensor;
        for a host-resident param, the device tensor that receives its value (its record's `model_param`)."""
        return self.record.model_param if self.resident else local_shard(self.param.detach())

    @property
    def device_grad(self) -> torch.Tensor | None:
        """The record's `device_grad` for a host-resident param; else (or when DCP's state init sets zero grads)
        its `.grad`."""
        grad = None if self.record is None else self.record.device_grad
        return self.param.grad if grad is None else grad

    @property
    def host_grad(self) -> torch.Tensor | None:
        """The param's gradient when gradient offload already brought it to the host (`optim.grad_offload`)."""
        return None if self.record is None else self.record.host_grad

    def step_grad(self) -> torch.Tensor:
        """The host gradient the CPU step applies, in the master's dtype (upcast on the host where needed)."""
        source = self.host_grad
        if source is None:
            # No landing buffer (gradient offload): DCP's state init, which sets zero grads on the host masters.
            source = self.device_grad if self.landing is None else self.landing
        if source is self.grad or source.dtype == self.master.dtype:
            return source
        return self.grad.copy_(source)

    @property
    def landing(self) -> torch.Tensor:
        """Where the D2H grad copy lands: copies stay in the grad's dtype (half the bytes for bf16 grads)."""
        return self.grad if self.staging is None or self.resident else self.staging

    def nbytes(self) -> int:
        return sum(local_nbytes(t) for t in (self.master, self.grad, self.staging) if t is not None)


@dataclass
class CpuUnit:
    """A CPU sub-optimizer and the slots it steps; its step starts once its own grads are on the host."""

    optimizer: Optimizer
    group_ids: list[int]  # the hybrid param group of each of its param groups
    slots: list[HostSlot]
    grads_ready: Event | None = field(default=None, repr=False)
    slab: HostArena | None = field(default=None, repr=False)  # holds the sub-optimizer's states once moved
    slabbed_params: int = 0  # how many params had states when they were moved


def states_into_slab(
    optimizer: Optimizer,
    accelerator: Accelerator,
    *,
    pinned: bool,
    reuse: HostArena | None = None,
    directory: str | None = None,
) -> HostArena:
    """Copy `optimizer`'s state tensors (their local shards) into views of one host slab, laid out like them,
    in their place; `reuse` is the slab when its layout matches (it is released otherwise); `directory`: the
    slab is a file there (the NVMe tier). Blocking copies: each is done before the tensor it replaces can be
    dropped."""
    states = [
        (state, name) for state in optimizer.state.values() for name, value in state.items() if torch.is_tensor(value)
    ]
    specs = [(local_shard(state[name]).shape, local_shard(state[name]).dtype) for state, name in states]
    if reuse is not None and reuse.specs != specs:
        reuse.release()
        reuse = None
    slab = reuse or HostArena(accelerator, specs, pinned=pinned, directory=directory)
    for index, (state, name) in enumerate(states):
        value = state[name]
        state[name] = laid_out_like(slab.view(index).copy_(local_shard(value)), value)
    return slab


def offload_mask(params: Iterable[torch.Tensor], offload_fraction: float) -> list[bool]:
    """Which params the CPU steps: the longest run of leading trainable params within the fraction's budget.

    Frozen params (requires_grad=False) neither count nor end the run; they stay on the device.
    """
    params = list(params)
    budget = offload_fraction * sum(p.numel() for p in params if p.requires_grad)
    mask, offloaded, open_run = [], 0, offload_fraction > 0
    for p in params:
        open_run = open_run and (not p.requires_grad or offloaded + p.numel() <= budget)
        mask.append(open_run and p.requires_grad)
        offloaded += p.numel() if mask[-1] else 0
    return mask


def cpu_placement(params: list[torch.Tensor], offload_fraction: float, cpu_mask: Sequence[bool] | None) -> list[bool]:
    """The CPU share: `cpu_mask` as given (checked), else the leading params within the fraction."""
    if cpu_mask is None:
        return offload_mask(params, offload_fraction)
    mask = [bool(cpu) for cpu in cpu_mask]
    if len(mask) != len(params):
        raise ValueError(f"cpu_mask has {len(mask)} entries for {len(params)} params")
    if any(cpu and not p.requires_grad for p, cpu in zip(params, mask)):
        raise ValueError("cpu_mask places a frozen param (requires_grad=False) on the CPU; those stay on the device")
    return mask


def cut_pieces(grouped: list[list[HostSlot]], target: float) -> list[list[tuple[int, list[HostSlot]]]]:
    """Consecutive slots of one group, about `target` elements per piece (a larger param alone)."""
    items = [(gid, slot) for gid, group_slots in enumerate(grouped) for slot in group_slots]
    runs = consecutive_runs(
        items, group_of=lambda item: item[0], size_of=lambda item: local_shard(item[1].master).numel(), target=target
    )
    return [[(run[0][0], [slot for _, slot in run])] for run in runs]

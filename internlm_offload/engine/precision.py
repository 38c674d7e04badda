"""Mixed precision: one policy for the model wrapper and the optimizers, and explicit fp32 masters.

InternEvo's meaning of `model.dtype`: the dtype forward and backward compute in. With master weights
(the default) the optimizer steps fp32 copies of the parameters with fp32 states, and gradients are
accumulated over micro-batches, reduced and clipped in fp32. How the masters are held depends on the
parallel mode:
- `fsdp2`: FSDP2's `MixedPrecisionPolicy` does it. The sharded parameters stay fp32 (they are the
  masters, in the optimizer and in checkpoints), all-gathers cast them to the compute dtype, gradients
  are reduce-scattered and accumulated in fp32.
- `none` / `ddp`: `MasterWeights` below. The model's parameters are cast to the compute dtype; an
  fp32 copy of the model (same parameter names) holds the masters that the optimizer steps and that
  checkpoints store. After each micro-batch the low-precision grads are added into fp32 master grads
  (one flat buffer per step); under DDP that buffer is all-reduced in fp32 once per step (DDP itself
  then never communicates). After a step the masters are rounded into the model's parameters.
  Masters may live in host memory: all of them for the swap optimizer (which swaps them in with
  their states), the CPU share for the hybrid optimizer (which steps them there). Each trainable
  master has a `ParamRecord` (optim/records.py) that this module creates and hands to the optimizers:
  a host master's device gradient is its record's `device_grad` instead of `.grad`, its record's
  `model_param` is the model's parameter, and the optimizer writes the rounded update into it. With
  the swap optimizer the device then holds only the low-precision parameters between steps.

Pure low precision (`master_weights=False`) casts the whole model, grads and states included.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from internlm_offload.log import get_logger
from internlm_offload.model.hooks import KeepsFp32Buffers
from internlm_offload.model.quantized import scale_tensors
from internlm_offload.optim.dtensor import laid_out_like, local_shard
from internlm_offload.optim.records import ParamRecord

logger = get_logger(__name__)

DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of a run: what forward/backward compute in, and whether fp32 masters exist."""

    compute_dtype: torch.dtype
    master_weights: bool = True

    @classmethod
    def from_config(cls, dtype: str, master_weights: bool) -> PrecisionPolicy:
        return cls(DTYPES[dtype], master_weights)

    @property
    def low_precision(self) -> bool:
        return self.compute_dtype != torch.float32

    @property
    def uses_masters(self) -> bool:
        """Whether an fp32 master copy exists apart from the compute dtype."""
        return self.low_precision and self.master_weights

    @property
    def loss_scaling(self) -> bool:
        """fp16's 5 exponent bits underflow small gradients: scale the loss (bf16 shares fp32's range)."""
        return self.compute_dtype == torch.float16

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the optimizer's parameters and states are kept in."""
        return torch.float32 if self.uses_masters else self.compute_dtype

    def fsdp_mixed_precision(self):  # -> MixedPrecisionPolicy | None
        """FSDP2's policy: fp32 shards as masters, compute-dtype all-gathers, fp32 reduce-scatter."""
        if not self.uses_masters:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # No input casting: activations already flow in the compute dtype, and the cast's profiler op would
        # run inside selective checkpointing's recompute but not its forward (torch's SAC then refuses).
        return MixedPrecisionPolicy(
            param_dtype=self.compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )

    def describe(self) -> str:
        name = str(self.compute_dtype).removeprefix("torch.")
        if not self.low_precision:
            return "float32"
        return f"{name} compute, fp32 master weights" if self.master_weights else f"pure {name} (no master weights)"


class MasterWeights:
    """fp32 masters for a low-precision model outside FSDP2 (module docstring).

    `module` is an fp32 copy of the model with the same parameter names: build the optimizer over its
    parameters and save/load it in checkpoints. The trainer calls `accumulate_grads()` after each
    micro-batch's backward, `reduce_grads()` once before clipping, `grads()` to clip, and
    `after_step()` after a successful optimizer step (`copy_to_model()` after loading the masters).

    `host_empty(shape, dtype)`: where given, the masters named in `host_names` (all when None) are
    placed in host buffers from it. `records()`: one `ParamRecord` per trainable master, created here; this
    class writes their `device_grad` (host masters) when a step's gradient buffer starts and clears it in
    `release_grads()`.
    """

    def __init__(
        self,
        model: nn.Module,
        compute_dtype: torch.dtype,
        host_empty: Callable[[torch.Size, torch.dtype], torch.Tensor] | None = None,
        host_names: set[str] | None = None,
        reduce_group: dist.ProcessGroup | None = None,
        reduce_apart: tuple[set[str], Callable[[torch.Tensor], None]] | None = None,
    ) -> None:
        self._reduce_group = reduce_group  # the data-parallel ranks (None: the world)
        # (names, reduce): these parameters' fp32 gradients are reduced by `reduce` on their own slice of the
        # buffer instead (expert parallel's experts, whose shards differ across the data-parallel ranks)
        apart_names, self._reduce_apart = reduce_apart if reduce_apart is not None else (set(), None)
        named = dict(model.named_parameters())
        if host_empty is None:
            host_names = set()
        elif host_names is None:
            host_names = set(named)
        # fp32 copy with the same names; tied weights stay tied; built before any hook is attached. For host
        # masters deepcopy's memo hands it the host copies, so they never exist twice on the device. Frozen
        # parameters (a LoRA base) get no master: the memo hands the copy the model's own, cast with it below.
        hosted = {
            id(named[name]): _host_parameter(named[name], host_empty)
            for name in host_names
            if named[name].requires_grad
        }
        frozen = {id(p): p for p in named.values() if not p.requires_grad}
        # a 4-bit base's scales (buffers held as bytes) are shared too: the cast below leaves them as they are,
        # and a copy of a 70B base's scales would be a GiB of device memory the masters never read
        frozen.update({id(b): b for b in scale_tensors(model)})
        with fp32_buffers_kept(model) as kept:  # one fp32 tensor, in the model and in the masters (saved from there)
            self.module = copy.deepcopy(model, {**hosted, **frozen, **{id(t): t for t in kept}})
            model.to(compute_dtype)
        named_model = dict(model.named_parameters())
        pairs = [(name, named_model[name], master) for name, master in self.module.named_parameters()]
        pairs = [(name, param, master) for name, param, master in pairs if param is not master]
        self._pairs = [(param, master) for _, param, master in pairs]
        self._apart = [name in apart_names for name, _, master in pairs if master.requires_grad]
        host_ids = {id(master) for master in hosted.values()}
        self._on_host = [id(master) in host_ids for _, master in self._pairs]
        self._records = [
            _record(param, master, on_host)
            for (param, master), on_host in zip(self._pairs, self._on_host)
            if master.requires_grad
        ]
        self._numel = sum(local_shard(r.master).numel() for r in self._records)  # tensor parallel: this rank's
        self._flat_grads: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []

    @property
    def on_host(self) -> bool:
        """Whether every master lives in host memory."""
        return all(self._on_host)

    @property
    def reduce_in_backward(self) -> bool:
        """False: DDP must not all-reduce the low-precision grads; `reduce_grads` reduces the fp32 buffer instead."""
        return False

    def master_params(self) -> Iterator[nn.Parameter]:
        """The fp32 masters, kept apart from the model's parameters (a frozen base, shared with the model, is not
        one of them)."""
        return iter([master for _, master in self._pairs])

    def records(self) -> list[ParamRecord]:
        """The record of each trainable master, in parameter order (the same objects on every call)."""
        return list(self._records)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add the model's low-precision grads into the fp32 master grads and free the former."""
        if self._flat_grads is None:
            self._start_flat_grads()
        for record, grad in zip(self._records, self._grad_views):
            param = record.model
            if param.grad is not None:
                grad.add_(local_shard(param.grad))
                param.grad = None

    def _start_flat_grads(self) -> None:
        # One buffer per step, so DDP's reduction is a single fp32 all-reduce (and one more for the gradients
        # reduced apart, laid out after the rest); freed after the step.
        device = self._records[0].model.device  # the model's device, where the grads are produced
        self._flat_grads = torch.zeros(self._numel, dtype=torch.float32, device=device)
        views: dict[int, torch.Tensor] = {}
        offset = 0
        for index in sorted(range(len(self._records)), key=lambda i: self._apart[i]):  # stable: the rest first
            record = self._records[index]
            master = record.master
            local = local_shard(master)
            view = self._flat_grads[offset : offset + local.numel()].view_as(local)
            if record.on_host:
                # a host tensor cannot hold a device `.grad`; the offload optimizers read local shards
                record.device_grad = view
            else:
                master.grad = laid_out_like(view, master)  # a DTensor param's grad: a DTensor of its layout
            views[index] = view
            offset += local.numel()
        self._grad_views = [views[index] for index in range(len(self._records))]
        self._together = sum(view.numel() for view, apart in zip(self._grad_views, self._apart) if not apart)

    def grads(self) -> list[torch.Tensor]:
        """This step's fp32 master gradients (on the device; DTensors for tensor-parallel params), e.g. to clip."""
        if self._flat_grads is None:
            self._start_flat_grads()
        return [laid_out_like(view, record.master) for view, record in zip(self._grad_views, self._records)]

    @torch.no_grad()
    def reduce_grads(self, distributed: bool) -> None:
        """Average the fp32 master grads over the ranks (DDP with masters never reduces in backward)."""
        if self._flat_grads is None:
            self._start_flat_grads()
        if not distributed:
            return
        together, apart = self._flat_grads[: self._together], self._flat_grads[self._together :]
        if dist.get_world_size(self._reduce_group) > 1:
            dist.all_reduce(together, op=dist.ReduceOp.AVG, group=self._reduce_group)
        if self._reduce_apart is not None and apart.numel():
            self._reduce_apart(apart)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model's compute-dtype parameters."""
        self._copy_to_model(on_host=True)
        self._copy_to_model(on_host=False)

    def _copy_to_model(self, *, on_host: bool) -> None:
        pairs = [pair for pair, hosted in zip(self._pairs, self._on_host) if hosted == on_host]
        if not pairs:
            return
        pairs = [(local_shard(p), local_shard(m)) for p, m in pairs]  # tensor parallel: shard to shard
        if on_host:
            for param, master in pairs:
                param.copy_(master)  # host to device: one copy per tensor
        else:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    @torch.no_grad()
    def after_step(self) -> None:
        """After a successful optimizer step: the model's parameters take the new masters' values.

        The optimizer already wrote those of host masters, each as it was updated."""
        self._copy_to_model(on_host=False)

    def release_grads(self) -> None:
        """Drop the step's fp32 grad buffer (the optimizer's `zero_grad(set_to_none=True)` drops the views)."""
        for record in self._records:
            record.master.grad = None
            record.device_grad = None
        self._flat_grads = None
        self._grad_views = []


class NoMasters:
    """No fp32 copy apart from the model (fp32, pure low precision, FSDP2's fp32 shards): `MasterWeights`'
    interface over the model itself, whose hooks do nothing. `module` is the model the trainer runs (the
    data-parallel wrapper, whose parameters the optimizer steps and checkpoints hold). `reduce_group`: the model
    is not wrapped (a zero-bubble pipeline's stages, whose split backward DDP's reducer does not follow) and
    `reduce_grads` averages its gradients over this group after the last backward."""

    def __init__(self, model: nn.Module, reduce_group: dist.ProcessGroup | None = None) -> None:
        self.module = model
        self._records = [ParamRecord(p, p) for p in model.parameters() if p.requires_grad]
        self._reduce_group = reduce_group

    @property
    def on_host(self) -> bool:
        return False

    @property
    def reduce_in_backward(self) -> bool:
        """Whether the data-parallel wrapper reduces the model's own grads during the last backward."""
        return self._reduce_group is None

    def master_params(self) -> Iterator[nn.Parameter]:
        """None: the model's parameters are the ones stepped."""
        return iter(())

    def records(self) -> list[ParamRecord]:
        """A device record per trainable parameter, made at construction: the tensor backward gives a gradient is
        the one stepped."""
        return list(self._records)

    def accumulate_grads(self) -> None:
        """Nothing: the model's grads accumulate in place over micro-batches."""

    def grads(self) -> list[torch.Tensor]:
        """The model's gradients (those that exist), e.g. to clip them."""
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    @torch.no_grad()
    def reduce_grads(self, distributed: bool) -> None:
        """Nothing where the wrapper reduced in backward (`reduce_in_backward`); else the model's grads averaged
        over `reduce_group`, as one flat buffer (one all-reduce, in the parameters' order on every rank)."""
        if self._reduce_group is None or not distributed or dist.get_world_size(self._reduce_group) == 1:
            return
        grads = self.grads()
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self._reduce_group)
        torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))

    def copy_to_model(self) -> None:
        """Nothing: the stepped parameters are the model's."""

    def after_step(self) -> None:
        """Nothing: the optimizer updated the model's parameters."""

    def release_grads(self) -> None:
        """Nothing: `zero_grad(set_to_none=True)` frees the model's grads."""


def _record(param: nn.Parameter, master: nn.Parameter, on_host: bool) -> ParamRecord:
    """A host master's record names the model's parameter its update is rounded into (tensor parallel: the local
    shard, an alias)."""
    if not on_host:
        return ParamRecord(param, master)
    return ParamRecord(param, master, "host", model_param=local_shard(param.detach()))


def _host_parameter(param: nn.Parameter, host_empty: Callable) -> nn.Parameter:
    """An fp32 copy of `param` in a host buffer; of a DTensor param (tensor parallel) its local shard, in the
    param's layout (the offload optimizers work on local shards)."""
    local = local_shard(param)
    host = host_empty(local.shape, torch.float32)
    with torch.no_grad():
        host.copy_(local)
    return nn.Parameter(laid_out_like(host, param), requires_grad=param.requires_grad)


def cast_model(
    model: nn.Module,
    policy: PrecisionPolicy,
    *,
    fsdp: bool,
    host_empty: Callable | None = None,
    host_names: set[str] | None = None,
    reduce_group: dist.ProcessGroup | None = None,
    reduce_apart: tuple[set[str], Callable[[torch.Tensor], None]] | None = None,
) -> MasterWeights | None:
    """Apply the policy to a freshly built fp32 model; returns the masters where this module keeps them.

    `host_empty`: keep the masters named in `host_names` (all when None) in host buffers from it. Without
    masters (None) the run steps the model's own parameters: the builder hands the trainer `NoMasters` over
    the model once it is wrapped for data parallelism.
    """
    if not policy.low_precision:
        return None
    if policy.uses_masters:
        if fsdp:
            # FSDP2's MixedPrecisionPolicy: the fp32 shards are the masters; a frozen base needs none (its dtype
            # may differ from the trainable shards': FSDP2 checks only theirs)
            cast_frozen(model, policy.compute_dtype)
            return None
        return MasterWeights(model, policy.compute_dtype, host_empty, host_names, reduce_group, reduce_apart)
    with fp32_buffers_kept(model):
        model.to(policy.compute_dtype)
    return None


@contextlib.contextmanager
def fp32_buffers_kept(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """The buffers a model keeps in fp32 whatever the compute dtype (the `fp32_buffers()` of each of its modules that
    declares `KeepsFp32Buffers`, e.g. a router bias that moves by 1e-3 a step) are the same tensors after a cast in
    the `with` body as before; yields them."""
    declared = [pair for m in model.modules() if isinstance(m, KeepsFp32Buffers) for pair in m.fp32_buffers()]
    kept = [(module, name, getattr(module, name)) for module, name in declared]
    try:
        yield [tensor for _, _, tensor in kept]
    finally:
        for module, name, tensor in kept:
            setattr(module, name, tensor)


@torch.no_grad()
def cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the parameters that train not (a LoRA base) to `dtype` in place, keeping their Parameter objects; a
    DTensor parameter (expert parallel's experts) gets a new one: `.data =` on it changes the DTensor's dtype, not its
    local shard's (the frozen experts of a LoRA run under FSDP2 and expert parallel stayed fp32, 4 bytes each)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad:
                continue
            if isinstance(param, DTensor):
                setattr(module, name, nn.Parameter(param.detach().to(dtype), requires_grad=False))
            else:
                param.data = param.data.to(dtype)

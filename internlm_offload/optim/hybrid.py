"""HybridDeviceOptimizer: the optimizer step of a fraction of the params runs on the host CPU.

ZeRO-Offload-style compute offload: the first params, up to `offload_fraction` of the trainable
elements, keep their master copy, grad buffer and optimizer states in host memory and are stepped by
a CPU optimizer; the rest are stepped on the device. Per step only grads go D2H and updated params go
H2D (the param dtype's bytes each way); the states never move.

A host-resident param (an fp32 master of a low-precision model whose `ParamRecord`, optim/records.py, is
placed on the host) is its own host master: its gradient is the record's `device_grad` and its update goes
H2D into the record's `model_param`. The schedule, memory figures, numerics and checkpoints:
docs/optimizer_offload.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from copy import deepcopy
from typing import Any

import torch
from torch.optim import Optimizer

from internlm_offload.device import Accelerator, CopyLane, Event, HostArena, Stream, accelerator_for, finish_and_close
from internlm_offload.log import get_logger
from internlm_offload.optim.adamw import fused_supported
from internlm_offload.optim.adamw_rule import ADAMW
from internlm_offload.optim.dtensor import is_dtensor, laid_out_like, local_nbytes, local_shard
from internlm_offload.optim.hybrid_host import (
    CPU_STEP_PIECES,
    CpuUnit,
    HostSlot,
    cpu_placement,
    cut_pieces,
    offload_mask,
    states_into_slab,
)
from internlm_offload.optim.hybrid_state import StateView, group_of, hyper_params, is_shard_state, placed, state_bytes
from internlm_offload.optim.interface import OffloadOptimizer, evaluate_closure
from internlm_offload.optim.records import ParamRecord, records_by_master
from internlm_offload.optim.rule_optimizer import optimizer_for_groups
from internlm_offload.optim.rules import UpdateRule, refuse_sharded_params, rule_for

__all__ = ["CPU_STEP_PIECES", "HybridDeviceOptimizer", "offload_mask"]  # offload_mask: the placement's rule

logger = get_logger(__name__)

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class HybridDeviceOptimizer(OffloadOptimizer, Optimizer):
    """Steps the first `offload_fraction` of the params on the CPU and the rest on the device.

    Placement: the longest leading run of trainable params (`param_groups` order) whose elements stay within
    `offload_fraction` of the trainable elements is CPU-stepped (never more: 0.0 keeps all on the device, 1.0
    moves all); frozen params stay on the device. A step: the CPU share's grads go D2H, a host thread steps
    it piece by piece while the calling thread steps the device share, updated params go H2D behind each
    piece, and the compute stream waits for them before `step()` returns. `state_dict()` is that of one
    plain optimizer of the rule (`torch.optim.AdamW` for AdamW) over every param, whatever the fraction on either
    side. The schedule, host memory, numerics, checkpoints and DTensor params in detail: docs/optimizer_offload.md.

    Args:
        params: params or param-group dicts, as for any torch optimizer.
        offload_fraction: share of the trainable elements stepped on the CPU, in [0, 1].
        cpu_optimizer_cls: factory `(param_groups, **kwargs) -> Optimizer` for host params
            (default: the rule's plain optimizer, `torch.optim.AdamW` with `fused=True` for AdamW, ~17x faster
            on cpu than the for-loop).
        gpu_optimizer_cls: the same for device params (default: the rule's, fused where torch has a fused
            kernel for the device).
        param_update_in_fp32: keep fp32 masters for fp16/bf16 params (host masters for CPU params,
            device masters for device params: +4 B/element there) and update those.
        pin_cpu_grads: page-lock the host buffer grads land in (async D2H; counts against memlock).
        pin_cpu_params: page-lock the host buffer updates leave from (async H2D).
        overlap_cpu_optimizer_d2h_h2d: the CPU share in pieces, stepped on a host thread while the
            device steps, pipelined with the copies.
        accelerator: where the device params live (default: the params' device's, `accelerator_for`).
        cpu_mask: which params, in `param_groups` order, the CPU steps, when the caller placed them already
            (the builder does, to put their fp32 masters in host memory); default
            `offload_mask(params, offload_fraction)`.
        grads_on_host: gradient offload (`optim.grad_offload`) hands the CPU share's gradients over as host
            tensors (the records' `host_grad`): no D2H copy of them, and no host grad buffer for host-resident
            params.
        records: the params' `ParamRecord`s from the masters layer (where each gradient is, which params live on
            the host); without them every param is a device param whose gradient is its `.grad`.
        rule: the update rule both sides step (`optim.rules`; default AdamW); its plain optimizer is the default
            of both classes, and the state dict is that optimizer's over every param.
        rules: by name, the rules param groups name (`optim.rules.RULE_KEY`); where the groups one side steps name
            several, that side's default optimizer is a `RuleOptimizer` stepping each group with its own.
        nvme_path: the CPU share's AdamW states live in files in this directory (the NVMe tier,
            `device/disk_buffers.py`), one per piece: the next piece's are read ahead while one is stepped,
            and a stepped piece's are written back and dropped from memory.
        **kwargs: hyper-parameters (lr, betas, eps, weight_decay, amsgrad, maximize, ...): the defaults
            of the param groups, passed to both sub-optimizers.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Callable[..., Optimizer] | None = None,
        gpu_optimizer_cls: Callable[..., Optimizer] | None = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        *,
        accelerator: Accelerator | None = None,
        cpu_mask: Sequence[bool] | None = None,
        grads_on_host: bool = False,
        nvme_path: str | None = None,
        records: Iterable[ParamRecord] | None = None,
        rule: UpdateRule = ADAMW,
        rules: Mapping[str, UpdateRule] | None = None,
        **kwargs: Any,
    ) -> None:
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction}")
        if bad := [k for k, v in kwargs.items() if isinstance(v, type) or callable(v)]:
            raise ValueError(f"hyper-parameters must be plain values (checkpoints load with weights_only), got {bad}")
        self._built = False
        super().__init__(params, dict(kwargs))
        self._acc = accelerator if accelerator is not None else accelerator_for(self._params_in_order())
        self.offload_fraction = offload_fraction
        self.param_update_in_fp32 = param_update_in_fp32
        self.pin_cpu_grads, self.pin_cpu_params = pin_cpu_grads, pin_cpu_params
        self.overlap_cpu_optimizer_d2h_h2d = overlap_cpu_optimizer_d2h_h2d
        self.grads_on_host = grads_on_host
        self.nvme_path = nvme_path
        self._records = records_by_master(records)
        self._d2h, self._h2d = CopyLane(self._acc), CopyLane(self._acc)
        self._params_read: Event | None = None  # recorded at step(): the H2D copies of the step wait for it
        self._host_arenas: list[HostArena] = []
        self._offload_slab: HostArena | None = None  # the device states' host copy, kept for the next offload
        self._cpu_worker: Executor | None = None  # started by the first overlapped step
        # id(model param) -> (sub-optimizer, the tensor it steps for that param).
        self._route: dict[int, tuple[Optimizer, torch.Tensor]] = {}
        self._device_masters: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._states_offloaded = False
        self._peak_device_state_bytes = 0
        # The params may change before the first step (weights loaded after building): refresh then.
        self._masters_stale = True

        all_params = [p for group in self.param_groups for p in group["params"]]
        self.rule, self.rules = rule, dict(rules or {})
        for group in self.param_groups:  # CPU pieces hold whole local tensors, but a DTensor's is this rank's shard
            refuse_sharded_params(rule_for(group, rule, self.rules), group["params"], "the hybrid optimizer")
        placement = cpu_placement(all_params, offload_fraction, cpu_mask)
        offloaded = {id(p) for p, cpu in zip(all_params, placement) if cpu}
        if any(self._resident(p) and id(p) not in offloaded for p in all_params):
            raise ValueError(
                "a host-resident param (its record placed on the host) falls outside the CPU share of "
                f"offload_fraction={offload_fraction}: place exactly the CPU share on the host"
            )
        self._cpu_units = self._build_cpu_units(cpu_optimizer_cls, offloaded, kwargs)
        gpu_cls = gpu_optimizer_cls or self._default_cls(self.param_groups, self._acc.name)
        self._device_optimizer = self._build_device_optimizer(gpu_cls, kwargs)
        self._fill_group_defaults()
        self.state = StateView(self._route, self._params_in_order)  # type: ignore[assignment]  # a live view
        self._built = True
        self._log_placement(all_params, offloaded)

    # ---- construction ---------------------------------------------------------------------------

    def _params_in_order(self) -> Iterator[torch.Tensor]:
        return (p for group in self.param_groups for p in group["params"])

    def _default_cls(self, groups: list[dict[str, Any]], device_type: str) -> Callable[..., Optimizer]:
        """The plain optimizer of the groups' rule (fused where torch has a fused kernel for the device), or one
        stepping each group with its own rule when they name several."""
        flags = {"fused": True} if fused_supported(device_type) else {}
        return optimizer_for_groups(groups, self.rule, self.rules, device_type, **flags)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._built:
            raise NotImplementedError("HybridDeviceOptimizer places params at construction; build a new one instead")
        super().add_param_group(param_group)

    def _build_cpu_units(
        self, cls: Callable[..., Optimizer] | None, offloaded: set[int], kwargs: dict
    ) -> list[CpuUnit]:
        slots = self._host_slots([p for g in self.param_groups for p in g["params"] if id(p) in offloaded])
        grouped = [[slots[id(p)] for p in g["params"] if id(p) in offloaded] for g in self.param_groups]
        if not self.overlap_cpu_optimizer_d2h_h2d:
            plan = [list(enumerate(grouped))] if slots else []
        else:
            plan = cut_pieces(grouped, sum(local_shard(s.master).numel() for s in slots.values()) / CPU_STEP_PIECES)
        return [self._cpu_unit(cls, groups, kwargs) for groups in plan]

    def _host_slots(self, params: list[torch.Tensor]) -> dict[int, HostSlot]:
        """Each CPU-stepped param's host buffers, as views of one slab per pinnedness."""
        wanted = [self._buffer_specs(p) for p in params]
        for pinned in (True, False):
            specs = [(shape, dtype) for spec in wanted for shape, dtype, pin in spec.values() if bool(pin) is pinned]
            self._host_arenas.append(HostArena(self._acc, specs, pinned=pinned))
        views, taken = [], {True: 0, False: 0}
        arenas = {True: self._host_arenas[-2], False: self._host_arenas[-1]}
        for spec in wanted:
            views.append({})
            for role, (_, _, pin) in spec.items():
                pinned = bool(pin)  # the flags may be any truthy value
                views[-1][role] = arenas[pinned].view(taken[pinned])
                taken[pinned] += 1
        return {id(p): self._host_slot(p, v) for p, v in zip(params, views)}

    def _buffer_specs(self, param: torch.Tensor) -> dict[str, tuple[torch.Size, torch.dtype, bool]]:
        """The host buffers a CPU-stepped param needs: role -> (shape, dtype, pinned)."""
        if self._resident(param):
            # The param is the master; grads land in fp32, updates leave in the model param's dtype.
            host = local_shard(param.detach())  # tensor parallel: the master is a DTensor of host shards
            staging = {"staging": (host.shape, self._records[id(param)].model_param.dtype, self.pin_cpu_params)}
            if self.grads_on_host:  # its record's `host_grad` is in the master's dtype already
                return staging
            return {"grad": (host.shape, host.dtype, self.pin_cpu_grads), **staging}
        local = local_shard(param.detach())  # this rank's shard of a DTensor param
        master_dtype = self._master_dtype(param)
        specs = {"master": (local.shape, master_dtype, self.pin_cpu_params)}
        converted = master_dtype != param.dtype
        if converted:
            # Serves both copies, so it is pinned when either direction asks for it.
            specs["staging"] = (local.shape, param.dtype, self.pin_cpu_grads or self.pin_cpu_params)
        specs["grad"] = (local.shape, master_dtype, self.pin_cpu_grads and not converted)
        return specs

    def _host_slot(self, param: torch.Tensor, views: dict[str, torch.Tensor]) -> HostSlot:
        record = self._records.get(id(param))
        if self._resident(param):
            # its own master; a DTensor's (tensor parallel) local shard, which the CPU step updates in place
            return HostSlot(param, local_shard(param.detach()), views.get("grad"), views["staging"], record=record)
        views["master"].copy_(local_shard(param.detach()))
        return HostSlot(param, views["master"], views["grad"], views.get("staging"), record=record)

    def _resident(self, param: torch.Tensor) -> bool:
        """A host-resident param: its record places it on the host, with the device tensor its updates go to."""
        record = self._records.get(id(param))
        return record is not None and record.on_host

    def _cpu_unit(
        self, cls: Callable[..., Optimizer] | None, groups: list[tuple[int, list[HostSlot]]], kwargs: dict
    ) -> CpuUnit:
        sub_groups = [
            {**hyper_params(self.param_groups[gid]), "params": [s.master for s in slots]} for gid, slots in groups
        ]
        cls = cls or self._default_cls(sub_groups, "cpu")
        slots = [slot for _, group_slots in groups for slot in group_slots]
        unit = CpuUnit(cls(sub_groups, **kwargs), [gid for gid, _ in groups], slots)
        for slot in unit.slots:
            self._route[id(slot.param)] = (unit.optimizer, slot.master)
        return unit

    def _build_device_optimizer(self, cls: Callable[..., Optimizer], kwargs: dict) -> Optimizer:
        # Mirrors every hybrid group (some may be empty) so group i maps to group i.
        keyed = [[(p, self._device_key(p)) for p in g["params"] if id(p) not in self._route] for g in self.param_groups]
        sub_groups = [
            {**hyper_params(g), "params": [key for _, key in pairs]} for g, pairs in zip(self.param_groups, keyed)
        ]
        optimizer = cls(sub_groups, **kwargs)
        for pairs in keyed:
            for param, key in pairs:
                self._route[id(param)] = (optimizer, key)
        return optimizer

    def _device_key(self, param: torch.Tensor) -> torch.Tensor:
        if not param.requires_grad or self._master_dtype(param) == param.dtype:
            return param
        master = param.detach().to(torch.float32, copy=True)
        self._device_masters.append((param, master))
        return master

    def _master_dtype(self, param: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.param_update_in_fp32 and param.dtype in _LOW_PRECISION else param.dtype

    def _fill_group_defaults(self) -> None:
        """Give our groups every hyper-parameter the device optimizer's groups have: the state dict of one AdamW."""
        for group, template in zip(self.param_groups, self._device_optimizer.param_groups):
            for key, value in template.items():
                if key not in ("params", "param_names"):
                    group.setdefault(key, value)
        for key, value in self._device_optimizer.defaults.items():
            self.defaults.setdefault(key, value)

    def _log_placement(self, params: list[torch.Tensor], offloaded: set[int]) -> None:
        trainable = sum(p.numel() for p in params if p.requires_grad)
        on_cpu = sum(p.numel() for p in params if id(p) in offloaded)
        logger.info(
            "HybridDeviceOptimizer: %d of %d trainable elements (%d params) stepped on the CPU; host buffers %.1f MiB",
            on_cpu,
            trainable,
            len(offloaded),
            self.memory_stats()["host_state_bytes"] / 2**20,
        )

    # ---- public API -----------------------------------------------------------------------------

    @property
    def sub_optimizers(self) -> list[Optimizer]:
        """The CPU sub-optimizers (one per param with overlap), then the device one."""
        return [unit.optimizer for unit in self._cpu_units] + [self._device_optimizer]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step both sides; the params are updated for the compute stream when this returns."""
        loss = evaluate_closure(closure)
        if self._states_offloaded:
            raise RuntimeError("optimizer states are offloaded; call reload_optimizer_states() before step()")
        if self._masters_stale:
            self._refresh_masters(keep_if_rounds_to_param=True)
        self._sync_param_groups()
        compute = self._acc.current_stream()
        # Grads are final, and the old params no longer read, only once the compute stream gets here: the D2H
        # copies wait for it as they start, the H2D copies (later, from the CPU step) for this event.
        self._params_read = compute.record_event()
        self._start_grad_copies()
        if self.overlap_cpu_optimizer_d2h_h2d and self._cpu_units:
            if self._cpu_worker is None:
                self._cpu_worker = self._acc.host_worker("hybrid-cpu-step")
            cpu_steps = self._cpu_worker.submit(self._step_cpu_units)
            self._step_device()
            cpu_steps.result()  # re-raises a failure of the CPU side
        else:
            self._step_device()
            self._step_cpu_units()
        self._wait_for_params(compute)
        return loss

    def close(self) -> None:
        """Stop the CPU-step thread, finish and stop the copy streams (cpu: their worker threads) and free
        the host slabs; the optimizer cannot step afterwards."""
        if self._cpu_worker is not None:
            self._cpu_worker.shutdown()
        finish_and_close(self._d2h.stream, self._h2d.stream)
        slabs = [self._offload_slab, *(unit.slab for unit in self._cpu_units)]
        for arena in [*self._host_arenas, *(slab for slab in slabs if slab is not None)]:
            arena.release()

    def memory_stats(self) -> dict[str, int]:
        """Optimizer bytes on the device now, their peak during the last step, and bytes in host memory (and
        on disk: the CPU share's states with `nvme_path`)."""
        cpu_states = sum(state_bytes(u.optimizer) for u in self._cpu_units)
        host = sum(sum(s.nbytes() for s in u.slots) for u in self._cpu_units)
        host += 0 if self.nvme_path else cpu_states
        if self._states_offloaded:
            host += state_bytes(self._device_optimizer)
        stats = {
            "device_state_bytes": self._device_state_bytes(),
            "peak_device_state_bytes": self._peak_device_state_bytes,
            "host_state_bytes": int(host),
        }
        if self.nvme_path:
            stats["disk_state_bytes"] = int(cpu_states)
        return stats

    @torch.no_grad()
    def sync_from_model(self) -> None:
        """Refresh every master copy from the model's params (after loading weights without optimizer state)."""
        self._refresh_masters(keep_if_rounds_to_param=False)

    def offload_optimizer_states(self) -> bool:
        """Move the device sub-optimizer's state tensors to host memory (frees it between phases); returns
        False when they are there already.

        They go into one pinned slab, allocated at the first offload and reused by later ones while the
        states keep their shapes: phases can alternate without a pinned allocation each time.
        """
        if self._states_offloaded:
            return False
        self._offload_slab = states_into_slab(self._device_optimizer, self._acc, pinned=True, reuse=self._offload_slab)
        self._states_offloaded = True
        return True

    def reload_optimizer_states(self) -> bool:
        """Bring the device sub-optimizer's states back where its step expects them; returns False when they
        are there already."""
        if not self._states_offloaded:
            return False
        optimizer = self._device_optimizer
        for key, state in optimizer.state.items():
            group = group_of(optimizer, key)
            for name, value in state.items():
                if torch.is_tensor(value):
                    state[name] = placed(value, key, name, group)
        self._states_offloaded = False
        return True

    def state_dict(self) -> dict[str, Any]:
        """The state dict of one plain optimizer of the rule (`torch.optim.AdamW`) over all params; tensors alias
        the live state, as in torch.

        CPU-side states of DTensor params come as DTensors laid out like the param (aliasing the host shards).
        """
        state_dict = super().state_dict()  # reads the live view in `self.state`
        params = [p for group in self.param_groups for p in group["params"]]
        # Own the per-param dicts: editing the result must not rebind our state.
        state_dict["state"] = {index: self._exported(params[index], s) for index, s in state_dict["state"].items()}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy an AdamW-layout state dict into the live sub-optimizer state and our param groups."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved_groups]:
            raise ValueError("loaded state dict's param groups do not match this optimizer's (count or sizes)")
        was_offloaded = self._states_offloaded
        self.reload_optimizer_states()
        # The model's weights are loaded with (`set_state_dict`: after) the optimizer: the next step
        # refreshes the masters from them.
        self._masters_stale = True
        saved_ids = [index for g in saved_groups for index in g["params"]]
        for index, param in zip(saved_ids, (p for g in groups for p in g["params"])):
            self._load_param_state(param, state_dict["state"].get(index, {}))
        for group, saved in zip(groups, saved_groups):
            # In place: whoever holds these dicts (an LR scheduler) keeps seeing the live groups.
            group.update({k: deepcopy(v) for k, v in saved.items() if k not in ("params", "param_names")})
        if was_offloaded:
            self.offload_optimizer_states()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ---- step internals -------------------------------------------------------------------------

    def _sync_param_groups(self) -> None:
        """Copy our groups' hyper-parameters (an LR scheduler may have changed them) into the sub-optimizers."""
        pairs = [(u.optimizer, u.group_ids) for u in self._cpu_units]
        pairs.append((self._device_optimizer, list(range(len(self.param_groups)))))
        for optimizer, group_ids in pairs:
            for sub_group, gid in zip(optimizer.param_groups, group_ids):
                sub_group.update(hyper_params(self.param_groups[gid]))

    def _start_grad_copies(self) -> None:
        # One stream task per unit (a copy per param inside it): on cpu every task is a thread hand-off.
        for unit in self._cpu_units:
            landings, grads = [], []
            for slot in unit.slots:
                if slot.host_grad is not None:  # gradient offload brought it already
                    slot.has_grad = True
                    continue
                grad = slot.device_grad
                slot.has_grad = grad is not None
                if slot.has_grad and slot.landing is not None:
                    landings.append(slot.landing)
                    grads.append(local_shard(grad))
            unit.grads_ready = self._d2h.copy(landings, grads)

    def _step_device(self) -> None:
        for param, master in self._device_masters:
            master.grad = None if param.grad is None else param.grad.to(master.dtype)
        self._peak_device_state_bytes = self._device_state_bytes()
        self._device_optimizer.step()
        # After the step: lazily created states and the transient fp32 grads both count.
        self._peak_device_state_bytes = max(self._peak_device_state_bytes, self._device_state_bytes())
        for param, master in self._device_masters:
            if master.grad is not None:
                param.copy_(master)
            master.grad = None

    @torch.no_grad()  # grad mode is per thread: the worker needs its own
    def _step_cpu_units(self) -> None:
        for index, unit in enumerate(self._cpu_units):
            if index + 1 < len(self._cpu_units) and self._cpu_units[index + 1].slab is not None:
                following = self._cpu_units[index + 1].slab
                following.prefetch(0, following.nbytes)  # NVMe: read ahead while this piece steps
            self._wait_for_grads(unit)
            self._step_cpu_unit(unit)
            if unit.slab is not None:
                unit.slab.write_back(0, unit.slab.nbytes)  # NVMe: out of memory behind the step

    def _wait_for_grads(self, unit: CpuUnit) -> None:
        """Block the host until the unit's grads have landed: the CPU step reads them next."""
        assert unit.grads_ready is not None
        unit.grads_ready.synchronize()

    def _step_cpu_unit(self, unit: CpuUnit) -> None:
        for slot in unit.slots:
            slot.master.grad = slot.step_grad() if slot.has_grad else None
        unit.optimizer.step()
        self._move_states_to_host_tier(unit)
        params, sources = [], []
        for slot in unit.slots:
            slot.master.grad = None
            if slot.has_grad:
                # Cast on the host so the H2D copy moves the param dtype's bytes, not fp32.
                params.append(slot.local_param)
                sources.append(slot.master if slot.staging is None else slot.staging.copy_(slot.master))
        self._h2d.copy(params, sources, after=self._params_read)

    def _move_states_to_host_tier(self, unit: CpuUnit) -> None:
        """Keep the CPU step's states in one host slab: the sub-optimizer creates them lazily as plain cpu
        tensors (a param's first grad, a load before the first step); moved once, later steps update them in
        place. On a device that is pageable host memory either way, but one buffer; on cpu it is the host tier,
        which `memory_allocated()` does not count (plain cpu tensors would count as device memory there).
        """
        if unit.slab is not None and len(unit.optimizer.state) == unit.slabbed_params:
            return
        old = unit.slab  # its views may be among the states copied: released after the copy
        unit.slab = states_into_slab(unit.optimizer, self._acc, pinned=False, directory=self.nvme_path)
        unit.slabbed_params = len(unit.optimizer.state)
        if old is not None:
            old.release()

    def _wait_for_params(self, compute: Stream) -> None:
        """The compute stream waits for the H2D copies: the next forward must read the updated params."""
        compute.wait_stream(self._h2d.stream)

    # ---- state internals ------------------------------------------------------------------------

    @torch.no_grad()
    def _refresh_masters(self, keep_if_rounds_to_param: bool) -> None:
        """Copy the params into the masters; optionally keep a higher-precision master that rounds to its param.

        Keeping it makes the refresh a no-op for params nobody changed, so a run that reloads its own
        optimizer state mid-run keeps its fp32 masters; any param changed since (a loaded checkpoint)
        restarts from the param's value (the fp32 masters' extra bits are not in checkpoints).
        """
        self._h2d.stream.synchronize()  # an H2D copy of the last step may still read a master
        for unit in self._cpu_units:
            for slot in unit.slots:
                if slot.resident:  # the param is its own master: nothing to refresh
                    continue
                if slot.staging is None:  # same dtype: the copy is exact
                    slot.master.copy_(slot.local_param)
                    continue
                slot.staging.copy_(slot.local_param)  # D2H in the param dtype
                if not (keep_if_rounds_to_param and torch.equal(slot.master.to(slot.staging.dtype), slot.staging)):
                    slot.master.copy_(slot.staging)
        for param, master in self._device_masters:
            local_param, local_master = local_shard(param.detach()), local_shard(master)
            if not (keep_if_rounds_to_param and torch.equal(local_master.to(local_param.dtype), local_param)):
                local_master.copy_(local_param)
        self._masters_stale = False

    def _exported(self, param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """A param's state for `state_dict()`: host shards of a DTensor param wrapped in the param's layout."""
        if not is_dtensor(param):
            return dict(state)
        _, key = self._route[id(param)]
        return {
            name: laid_out_like(value, param) if is_shard_state(value, key) else value for name, value in state.items()
        }

    def _load_param_state(self, param: torch.Tensor, saved: dict[str, Any]) -> None:
        optimizer, key = self._route[id(param)]
        live = optimizer.state[key]
        for name in [n for n in live if n not in saved]:
            del live[name]  # e.g. max_exp_avg_sq when the checkpoint ran without amsgrad
        group = group_of(optimizer, key)
        for name, value in saved.items():
            if is_dtensor(value) and not is_dtensor(key):
                value = self._local_shard(param, key, name, value)
            current = live.get(name)
            if torch.is_tensor(value) and torch.is_tensor(current) and current.shape == value.shape:
                current.copy_(value)  # into the live buffer: nothing keeps a stale reference
            elif torch.is_tensor(value):
                live[name] = placed(value, key, name, group)
            else:
                live[name] = deepcopy(value)

    @staticmethod
    def _local_shard(param: torch.Tensor, key: torch.Tensor, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a DTensor state loaded for a CPU-stepped param (its host key holds the shard)."""
        local = value.to_local()
        if local.dim() and local.shape != key.shape:
            raise ValueError(
                f"state {name!r} of a {tuple(param.shape)} param: local shard {tuple(local.shape)} does not match "
                f"this rank's param shard {tuple(key.shape)}; lay it out like the param (dcp.load does)"
            )
        return local

    def _device_state_bytes(self) -> int:
        states = 0 if self._states_offloaded else state_bytes(self._device_optimizer)
        masters = sum(
            local_nbytes(m) + (local_nbytes(m.grad) if m.grad is not None else 0) for _, m in self._device_masters
        )
        return int(states + masters)

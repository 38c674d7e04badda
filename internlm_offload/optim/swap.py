"""SwapAdamW: AdamW whose states live on the host between steps and visit the device inside `step()`.

What it may touch: its own `state` (host tensors between steps), the params and grads it is given
(updated in place on the device, as AdamW does), and the accelerator layer for streams, device
buffers and host memory. It never reads a config.

Layout: the trainable params are cut, in order and never across a param group, into chunks of about
half the step's device budget (`budget = ceil(total state bytes / swap_optimizer_times)`); a param is
never split, so one larger than half the budget is a chunk of its own. A chunk's states sit at
64-byte-aligned offsets of one flat device buffer, and at the same offsets of one host slab (the
arena), so a chunk moves in one copy each way. `use_pinned_optimizer_offload=True` pins the slab
(needed for copies that overlap on a device); False keeps it pageable. InternEvo and NeMo-RL allocate
a pageable host tensor per state when the flag is off; one slab holds the same bytes in one copy per
chunk instead of one per tensor.

Schedule of one `step()` (device picture; the cpu backend runs the same schedule on worker threads):
- chunks are taken in order; the next chunk's copy-in (H2D) runs while the current one is stepped,
  and stepped chunks are copied out (D2H) behind it; `prefetch()`, called before the last backward,
  starts the first chunk's copy-in while backward still runs;
- every copy-in first makes the copy stream wait for the compute stream: its device buffer may be
  memory the compute stream used a moment ago (freed after the compute stream waited for a copy-out);
- the device holds at most `budget` bytes of state (at least one chunk): a chunk's buffer is freed only
  after the compute stream waited for its copy-out, and the next copy-in is admitted only when the
  budget allows it.
The update is the update rule's step (`rule=`, optim/rules.py) over a chunk's params at once; the chunk's
states are those the rule names. AdamW's (the default) is torch's own kernel (`torch.optim.adam.adam` with
the group's flags and `decoupled_weight_decay=True`); the kernels are elementwise, so params and states are
bitwise those of `torch.optim.AdamW` with the same arguments. A param is never split across chunks, so a
rule that needs whole parameters gets them; over DTensor shards it gets each as its DTensor, to gather from
(Muon), and the chunks are then cut at the same params on every rank (its gathers are collectives).

With `swap_params=True` the parameters themselves live on the host too (fp32 master weights of a
low-precision model, as ZeRO-Offload keeps them): each parameter's `ParamRecord` (optim/records.py,
`records=`) then holds `device_grad`, its gradient on the device, and `model_param`, the device tensor
(e.g. the bf16 weight the model computes with) that receives the updated value in its own dtype. The
parameter is swapped in and out with its states, so between steps the device holds neither masters nor
states.

With `host_grads=True` the gradients are host tensors too (the records' `host_grad`, from gradient
offload, `optim.grad_offload`): each is copied in with its chunk, into the chunk's device buffer, and never
out. A prefetched chunk's gradients are copied at `step()`, when they are final.

Without records every parameter's gradient is its `.grad` (plain swap AdamW).

With `nvme_path` (the NVMe tier) the arena is a file in that directory, mapped (`HostArena(directory=...)`,
`device/disk_buffers.py`): the pipeline is the same, and it steers the kernel: a chunk's copy-in asks for
the next chunk's pages to be read ahead, and a chunk's states are written back and dropped from memory
once its copy-out landed; host memory then holds the chunks in flight, not the states.

Memory saved vs time paid: the device holds `1 / swap_optimizer_times` of the optimizer states (8 bytes
per fp32 parameter, 12 with amsgrad) instead of all of them; each step moves every state twice over the
host link. More chunks: less device memory, smaller copies that overlap less well.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from internlm_offload.device import (
    Accelerator,
    CopyLane,
    Event,
    HostArena,
    accelerator_for,
    aligned_offsets,
    finish_and_close,
    round_up,
    view_at,
)
from internlm_offload.log import get_logger
from internlm_offload.optim.adamw import consecutive_runs
from internlm_offload.optim.adamw_rule import ADAMW
from internlm_offload.optim.dtensor import is_dtensor, laid_out_like, local_nbytes, local_shard
from internlm_offload.optim.interface import OffloadOptimizer, evaluate_closure
from internlm_offload.optim.records import ParamRecord, records_by_master
from internlm_offload.optim.rules import StateSpec, UpdateRule, fill_defaults, rule_for

logger = get_logger(__name__)

PARAM = "param"  # slot of a host-resident parameter in a chunk
GRAD = "grad"  # slot of a host-resident gradient (gradient offload): copied in, never out
OUTSIDE_ARENA = (PARAM, GRAD)  # slots whose host tensor is the param's own, not an arena view
SLOT_ALIGNMENT = 64  # bytes between a chunk's tensors: a cache line, enough for vectorised kernels


@dataclass(eq=False)
class _Slot:
    """One tensor of a chunk: a state of a param (or the param itself) at `offset` bytes into the chunk."""

    param: torch.Tensor
    key: str
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


@dataclass(eq=False)
class _Chunk:
    """Consecutive params of one group whose states move and are stepped together."""

    group: dict[str, Any]
    params: list[torch.Tensor]
    slots: list[_Slot]  # the states first (contiguous in the arena), then host-resident params and grads
    nbytes: int  # device bytes, padding included
    arena_start: int = 0  # where the states start in the arena
    states_nbytes: int = 0  # bytes from the first to the end of the last state slot
    has_complex: bool = False  # AdamW's kernels view complex params as real pairs
    device: torch.Tensor | None = field(default=None, repr=False)  # flat buffer while staged
    stepped: list[torch.Tensor] = field(default_factory=list, repr=False)  # params updated this step
    copied_in: Event | None = field(default=None, repr=False)
    copied_out: Event | None = field(default=None, repr=False)
    views: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)  # (id(param), key) -> view

    def stage(self, buffer: torch.Tensor) -> None:
        """Take `buffer` as the chunk's device memory (views made once: the step reads each several times)."""
        self.device = buffer
        self.views = {(id(s.param), s.key): view_at(buffer, s.offset, s.shape, s.dtype) for s in self.slots}

    def unstage(self) -> torch.Tensor:
        """Give up the device memory; returns the buffer."""
        buffer, self.device, self.views = self.device, None, {}
        return buffer

    def view(self, slot: _Slot) -> torch.Tensor:
        """The slot's tensor in the device buffer."""
        return self.views[id(slot.param), slot.key]


class SwapAdamW(OffloadOptimizer, torch.optim.AdamW):
    """Drop-in `torch.optim.AdamW` with host-resident states; see the module docstring.

    Extra args (InternEvo's key names): `swap_optimizer_times` (the step's device memory is
    `1/times` of the states), `use_pinned_optimizer_offload` (the host slab holding every state is
    pinned; else pageable), `swap_params` (the params are host
    tensors with a device gradient; see the module docstring), `host_grads` (the gradients are host
    tensors, swapped in with the states), `nvme_path` (the arena is a file in this directory, the NVMe
    tier; see the module docstring), `records` (the params' `ParamRecord`s, from the masters layer: where
    each gradient is and which model tensor an update goes to; without them, `.grad` and the param itself),
    `accelerator` (default: the params' device's, `accelerator_for`), `rule` (the update rule stepped: its states
    are what is swapped; default AdamW), `rules` (by name, those that param groups name under
    `optim.rules.RULE_KEY`).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        swap_optimizer_times: int = 16,
        use_pinned_optimizer_offload: bool = False,
        swap_params: bool = False,
        host_grads: bool = False,
        nvme_path: str | None = None,
        records: Iterable[ParamRecord] | None = None,
        accelerator: Accelerator | None = None,
        rule: UpdateRule = ADAMW,
        rules: Mapping[str, UpdateRule] | None = None,
    ) -> None:
        if swap_optimizer_times < 1:
            raise ValueError(f"swap_optimizer_times={swap_optimizer_times} must be >= 1")
        self.rule = rule  # before the groups are added: each gets its rule's defaults
        self.rules = dict(rules or {})
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
        )
        self.swap_optimizer_times = swap_optimizer_times
        self.accelerator = accelerator or accelerator_for(p for g in self.param_groups for p in g["params"])
        self.use_pinned_optimizer_offload = use_pinned_optimizer_offload
        if self.accelerator.supports_pinned_memory and not use_pinned_optimizer_offload:
            logger.warning(
                "swap optimizer: use_pinned_optimizer_offload=False keeps the states in pageable memory; on %s "
                "their copies then block the host and overlap nothing. Set use_pinned_optimizer_offload=True",
                self.accelerator.name,
            )
        self.swap_params = swap_params
        self.host_grads = host_grads
        self.nvme_path = nvme_path
        self._records = records_by_master(records)
        if not swap_params and any(record.on_host for record in self._records.values()):
            raise ValueError("records of host-resident masters need swap_params=True: they are swapped in and out")
        self._chunks: list[_Chunk] | None = None
        self._layout_key: tuple | None = None
        self._budget = 0
        self._arena: HostArena | None = None
        self._arena_offsets: dict[tuple[int, str], int] = {}
        self._prefetched: _Chunk | None = None
        self._h2d = CopyLane(self.accelerator)
        self._d2h = CopyLane(self.accelerator)
        self._device_state_bytes = 0
        self._peak_device_state_bytes = 0
        if nvme_path is not None:
            self._ensure_layout()  # reserve the file now: a full disk fails at start, not at the first step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        fill_defaults(self.param_groups[-1], self._rule(self.param_groups[-1]))  # AdamW's: all there already

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's Adam reads every state's `step` here (load_state_dict ends with it): a rule without one (Muon's
        # momentum buffer alone) joins after it
        stepless = {p: s for p, s in state["state"].items() if s and "step" not in s}
        kept = defaultdict(dict, {p: s for p, s in state["state"].items() if p not in stepless})
        super().__setstate__({**state, "state": kept})
        self.state.update(stepless)

    # ------------------------------------------------------------------ layout

    def _ensure_layout(self) -> None:
        """Cut the params into chunks (and allocate the arena) once; again only if the groups' states changed."""
        key = tuple((self._rule(g).state_keys(g), tuple(map(id, g["params"]))) for g in self.param_groups)
        if key == self._layout_key:
            return
        self._finish_pending()
        per_param = [(p, g, self._slot_specs(p, g)) for g in self.param_groups for p in g["params"] if p.requires_grad]
        # chunks hold whole local tensors (a DTensor's is its shard). A rule gathering a DTensor's matrices (Muon)
        # issues collectives in chunk order, so every rank must cut at the same params: sized from global shapes
        gathering = any(
            self._rule(g).whole_params and any(is_dtensor(p) for p in g["params"]) for g in self.param_groups
        )
        sizes = [_slots_size(p, specs, even=gathering) for p, _, specs in per_param]
        self._budget = max(1, math.ceil(sum(sizes) / self.swap_optimizer_times))
        self._chunks = _cut_chunks(per_param, sizes, target=max(1, self._budget // 2))
        self._build_arena()
        self._layout_key = key
        self._adopt_states()

    def _rule(self, group: dict[str, Any]) -> UpdateRule:
        return rule_for(group, self.rule, self.rules)

    def _slot_specs(self, param: torch.Tensor, group: dict[str, Any]) -> list[tuple[str, torch.Size, torch.dtype]]:
        """The param's tensors that travel: the rule's states, then the param and its gradient where they are host
        tensors."""
        local = local_shard(param)
        specs = [(s.key, s.shape, s.dtype) for s in self._rule(group).state_specs(local, group)]
        specs += [(PARAM, local.shape, local.dtype)] if self.swap_params else []
        return specs + ([(GRAD, local.shape, local.dtype)] if self.host_grads else [])

    def _build_arena(self) -> None:
        old = self._arena
        self._arena, self._arena_offsets = None, {}
        specs, owners = [], []
        for chunk in self._chunks:
            for slot in chunk.slots:
                if slot.key not in OUTSIDE_ARENA:
                    specs.append((slot.shape, slot.dtype))
                    owners.append(slot)
        arena = HostArena(
            self.accelerator,
            specs,
            pinned=self.use_pinned_optimizer_offload,
            alignment=SLOT_ALIGNMENT,
            directory=self.nvme_path,
        )
        for slot, offset in zip(owners, arena.offsets):
            self._arena_offsets[id(slot.param), slot.key] = offset
        for chunk in self._chunks:
            states = [s for s in chunk.slots if s.key not in OUTSIDE_ARENA]  # a rule without states: no chunk here
            chunk.arena_start = self._arena_offsets[id(states[0].param), states[0].key] - states[0].offset
            chunk.states_nbytes = states[-1].offset + states[-1].nbytes
        self._arena = arena
        kind = "pinned host buffer" if self.use_pinned_optimizer_offload else "pageable host buffer"
        where = f"file under {self.nvme_path}" if self.nvme_path else kind
        logger.info("Optimizer arena: %d states in one %.1f MB %s", len(specs), arena.nbytes / 2**20, where)
        if old is not None:
            old.release()

    def _host_buffer(self, param: torch.Tensor, spec: StateSpec) -> torch.Tensor:
        """Host storage for one state tensor of `param`: its arena view; a pageable buffer of its own for a
        param that is in no chunk (a loaded state of a frozen param)."""
        offset = self._arena_offsets.get((id(param), spec.key))
        if offset is not None:
            host = self._arena.span(offset, spec.nbytes).view(spec.dtype).view(spec.shape)
        else:
            host = self.accelerator.host_empty(spec.shape, spec.dtype, pinned=False)
        return laid_out_like(host, param) if spec.per_element else host

    def _adopt_states(self) -> None:
        """Move every existing state tensor into its host buffer (after a load or a new layout)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                for spec in [
                    s for s in self._rule(group).state_specs(local_shard(p), group) if state and s.key in state
                ]:
                    value = local_shard(state[spec.key])
                    host = self._host_buffer(p, spec)
                    if host.data_ptr() != value.data_ptr() or not spec.per_element:
                        local_shard(host).copy_(value.reshape(spec.shape))
                    state[spec.key] = host

    def _init_host_state(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        """The rule's lazy state init, with the tensors on the host."""
        state = self.state[param]
        state.update(self._rule(group).host_states(group))
        for spec in self._rule(group).state_specs(local_shard(param), group):
            state[spec.key] = self._host_buffer(param, spec)
            local_shard(state[spec.key]).zero_()

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = evaluate_closure(closure)
        self._ensure_layout()
        active = self._init_missing_states()
        staged: deque[_Chunk] = deque()
        if self._prefetched is not None:
            staged.append(self._grads_in(self._prefetched, active))
            self._prefetched = None
        self._peak_device_state_bytes = self._device_state_bytes
        copying_out: deque[_Chunk] = deque()
        upcoming = deque(c for c in self._chunks if c not in staged and any(p in active for p in c.params))
        while staged or upcoming:
            self._admit(upcoming, staged, copying_out, active)
            current = staged.popleft()
            current.copied_in.wait()  # compute waits for this chunk's states
            self._update(current, active)
            self._copy_out(current)
            copying_out.append(current)
        while copying_out:
            self._release(copying_out.popleft())
        assert self._device_state_bytes == 0
        return loss

    def prefetch(self) -> None:
        """Start the first chunk's copy-in now, so it overlaps the rest of backward (a no-op until states exist).

        Call it before the last backward of a step; `step()` picks the chunk up. The states are only
        read, so grads need not be ready; anything that changes the host states first (a load) drops it.
        """
        if self._prefetched is not None or not self._chunks:
            return
        self._ensure_layout()
        first = self._chunks[0]
        if any(self.state.get(p) for p in first.params):
            self._prefetched = self._copy_in(first)

    def _init_missing_states(self) -> dict[torch.Tensor, torch.Tensor]:
        """Each param to step now, with its grad; creates missing host states (zeros) first."""
        active, fresh = {}, []
        for group in self.param_groups:
            for p in group["params"]:
                grad = self._grad(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("SwapAdamW does not support sparse gradients")
                active[p] = grad
                if not self.state[p]:
                    fresh.append((p, group))
        if fresh:
            # A copy-out of the last step may still write these (arena) bytes, a prefetch read them.
            self._finish_pending()
            for p, group in fresh:
                self._init_host_state(p, group)
        return active

    def _grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient to apply: its record's (host with gradient offload, else on the device for a host-resident
        parameter); its `.grad` without one, or when DCP's state init steps with zero grads set on the params."""
        record = self._records.get(id(param))
        return param.grad if record is None else record.grad()

    def _admit(self, upcoming: deque, staged: deque, copying_out: deque, active: Collection[torch.Tensor]) -> None:
        """Start copy-ins while the device budget allows; free finished copy-outs to make room."""
        while upcoming:
            fits = self._device_state_bytes + upcoming[0].nbytes <= self._budget
            if fits or self._device_state_bytes == 0:
                staged.append(self._copy_in(upcoming.popleft(), active))
            elif copying_out:
                self._release(copying_out.popleft())
            elif staged:
                return  # the staged ones must be stepped first
            else:
                raise AssertionError("device state accounting out of sync")

    def _copy_in(self, chunk: _Chunk, active: Collection[torch.Tensor] | None = None) -> _Chunk:
        """Start moving the chunk's states in (those of `active` params only, when given per tensor)."""
        chunk.stage(self.accelerator.device_buffer(chunk.nbytes))
        # The buffer may be memory the compute stream just released (after it waited for a copy-out): the
        # lane's copy starts after the compute stream's work so far.
        chunk.copied_in = self._h2d.copy(*zip(*self._copies(chunk, params=active, grads=active is not None)))
        self._prefetch_after(chunk)
        self._device_state_bytes += chunk.nbytes
        self._peak_device_state_bytes = max(self._peak_device_state_bytes, self._device_state_bytes)
        return chunk

    def _grads_in(self, chunk: _Chunk, active: dict[torch.Tensor, torch.Tensor]) -> _Chunk:
        """Copy a prefetched chunk's host gradients in (a no-op without them): they were not final at prefetch."""
        pairs = self._grad_copies(chunk, {id(p) for p in active})
        if pairs:  # queued behind the states' copy on the same stream: the new event covers both
            chunk.copied_in = self._h2d.copy(*zip(*pairs))
        return chunk

    def _copies(
        self, chunk: _Chunk, params: Collection[torch.Tensor] | None, grads: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device, host) pairs moving the chunk: one for all its states (a span of the arena, the same bytes as
        the device buffer's start), one per host-resident param of `params` (None: every param) and, with
        `grads`, one per host gradient of `params`."""
        pairs = [(chunk.device[: chunk.states_nbytes], self._arena.span(chunk.arena_start, chunk.states_nbytes))]
        wanted = None if params is None else {id(p) for p in params}
        for slot in chunk.slots:
            if slot.key == PARAM and (wanted is None or id(slot.param) in wanted):
                pairs.append((chunk.view(slot), local_shard(slot.param.detach())))
        return pairs + (self._grad_copies(chunk, wanted) if grads else [])

    def _grad_copies(self, chunk: _Chunk, wanted: set[int] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device, host) pairs moving the host gradients of the chunk's `wanted` params (ids; None: all) in."""
        return [
            (chunk.view(slot), local_shard(self._grad(slot.param)))
            for slot in chunk.slots
            if slot.key == GRAD and (wanted is None or id(slot.param) in wanted)
        ]

    def _update(self, chunk: _Chunk, active: dict[torch.Tensor, torch.Tensor]) -> None:
        """The rule's step on the chunk's params that have grads: their states' device views, host-kept states
        (AdamW's `step` for non-fused kernels) as they are."""
        group, views = chunk.group, chunk.views
        chunk.stepped = [p for p in chunk.params if p in active]
        if not chunk.stepped:
            return
        targets = [views[id(p), PARAM] if self.swap_params else local_shard(p) for p in chunk.stepped]
        states = {key: [self.state[p][key] for p in chunk.stepped] for key in self._rule(group).host_states(group)}
        states.update({key: [views[id(p), key] for p in chunk.stepped] for key in self._rule(group).state_keys(group)})
        grads = [views[id(p), GRAD] if self.host_grads else local_shard(active[p]) for p in chunk.stepped]
        rule = self._rule(group)
        # a rule stepping whole matrices (Muon) sees each shard as the DTensor it is part of, and gathers from it
        layout = (lambda ts: [laid_out_like(t, p) for t, p in zip(ts, chunk.stepped)]) if rule.whole_params else list
        rule.step(
            layout(targets),
            layout(grads),
            {key: layout(tensors) for key, tensors in states.items()},
            group,
            has_complex=chunk.has_complex,
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
        )
        for p, target in zip(chunk.stepped, targets):
            record = self._records.get(id(p))
            if record is not None and record.on_host:
                record.model_param.copy_(target)  # rounds into the model's dtype, on the compute stream

    def _copy_out(self, chunk: _Chunk) -> None:
        device_views, hosts = zip(*self._copies(chunk, params=chunk.stepped))
        chunk.copied_out = self._d2h.copy(hosts, device_views)  # the lane waits for the update first

    def _prefetch_after(self, chunk: _Chunk) -> None:
        """NVMe: the kernel reads the next chunk's states in while this one is copied and stepped."""
        index = self._chunks.index(chunk) + 1
        if index < len(self._chunks):
            following = self._chunks[index]
            self._arena.prefetch(following.arena_start, following.states_nbytes)

    def _release(self, chunk: _Chunk) -> None:
        """Free a chunk's device buffer once its copy-out finished (NVMe: its states are written back behind)."""
        chunk.copied_out.wait()
        if chunk.stepped:
            self._arena.write_back(chunk.arena_start, chunk.states_nbytes)
        self.accelerator.free_device_buffer(chunk.unstage())
        self._device_state_bytes -= chunk.nbytes

    def _finish_pending(self) -> None:
        """Wait for the copies in flight and drop a prefetched chunk (its device copy may be stale)."""
        if self._prefetched is not None:
            self._prefetched.copied_out = self._prefetched.copied_in  # nothing to copy out: release waits the copy-in
            self._release(self._prefetched)
            self._prefetched = None
        self.finish_copies()

    # ------------------------------------------------------------------ state dict and memory

    def state_dict(self) -> dict[str, Any]:
        self.finish_copies()
        return super().state_dict()

    def close(self) -> None:
        """Finish the copies and stop the copy streams (cpu: their worker threads) and the arena's write-backs;
        no step afterwards."""
        finish_and_close(self._h2d.stream, self._d2h.stream)
        if self._arena is not None and self._arena.disk is not None:
            self._arena.disk.release()  # its write-backs finish and its thread stops; the states stay readable

    def finish_copies(self) -> None:
        """`step()` returns with its last copy-outs only ordered on the device; readers of the host
        states' values (state_dict, load_state_dict, checkpoints) wait for them here."""
        self._d2h.stream.synchronize()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load AdamW's layout (ours or a plain AdamW's) and move every state into host buffers."""
        self._finish_pending()
        super().load_state_dict(state_dict)
        self._layout_key = None  # the groups' flags may have changed with the load
        self._ensure_layout()
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                for key in [k for k in self._rule(group).host_states(group) if state and k in state]:
                    state[key] = state[key].to("cpu", copy=True)

    def memory_stats(self) -> dict[str, int]:
        """Byte counts (sizes, not values): no wait for a write-back still running; metrics read them every step."""
        states = sum(local_nbytes(t) for s in self.state.values() for t in s.values() if isinstance(t, torch.Tensor))
        on_disk = self.nvme_path is not None
        stats = {
            "device_state_bytes": self._device_state_bytes,
            "peak_device_state_bytes": self._peak_device_state_bytes,
            "host_state_bytes": 0 if on_disk else states,
        }
        if on_disk:
            stats["disk_state_bytes"] = states
        if self.swap_params:
            stats["host_param_bytes"] = sum(local_nbytes(p) for g in self.param_groups for p in g["params"])
        return stats

    def offload_optimizer_states(self) -> bool:
        """States already live on the host between steps: nothing to move. Returns False (no-op)."""
        return False

    def reload_optimizer_states(self) -> bool:
        """States come to the device only inside `step()`. Returns False (no-op)."""
        return False


def _slots_size(param: torch.Tensor, specs: list, *, even: bool) -> int:
    """A param's device bytes in a chunk (every slot starts aligned: the sum of its slots' padded sizes). `even`:
    a DTensor's shard-shaped slots counted as an even split of the global tensor, the same on every rank."""

    def numel(shape: torch.Size) -> int:
        if even and is_dtensor(param) and shape == local_shard(param).shape:
            return math.ceil(param.numel() / param.device_mesh.size())
        return shape.numel()

    return sum(round_up(numel(shape) * dtype.itemsize, SLOT_ALIGNMENT) for _, shape, dtype in specs)


def _cut_chunks(per_param: list[tuple[torch.Tensor, dict, list]], sizes: list[int], target: int) -> list[_Chunk]:
    """Consecutive params of one group, up to `target` bytes (`sizes`, one per param) per chunk (a larger param
    alone)."""
    size = {id(param): size for (param, _, _), size in zip(per_param, sizes)}
    runs = consecutive_runs(per_param, group_of=lambda item: id(item[1]), size_of=lambda item: size[id(item[0])],
                            target=target)  # fmt: skip
    return [_layout_chunk(run[0][1], [(param, specs) for param, _, specs in run]) for run in runs]


def _layout_chunk(group: dict, members: list[tuple[torch.Tensor, list]]) -> _Chunk:
    """Offsets of the members' tensors in one buffer: every state first, then host-resident params, then grads."""
    entries = [(p, k, shape, dtype) for p, specs in members for k, shape, dtype in specs if k not in OUTSIDE_ARENA]
    for outside in OUTSIDE_ARENA:
        entries += [(p, k, shape, dtype) for p, specs in members for k, shape, dtype in specs if k == outside]
    offsets, end = aligned_offsets([(shape, dtype) for _, _, shape, dtype in entries], SLOT_ALIGNMENT)
    slots = [_Slot(p, k, off, torch.Size(shape), dtype) for (p, k, shape, dtype), off in zip(entries, offsets)]
    params = [p for p, _ in members]
    return _Chunk(group, params, slots, round_up(end, SLOT_ALIGNMENT), has_complex=any(p.is_complex() for p in params))

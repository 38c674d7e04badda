"""Trace training steps of a config on meta tensors and read off its memory, per rank.

`trace_step(cfg, world_size)` builds the run with the builder's own `build_components` and the
planning stand-ins (`standins.py`), then runs the trainer's own `train_step` three times on
micro-batches of the configured shape: the first step creates the optimizer's lazy states, the second
is the steady state the memory figures describe, the third is counted for the cost model. Nothing is
allocated: every tensor is a meta tensor, counted by the tracker from its creation to its last
reference. With `world_size > 1` the process group is torch's fake backend: collectives do nothing, so
the trace is rank 0's, with the shapes of `world_size` ranks. FSDP2 runs as built (`fsdp2_on_meta`
stands in for its device assumptions): its shards, all-gathered blocks and reduce-scatter
buffers are counted like any tensor, and the in-place `resize_` with which it frees and re-allocates
unsharded parameters is counted too. DDP is traced as one process plus its gradient buckets (a flat
copy of every trainable gradient, `gradient_as_bucket_view=False` as `apply_ddp` builds it): its
reducer's C++ parts need real memory. FSDP2's CPU offload policy keeps the shards, their gradients
and the optimizer's states in host memory: the trace counts the shards as host memory once built,
each gradient shard's device-to-host copy as host memory (the tracker makes it on meta), and the
device copy each shard gets before its all-gather as device memory (`fsdp2_on_meta`).

Numbers are what `memory_allocated()` reports on a device: live tensor bytes (not the caching
allocator's reserve, the CUDA context or NCCL buffers).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves

from internlm_offload.builder import build_components, make_trainer
from internlm_offload.config import RunConfig, chunked_loss, expert_ranks
from internlm_offload.config.pipeline import splits_backward, stage_sequence_parts
from internlm_offload.data.loader import MicroBatch
from internlm_offload.device import get_accelerator, storage_key
from internlm_offload.engine.expert_parallel import expert_params, moe_blocks
from internlm_offload.engine.pipeline import PipelineRunner
from internlm_offload.engine.runtime import RunContext, expert_mesh, parallel_meshes
from internlm_offload.engine.trainer import Trainer
from internlm_offload.family import capabilities
from internlm_offload.model.quantized import scale_tensors
from internlm_offload.optim.records import ParamRecord
from internlm_offload.planner.cost import FlopCounter, StepWork, WorkCounter, extra_flops
from internlm_offload.planner.meta_cache import MetaKernelCache
from internlm_offload.planner.pipeline import LocalSchedule, StageMemory, rank_in_flight
from internlm_offload.planner.standins import (
    PlanningAccelerator,
    expert_dispatch_on_meta,
    flash_attention_on_meta,
    fsdp2_on_meta,
    fused_optimizers_on_meta,
    grouped_mm_on_meta,
    packed_sequences_on_meta,
)
from internlm_offload.planner.tracker import StorageTracker, plain_tensors

# The first creates the optimizer states, the second is the steady state the memory figures describe,
# the third is counted for the cost model (FLOPs, copies, optimizer elements).
TRACED_STEPS = 3
# The first micro-batch of a step creates the grads, the second accumulates into them; every later one
# repeats the second's memory exactly (same shapes, same saved tensors), so two stand for micro_num.
TRACED_MICRO_BATCHES = 2
# Answer repeated meta ops from their recorded output shapes (planner/meta_cache.py): the same figures in about
# half the time. Off only to test that claim.
MEMOISE_KERNELS = True


# A stretch of the steady step between two marks (`_Probe.mark`): its label, the block it runs (-1: none),
# its device and host peaks, and the device and host bytes live at its end.
Segment = tuple[str, int, int, int, int, int]


class UnsupportedLayout(ValueError):
    """A config the trace cannot run (one line naming the key and what is supported)."""


@dataclass
class StepMemory:
    """Per-rank bytes of one traced config; `components` maps a name to bytes (host ones say so)."""

    world_size: int
    device_peak_bytes: int  # the steady step's peak, everything live included
    host_peak_bytes: int  # host tier: offloaded states, host masters, activation and optimizer buffers
    components: dict[str, int]
    # Device bytes each decoder block leaves alive after its forward; with offload the sources of the block
    # before are released during it, so an offloaded block's figure nets its own against those.
    block_activation_bytes: list[int]
    first_step_device_peak_bytes: int = 0  # lazy state creation can make the first step's peak higher
    disk_peak_bytes: int = 0  # the NVMe tier: the swap optimizer's states in a file
    micro_num: int = 1
    micro_batch_work: StepWork = field(default_factory=StepWork)  # one micro-batch of the steady step
    optimizer_work: StepWork = field(default_factory=StepWork)  # the steady step's `optimizer.step()`
    # The steady step cut where each block starts its forward and backward (`_Probe.segment_hooks`); the largest
    # device figure is `device_peak_bytes`. What `compose.py` composes a peak from; not part of the report.
    segments: list[Segment] = field(default_factory=list)
    first_segments: list[Segment] = field(default_factory=list)  # the first step's, likewise
    # A pipeline: the most stage micro-batches this rank holds in flight (torch's schedule order), and every
    # pipeline rank's figures (the fields above are the worst rank's); 1 and empty without one.
    in_flight: int = 1
    stages: list[StageMemory] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        report = asdict(self)
        del report["segments"], report["first_segments"]
        return report


class _TracingTrainer(Trainer):
    """The trainer with its one host sync answered by zeros: a traced step has no values, and a finite
    loss and norm take the path that steps the optimizer."""

    def read_floats(self, values: torch.Tensor) -> list[float]:
        return [0.0] * values.numel()


@dataclass
class _Probe:
    """Readings taken by hooks during the steady step (the last micro-batch's forward wins: all save the same)."""

    tracker: StorageTracker
    records: list[ParamRecord]  # the masters' records: where `step()` finds each gradient
    per_step: bool = False  # a pipeline: one micro-batch's work is the step's mean
    block_growth: dict[int, int] = field(default_factory=dict)
    forward_growth: int = 0
    grads_bytes: int = 0
    counter: WorkCounter | None = None  # copies and AdamW elements, while the steady step runs
    flops: FlopCounter | None = None
    micro_batch_work: StepWork | None = None  # the first micro-batch of the steady step
    optimizer_work: StepWork = field(default_factory=StepWork)  # the step's once-per-step work
    forwards: int = 0
    _flops_before_step: int = 0
    segments: list[Segment] | None = None  # recorded while a list (the steady step)
    _open: tuple[str, int] = ("", -1)  # the segment being recorded: its label and block
    _before: dict[Any, int] = field(default_factory=dict)

    def mark(self, label: str, block: int = -1) -> None:
        """End the open segment of the steady step and open one named `label` (`block`: the block it runs)."""
        if self.segments is None:
            return
        tracker = self.tracker
        peaks = tracker.take_window("device"), tracker.take_window("host")
        self.segments.append((*self._open, *peaks, tracker.live_bytes("device"), tracker.live_bytes("host")))
        self._open = (label, block)

    def recorded(self, step: Any) -> list[Segment]:
        """The segments of `step()`, the first holding what is live as it starts."""
        live = self.tracker.live_bytes("device"), self.tracker.live_bytes("host")
        self.segments, self._open = [("at rest", -1, *live, *live)], ("step start", -1)
        step()
        self.mark("end")
        segments, self.segments = self.segments, None
        return segments

    def segment_hooks(self, model: nn.Module, layers: nn.ModuleList) -> list[Any]:
        """Marks where a micro-batch's forward starts and ends, where each block's forward starts (again when
        recomputed) and, through a hook on its output's gradient, where its backward starts: every block of a
        run with the same plan repeats the same segments (what `compose.py` relies on)."""
        handles = [
            model.register_forward_pre_hook(lambda *_: self.mark("forward")),
            model.register_forward_hook(lambda *_: self.mark("head")),
        ]
        for index, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(lambda *_, i=index: self.mark("block forward", i)))
            handles.append(layer.register_forward_hook(self._backward_mark(index)))
        return handles

    def _backward_mark(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            grads = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if self.segments is not None and grads:
                grads[0].register_hook(lambda grad: self.mark("block backward", index))

        return hook

    def _counted(self) -> StepWork:
        flops = self.flops.get_total_flops() - self.counter.sharded_flops_surplus
        return dataclasses.replace(self.counter.work, flops=flops)

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Work beyond `forwards` copies of the first micro-batch's (the swap optimizer's prefetch during
        the last backward) happens once per step: it goes with the optimizer's."""
        self.grads_bytes = _grads_bytes(optimizer, self.records)
        if self.counter is not None:
            total = self._counted()
            if self.per_step:  # a pipeline rank interleaves its micro-batches' passes: their mean
                self.micro_batch_work = total.scaled(1 / self.forwards)
            self.micro_batch_work = self.micro_batch_work or total
            self.optimizer_work = total - self.micro_batch_work.scaled(self.forwards)
            self.counter.work = StepWork()
            self._flops_before_step = total.flops

    def after_optimizer_step(self) -> None:
        """The step's own work, its FLOPs (Muon's Newton-Schulz) too: the FLOP counter's total runs on."""
        if self.counter is not None:
            step = self._counted()
            step.flops -= self._flops_before_step
            self.optimizer_work = self.optimizer_work + step
            self.counter = None

    def hooks(self, model: nn.Module, layers: nn.ModuleList) -> list[Any]:
        """Forward hooks on the model and on each block, recording how much device memory each leaves alive."""
        handles = [
            model.register_forward_pre_hook(self._enter("model")),
            model.register_forward_hook(self._leave("model")),
        ]
        for index, block in enumerate(layers):
            handles.append(block.register_forward_pre_hook(self._enter(index)))
            # FSDP2's own hooks gather the block's params before this pre-hook and reshard them after a
            # forward hook appended here: read before the reshard, so the params count on neither side.
            resharded = isinstance(block, FSDPModule)
            handles.append(block.register_forward_hook(self._leave(index), prepend=resharded))
        return handles

    def _enter(self, key: Any) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._before[key] = self.tracker.live_bytes("device")
            if key == "model" and self.counter is not None:
                self.forwards += 1
                if self.forwards == 2:  # the first micro-batch's forward and backward are done
                    self.micro_batch_work = self._counted()

        return hook

    def _leave(self, key: Any) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            growth = self.tracker.live_bytes("device") - self._before[key]
            if key == "model":
                self.forward_growth = growth
            else:
                self.block_growth[key] = growth

        return hook


def planned_device(cfg: RunConfig) -> str:
    """The accelerator whose kernels the trace takes: the config's `device`, or for "auto" this machine's (the
    preflight's is the run's own; a plan made away from the cluster takes cpu's unless the config names its device:
    MLA's attention keeps T x T weights on cpu, not on a device: `standins.flash_attention_on_meta`)."""
    return cfg.device if cfg.device != "auto" else get_accelerator().name


def micro_batches(cfg: RunConfig, every: bool = False) -> list[MicroBatch]:
    """Host micro-batches of the configured shape: (micro_bsz, seq_len) rows, or one packed row with
    `position_ids` when InternEvo data keeps documents apart (as the loader makes them); at most
    `TRACED_MICRO_BATCHES` of them unless `every` (a pipeline's schedule order depends on their number)."""
    data = cfg.data
    packed_apart = data.type == "internevo" and not data.pack_sample_into_one
    rows, length = (1, data.micro_bsz * data.seq_len) if packed_apart else (data.micro_bsz, data.seq_len)
    ids = torch.zeros(rows, length, dtype=torch.long)
    batch: MicroBatch = (
        (ids, ids.clone(), torch.arange(length).remainder(data.seq_len)[None]) if packed_apart else (ids, ids.clone())
    )
    return [batch] * (data.micro_num if every else min(data.micro_num, TRACED_MICRO_BATCHES))


# Inside `shared_sharding_decisions()` a trace leaves DTensor's cached sharding decisions to the next one.
_SHARING_DECISIONS = contextvars.ContextVar("sharing_sharding_decisions", default=False)


@contextlib.contextmanager
def shared_sharding_decisions() -> Iterator[None]:
    """The traces inside share DTensor's cached sharding decisions (every fake mesh of a shape decides as the others
    do: a search's traces all run on its world size), cleared once as the context exits, before any real run could
    read them. A search's reduced traces of DeepSeek-V3 under FSDP2 and expert parallel took a third less CPU so."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    token = _SHARING_DECISIONS.set(True)
    try:
        yield
    finally:
        _SHARING_DECISIONS.reset(token)
        if not _SHARING_DECISIONS.get():
            _clear_sharding_prop_cache()


@contextlib.contextmanager
def fake_process_group(world_size: int, needed: bool = False, rank: int = 0) -> Iterator[None]:
    """torch's fake backend as the default group, seen from `rank`: collectives return at once, shapes as on
    `world_size` ranks. One rank needs no group unless the layout builds a device mesh (`needed`: FSDP2)."""
    if world_size == 1 and not needed:
        yield
        return
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    excepthook = sys.excepthook  # torch prefixes uncaught errors' lines with the fake rank for good
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        # A device mesh compares equal to another of the same shape and ranks whatever its group: DTensor's
        # cached sharding decisions would hand this fake mesh (rank 0 on every rank) to the run's own
        # DTensors after a preflight (a checkpoint's shards then all claim rank 0's offsets). A search's traces
        # share them (`shared_sharding_decisions`), which clears them once at its end.
        if not _SHARING_DECISIONS.get():
            _clear_sharding_prop_cache()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The builder logs what it applies; a planner tracing many configs keeps that out of its output."""
    package = logging.getLogger("internlm_offload")
    level = package.level
    package.setLevel(logging.WARNING)
    try:
        yield
    finally:
        package.setLevel(level)


def trace_step(cfg: RunConfig, world_size: int = 1, *, measure: bool = False, count_work: bool = True) -> StepMemory:
    """Trace `TRACED_STEPS` training steps of `cfg` on rank 0 of `world_size`; see the module docstring.

    `measure=True` runs the same steps for real on cpu tensors, counted the same way (small configs):
    the reference the meta trace is checked against. `count_work=False` leaves out the third step, which
    only the cost model reads (the preflight needs the memory figures alone; the FLOP counter is the
    slowest part of a trace).
    """
    pipe = cfg.parallel.pipeline.size
    if pipe > 1 and cfg.parallel.mode == "fsdp2":  # torch's stage defers FSDP2's reduction; the local run does not
        raise UnsupportedLayout(
            f"parallel.mode='fsdp2' with parallel.pipeline.size={pipe}: the memory planner traces a pipeline's "
            "stages under 'none' or 'ddp' only"
        )
    if measure and cfg.parallel.expert.size > 1:  # the fake group's all-to-all would hand back no counts
        raise UnsupportedLayout(
            f"parallel.expert.size={cfg.parallel.expert.size}: measuring on one process runs over a fake process group, "
            "whose all-to-all exchanges no token counts; measure expert parallel with torchrun "
            "(python -m internlm_offload.bench.planner)"
        )
    if pipe > 1:
        return _pipeline_step(cfg, world_size, measure, count_work)
    return _traced(cfg, world_size, measure, count_work)


def _traced(cfg: RunConfig, world_size: int, measure: bool, count_work: bool, pp_rank: int = 0) -> StepMemory:
    """One rank's trace (pipeline rank `pp_rank`'s first); DDP as one process plus its buckets, except a
    zero-bubble pipeline's unwrapped stages, traced as built (the trainer's flat all-reduce of their gradients)."""
    pipe = cfg.parallel.pipeline
    if cfg.parallel.mode == "ddp" and not (pipe.size > 1 and splits_backward(pipe.mode)):
        single = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"mode": "none"})})
        memory = _trace(single, world_size, measure, count_work, pp_rank)
        return _with_ddp_buckets(memory) if _ddp_wraps(cfg, memory) else memory
    return _trace(cfg, world_size, measure, count_work, pp_rank)


def _ddp_wraps(cfg: RunConfig, memory: StepMemory) -> bool:
    """Whether the builder wraps the model in DDP: not under gradient offload (builder/model.py), nor a pipeline's
    stages whose fp32 masters reduce the gradients themselves (builder/pipeline.py; a zero-bubble pipeline's stages,
    never wrapped, are traced as built: `_traced`)."""
    masters = memory.components["master_weights"] + memory.components["host_master_weights"]
    return not cfg.grad_offload and not (cfg.parallel.pipeline.size > 1 and masters > 0)


def _pipeline_step(cfg: RunConfig, world_size: int, measure: bool, count_work: bool) -> StepMemory:
    """Every pipeline rank traced on its own stages (`planner/pipeline.py` runs its actions in torch's order): the
    figures of the rank with the highest device peak, each rank's in `stages`, and the highest host peak (a node's
    host holds every stage's ranks)."""
    ranks = [_traced(cfg, world_size, measure, count_work, r) for r in range(cfg.parallel.pipeline.size)]
    worst = max(ranks, key=lambda m: m.device_peak_bytes)
    per_rank = [
        StageMemory(
            r,
            m.device_peak_bytes,
            m.host_peak_bytes,
            m.first_step_device_peak_bytes,
            m.in_flight,
            m.components["activations"],
            m.micro_batch_work,
        )
        for r, m in enumerate(ranks)
    ]
    return dataclasses.replace(worst, stages=per_rank, host_peak_bytes=max(m.host_peak_bytes for m in ranks))


def _with_ddp_buckets(memory: StepMemory) -> StepMemory:
    """DDP's reducer keeps every trainable parameter's gradient a second time, in flat buckets of the
    parameter's dtype, from construction on (also with fp32 masters, whose grads the trainer reduces); expert
    parallel's experts are left out of it (reduced over their own group, in place)."""
    buckets = memory.components["model_params"] - memory.components.get("expert_params", 0)
    memory.components["ddp_buckets"] = buckets
    memory.device_peak_bytes += buckets
    memory.first_step_device_peak_bytes += buckets
    memory.segments = [(*s[:2], s[2] + buckets, s[3], s[4] + buckets, s[5]) for s in memory.segments]
    memory.first_segments = [(*s[:2], s[2] + buckets, s[3], s[4] + buckets, s[5]) for s in memory.first_segments]
    return memory


def _trace(cfg: RunConfig, world_size: int, measure: bool, count_work: bool, pp_rank: int = 0) -> StepMemory:
    accelerator = PlanningAccelerator("cpu", meta=not measure)
    tracker = accelerator.tracker
    tensor, pipe = cfg.parallel.tensor.size, cfg.parallel.pipeline.size
    # real host tensors, as the loader's: the trainer counts their labels; a pipeline's schedule runs all
    batches = micro_batches(cfg, every=pipe > 1)
    # Factory calls without a device (buffers made by `init_weights`) land on meta too.
    transformers_modules = capabilities(cfg.model.type).transformers_modules
    stand_ins = (
        ()
        if measure
        else (
            fused_optimizers_on_meta(),
            flash_attention_on_meta(device_kernels=planned_device(cfg) != "cpu"),
            packed_sequences_on_meta() if transformers_modules else contextlib.nullcontext(),
            grouped_mm_on_meta() if transformers_modules else contextlib.nullcontext(),
            fsdp2_on_meta(),
            expert_dispatch_on_meta(cfg.memory_budget.expert_imbalance),
            torch.device("meta"),
        )
    )
    experts = cfg.parallel.expert.size
    rank = pp_rank * (world_size // pipe)  # the first rank of the pipeline rank's stage
    needed = cfg.parallel.mode == "fsdp2" or tensor > 1 or experts > 1 or pipe > 1
    group = fake_process_group(world_size, needed=needed, rank=rank)
    # The bottom mode: every op the tracker and the counters pass on is answered from its signature if seen.
    kernels = contextlib.nullcontext() if measure or not MEMOISE_KERNELS else MetaKernelCache()
    with group, _quiet(), kernels, contextlib.ExitStack() as stack, tracker, tracker.counting_resizes():
        for stand_in in stand_ins:
            stack.enter_context(stand_in)
        expert_sizes = (experts, cfg.parallel.expert_weight.size, expert_ranks(cfg, world_size))
        ctx = _rank_context(rank, world_size, tensor, expert_sizes, pipe, accelerator, chunked_loss(cfg))
        parts = build_components(cfg, ctx, check_host_memory=False)
        if cfg.parallel.fsdp_cpu_offload:
            for param in parts.model.parameters():  # FSDP2 keeps each shard in pinned host memory
                tracker.move_to(param, ("host", "pinned"))
        schedule = None
        if parts.pipeline is not None:  # the stages' schedule run here, in torch's order, without sends
            # what stages send each other: under msp, fsp and isp a tensor rank's 1/T of the sequence
            activation = (cfg.model.hidden_size, parts.policy.compute_dtype, stage_sequence_parts(cfg))
            schedule = LocalSchedule(parts.pipeline, pp_rank, activation)
            parts.pipeline = cast(PipelineRunner, schedule)
        trainer = make_trainer(cfg, ctx, parts, trainer_class=Trainer if measure else _TracingTrainer)
        probe = _Probe(tracker, parts.masters.records(), per_step=schedule is not None)
        parts.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: probe.before_optimizer_step(optimizer))
        parts.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: probe.after_optimizer_step())
        # a pipeline rank's micro-batch enters its first stage's module (the stepped `PipelineStages` never runs)
        entry = parts.model if schedule is None else schedule.stages[min(schedule.stages)].submod
        handles = probe.segment_hooks(entry, parts.layers)
        parts.optimizer.register_step_pre_hook(lambda *_: probe.mark("optimizer step"))
        tracker.reset_peaks()
        first_segments = probe.recorded(lambda: trainer.train_step(batches))
        first_peak = tracker.peak_bytes("device")
        at_rest = {tier: tracker.live_bytes(tier) for tier in ("device", "host")}
        handles += probe.hooks(entry, parts.layers)
        tracker.reset_peaks()
        segments = probe.recorded(lambda: trainer.train_step(batches))
        peaks = {tier: tracker.peak_bytes(tier) for tier in ("device", "host", "disk")}
        components = _components(parts, tracker, at_rest, probe)
        blocks = [probe.block_growth.get(i, 0) for i in range(len(parts.layers))]
        # The work is counted in a step of its own: the FLOP counter runs ops through their decompositions
        # (as torch's FlopCounterMode), whose intermediates the memory figures above must not see.
        if count_work:
            probe.counter = WorkCounter(tracker)
            probe.flops = FlopCounter(custom_mapping=extra_flops())
            with probe.flops, probe.counter:
                trainer.train_step(batches)
        for handle in handles:
            handle.remove()
        memory = StepMemory(
            world_size=world_size,
            device_peak_bytes=peaks["device"],
            host_peak_bytes=peaks["host"],
            components=components,
            block_activation_bytes=blocks,
            first_step_device_peak_bytes=first_peak,
            disk_peak_bytes=peaks["disk"],
            micro_num=cfg.data.micro_num,
            micro_batch_work=probe.micro_batch_work,
            optimizer_work=probe.optimizer_work,
            segments=segments,
            first_segments=first_segments,
            in_flight=1 if schedule is None else rank_in_flight(schedule.runner.schedule.pipeline_order, pp_rank),
        )
        trainer.close()
    return memory


def _rank_context(
    rank: int,
    world_size: int,
    tensor_size: int,
    experts: tuple[int, int, int],
    pipeline_size: int,
    accelerator: PlanningAccelerator,
    chunked_loss: bool,
) -> RunContext:
    """`rank`'s context over the fake process group: with tensor parallel its ("dp", "tp") mesh, with expert
    parallel (`experts`: the expert and expert weight sizes, the ranks they are carved from) its expert mesh, with a
    pipeline its ("pp", "dp") mesh (("pp", "dp", "tp") with both, `parallel_meshes`)."""
    mesh, pipe_mesh = parallel_meshes("cpu", world_size, tensor_size, pipeline_size)
    expert_size, expert_weight, ranks = experts
    tensor = world_size // ranks  # T where the experts split over "tp" are carved from the data-parallel ranks
    experts_mesh = None if expert_size == 1 else expert_mesh("cpu", ranks, expert_size, expert_weight, tensor)
    return RunContext(
        rank,
        rank,
        world_size,
        accelerator,
        tensor_size=tensor_size,
        mesh=mesh,
        expert_mesh=experts_mesh,
        pipeline_size=pipeline_size,
        pipeline_mesh=pipe_mesh,
        chunked_loss=chunked_loss,
    )


def _grads_bytes(optimizer: torch.optim.Optimizer, records: list[ParamRecord]) -> int:
    """Bytes of the distinct device gradients `step()` reads (the records' `device_grad` for host-resident
    masters, else `.grad`)."""
    device_grads = {id(r.master): r.device_grad for r in records if r.device_grad is not None}
    seen: set[int] = set()
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = device_grads.get(id(p), p.grad)
            local = None if grad is None else plain_tensors(grad)[0]  # a DTensor's local shard
            if local is not None and storage_key(local) not in seen:
                seen.add(storage_key(local))
                total += local.untyped_storage().nbytes()
    return total


def _components(parts: Any, tracker: StorageTracker, at_rest: dict[str, int], probe: _Probe) -> dict[str, int]:
    """Named per-rank bytes of the steady step; the device ones add up to `device_peak_bytes`."""
    params = _tier_bytes(tracker, [*parts.model.parameters(), *scale_tensors(parts.model)])  # QLoRA's scales too
    masters = _tier_bytes(tracker, parts.masters.master_params())
    state_tensors = [t for s in parts.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    states = _tier_bytes(tracker, state_tensors)
    device_known = params.get("device", 0) + masters.get("device", 0) + states.get("device", 0)
    host_known = params.get("host", 0) + masters.get("host", 0) + states.get("host", 0)
    activations = probe.forward_growth
    return {
        "model_params": params.get("device", 0),
        "master_weights": masters.get("device", 0),
        "optimizer_states": states.get("device", 0),
        "other_at_rest": at_rest["device"] - device_known,  # buffers, device-resident grads kept between steps
        "activations": activations,  # what one micro-batch's forward leaves alive (saved tensors, logits)
        "transient": tracker.peak_bytes("device") - at_rest["device"] - activations,  # grads, temporaries
        "gradients_at_step": probe.grads_bytes,  # part of the above: the grads `step()` reads
        "host_params": params.get("host", 0),
        "host_master_weights": masters.get("host", 0),
        "host_optimizer_states": states.get("host", 0),
        "disk_optimizer_states": states.get("disk", 0),
        "host_buffers": at_rest["host"] - host_known,  # offload pools, staging, arena padding
        "pinned_host_peak": tracker.peak_bytes("pinned"),
        **_expert_components(parts.model, tracker),
    }


def _expert_components(model: nn.Module, tracker: StorageTracker) -> dict[str, int]:
    """Under expert parallel, the routed experts' local shards: part of `model_params` (or `host_params`)."""
    if not any(moe.expert_dispatch is not None for moe in moe_blocks(model)):
        return {}
    return {"expert_params": sum(_tier_bytes(tracker, [p for _, p in expert_params(model)]).values())}


def _tier_bytes(tracker: StorageTracker, tensors: Any) -> dict[str, int]:
    """Bytes of the distinct storages under `tensors` (DTensors: the local shard) per tier."""
    storages: dict[int, tuple[str, int]] = {}
    for t in tensors:
        local = plain_tensors(t)[0]
        tier = tracker.tier_of(local) or "device"
        storages[storage_key(local)] = (tier, local.untyped_storage().nbytes())
    totals: dict[str, int] = {}
    for tier, nbytes in storages.values():
        totals[tier] = totals.get(tier, 0) + nbytes
    return totals

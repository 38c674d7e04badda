"""Trace a step once per distinct run of blocks and compose the whole model's memory and work from it.

A decoder's blocks come in at most three runs with one plan each (`offload/plan.py`: offloaded, then
recomputed, then plain), every block of a run the same module with the same sharding; a family whose blocks are of
several kinds (DeepSeek-V3's dense-first and sparse blocks: `family.block_kinds`) has runs of one plan and one kind,
and its reduced models are built with those kinds in order (`family.with_blocks`). `trace_composed(cfg)`
traces a reduced model in which each run keeps `BASE_RUN` blocks (a run of at most `BASE_RUN + 1` keeps
all of its blocks) and, for each run that is longer, the same model with one block more in that run: the
difference is what one more block of the run adds to every figure (its parameters, masters, states and
gradients, what its forward leaves alive, its FLOPs and copies). The whole model's figures are the reduced
one's plus each run's share times the blocks the reduced model lacks. Peaks are composed per segment
(`trace.Segment`, the step cut at the runs' boundaries): within a segment the blocks of a run repeat the
same events, so the segment's peak grows by the same share per block, and the step's peak is the largest
segment's. The reduced models are configs like any other, built and traced through the builder's own
wiring (`trace.trace_step`); `tests/unit/test_planner_compose.py` holds the composition to the whole-model
trace within 0.5 %.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from internlm_offload.builder.model import build_layer_plan
from internlm_offload.config import RunConfig
from internlm_offload.family import block_kinds, capabilities, with_blocks
from internlm_offload.log import get_logger
from internlm_offload.offload.plan import LayerMode
from internlm_offload.planner.cost import StepWork
from internlm_offload.planner.trace import Segment, StepMemory, trace_step

logger = get_logger(__name__)

BASE_RUN = 2  # blocks a run keeps in the reduced model; with one more, the run's first, inner and last block
# Under `model.lora.base_on_host` (offload/hosted_base.py) the model's second block is where the lane's two resident
# copies settle: forward brings block 1 and block 2 in and lets block 0 go, one copy more than a later block
# leaves. A run starting at block 0 keeps 3 blocks there, so that the repeated one (the third) is a steady block.
HOSTED_BASE_RUN = 3
# How far a step that is not `composable` may be off when composed all the same: on the validation model the
# swap optimizer's peaks were within 1.7 % below, the hybrid's at fraction 0.5 within 8.6 % above and 28.5 %
# below, gradient offload's within 5.0 % above (tests/unit/test_planner_compose.py); the search traces such a
# candidate whole unless its composed peak is over the budget by more than this.
APPROXIMATE_MARGIN = 0.25
AT_REST = ("model_params", "master_weights", "optimizer_states", "other_at_rest")  # the device's, between steps
TraceFn = Callable[[RunConfig, bool], StepMemory]  # (config, count_work) -> its step, traced whole


class CompositionError(ValueError):
    """The reduced traces do not line up (their segments differ): the config is traced whole instead."""


# A run of consecutive blocks: (their plan, their kind), and how many
Run = tuple[tuple[LayerMode, str], int]


def kinds_of_blocks(cfg: RunConfig) -> tuple[str, ...] | None:
    """The kind of each block where a reduced model can hold any number of each: the family's kinds (DeepSeek-V3's
    dense-first and sparse blocks: `family.block_kinds`), or one kind for a decoder whose blocks are all one module
    (`same_blocks`); None where neither (traced whole)."""
    kinds = block_kinds(cfg.model)
    if kinds is not None:
        return kinds
    return ("block",) * cfg.model.num_layers if same_blocks(cfg) else None


def block_runs(cfg: RunConfig) -> list[Run]:
    """((plan, kind), length) of each run of consecutive blocks with the same plan and kind, first block first: a
    dense-first model offloading 30 of its 61 blocks has three (the 3 dense blocks, 27 and 31 sparse ones)."""
    kinds = kinds_of_blocks(cfg)
    if kinds is None:
        raise CompositionError(f"model.type={cfg.model.type!r}: the blocks' kinds are not known")
    runs: list[Run] = []
    for mode, kind in zip(build_layer_plan(cfg, len(kinds)).modes, kinds):
        if runs and runs[-1][0] == (mode, kind):
            runs[-1] = ((mode, kind), runs[-1][1] + 1)
        else:
            runs.append(((mode, kind), 1))
    return runs


def reduced_config(cfg: RunConfig, runs: list[Run], lengths: list[int]) -> RunConfig:
    """`cfg` with `lengths[i]` blocks in its i-th run: their kinds through the family's `with_blocks` (else
    `model.num_layers`), the offloaded run through `cpu_offloading.num_layers`, the recomputed one through
    `model.checkpoint` (a ratio whose `int(blocks * ratio)` ends it)."""
    blocks = sum(lengths)
    offloaded = sum(n for ((mode, _), _), n in zip(runs, lengths) if mode == LayerMode.OFFLOAD)
    recompute_end = sum(n for ((mode, _), _), n in zip(runs, lengths) if mode != LayerMode.PLAIN)
    ratio = cfg.model.checkpoint
    if recompute_end > offloaded:  # the recomputed run: [offloaded, recompute_end)
        ratio = 1.0 if recompute_end == blocks else (recompute_end + 0.5) / blocks
    elif int(blocks * ratio) > offloaded:  # no recomputed run (any ratio ending it within the offloaded run)
        ratio = offloaded / blocks
    if block_kinds(cfg.model) is None:
        section = cfg.model.model_copy(update={"num_layers": blocks})
    else:
        section = with_blocks(cfg.model, [kind for ((_, kind), _), n in zip(runs, lengths) for _ in range(n)])
        if section is None:
            raise CompositionError(f"model.type={cfg.model.type!r}: its family cannot build a reduced model")
    model = section.model_copy(update={"checkpoint": ratio})
    offload = cfg.cpu_offloading.model_copy(update={"num_layers": offloaded})
    reduced = cfg.model_copy(update={"model": model, "cpu_offloading": offload})
    wanted = [(key, n) for (key, _), n in zip(runs, lengths) if n]
    if block_runs(reduced) != wanted:
        raise CompositionError(f"the reduced model's runs {block_runs(reduced)} are not {wanted}")
    return reduced


def trace_composed(
    cfg: RunConfig,
    world_size: int = 1,
    *,
    count_work: bool = True,
    trace: TraceFn | None = None,
    approximate: bool = False,
) -> StepMemory:
    """The step of `cfg` composed from reduced models' traces (module docstring); `trace`: how a config is
    traced whole (default `trace_step`; the search's `Tracer` caches and counts). A model whose runs are all
    short, whose reduced traces do not line up or that is not `composable` is traced whole; `approximate`:
    one that is not composable is composed all the same (the search's estimates, `APPROXIMATE_MARGIN`)."""
    trace = trace or (lambda c, work: trace_step(c, world_size, count_work=work))
    if traced_whole(cfg) or not (approximate or composable(cfg, world_size)):
        return trace(cfg, count_work)
    runs = block_runs(cfg)
    target = [n for _, n in runs]
    kept = base_run(cfg)
    base = [n if n <= kept + 1 else kept for n in target]
    if base == target:
        return trace(cfg, count_work)
    try:
        reduced = _blocks_traced(trace(reduced_config(cfg, runs, base), count_work), base)
        shares = []
        for i, (n, kept) in enumerate(zip(target, base)):
            if n > kept:
                longer = [*base[:i], kept + 1, *base[i + 1 :]]
                shares.append(
                    Share(i, n - kept, _blocks_traced(trace(reduced_config(cfg, runs, longer), count_work), longer))
                )
        return compose(reduced, shares, base, target)
    except CompositionError as exc:
        logger.debug("tracing the whole model: %s", exc)
        return trace(cfg, count_work)


def _blocks_traced(memory: StepMemory, lengths: list[int]) -> StepMemory:
    """`memory`, whose hooked blocks must be the reduced model's `lengths` (a block outside the decoder's `layers`,
    such as a multi-token-prediction block, is part of every reduced model alike and so composes as a constant; one
    among them would not line up)."""
    if len(memory.block_activation_bytes) != sum(lengths):
        raise CompositionError(f"{len(memory.block_activation_bytes)} blocks traced where the runs hold {sum(lengths)}")
    return memory


def traced_whole(cfg: RunConfig) -> bool:
    """Whether `trace_composed` traces `cfg` whole whatever its optimizer: blocks of no known kinds, or a pipeline (its
    stages cut the blocks: a reduced model's stages would hold other blocks than the whole one's)."""
    return kinds_of_blocks(cfg) is None or cfg.parallel.pipeline.size > 1


def base_run(cfg: RunConfig) -> int:
    """Blocks a run keeps in the reduced model (`HOSTED_BASE_RUN` with the trainer's own base on the host)."""
    lora = cfg.model.lora
    return HOSTED_BASE_RUN if lora is not None and lora.base_on_host else BASE_RUN


def same_blocks(cfg: RunConfig) -> bool:
    """Whether every block is the same module: the native decoder, all dense or all sparse (a mixture of experts
    with dense blocks among its sparse ones, Qwen's `mlp_only_layers` or `decoder_sparse_step`, is traced whole;
    a reduced model would keep other blocks than the whole one's; a family naming its blocks' kinds is composed by
    kind: `kinds_of_blocks`)."""
    model = cfg.model
    mixed = model.num_experts > 0 and (bool(model.mlp_only_layers) or model.decoder_sparse_step > 1)
    return capabilities(model.type).one_block_copy and not mixed


def composable(cfg: RunConfig, world_size: int = 1) -> bool:
    """Whether every block's memory events are its own: not where the optimizer cuts all parameters into
    shares (the swap optimizer's chunks, the hybrid's CPU prefix, gradient offload's buckets), nor under
    FSDP2 over several data-parallel ranks (a block's backward frees more the later it comes: 1.7 % off on
    the tiny model over 4 ranks), nor for a decoder whose blocks are of no known kinds (`kinds_of_blocks`; Hugging
    Face's depth is not `model.num_layers`)."""
    hybrid = cfg.hybrid_optimizer
    sharded = cfg.parallel.mode == "fsdp2" and world_size > cfg.parallel.tensor.size
    return (
        kinds_of_blocks(cfg) is not None
        and not sharded
        and not cfg.swap_optimizer
        and not cfg.grad_offload
        and not (hybrid.enable and 0.0 < hybrid.offload_fraction < 1.0)
    )


def state_composes(cfg: RunConfig) -> bool:
    """Whether the parameters, masters and optimizer states of `cfg`'s step compose exactly from its blocks' traces
    even where its peaks do not (`composable`): each block's are its own under the swap optimizer, gradient offload
    and FSDP2 over several ranks (within 512 bytes on the validation model), not under the hybrid at a fraction
    between 0 and 1, whose CPU share is a prefix of all parameters (15 % off at 0.5)."""
    hybrid = cfg.hybrid_optimizer
    return not traced_whole(cfg) and not (hybrid.enable and 0.0 < hybrid.offload_fraction < 1.0)


@dataclass(frozen=True)
class Share:
    """The reduced model with one block more in run `run`, which the whole model has `extra` more of."""

    run: int
    extra: int
    memory: StepMemory


def compose(reduced: StepMemory, shares: list[Share], base: list[int], target: list[int]) -> StepMemory:
    """The whole model's step from the reduced one's (`base` blocks per run) and each run's share."""

    def scaled(read: Callable[[StepMemory], int]) -> int:
        value = read(reduced)
        return value + sum(s.extra * (read(s.memory) - value) for s in shares)

    segments = _composed_segments(reduced, shares, base)
    first_segments = _composed_segments(reduced, shares, base, first=True)
    components = {name: scaled(lambda m, n=name: m.components[n]) for name in reduced.components}
    device_peak = max(s[2] for s in segments)
    # what the events show beyond the affine sum is the backward's and the step's: the transient
    components["transient"] += device_peak - scaled(lambda m: m.device_peak_bytes)
    return StepMemory(
        world_size=reduced.world_size,
        device_peak_bytes=device_peak,
        host_peak_bytes=max(s[3] for s in segments),
        components=components,
        block_activation_bytes=_blocks(reduced, shares, base, target),
        first_step_device_peak_bytes=max(s[2] for s in first_segments),
        disk_peak_bytes=scaled(lambda m: m.disk_peak_bytes),
        micro_num=reduced.micro_num,
        micro_batch_work=_work(scaled, lambda m: m.micro_batch_work, reduced),
        optimizer_work=_work(scaled, lambda m: m.optimizer_work, reduced),
        segments=segments,
        first_segments=first_segments,
    )


# A segment as its role and its memory events: (label, run, position in the run) and the device and host
# bytes its peak lies above its start, and the bytes it leaves live beyond its start.
Event = tuple[tuple[str, int, int], tuple[int, int, int, int]]


def _events(memory: StepMemory, lengths: list[int], first: bool = False) -> list[Event]:
    """The step's segments as events, each block's named by its run and its position in the run (`first`:
    the first step's)."""
    starts = [sum(lengths[:run]) for run in range(len(lengths))]
    events: list[Event] = []
    device = host = 0
    for label, block, device_peak, host_peak, device_end, host_end in (
        memory.first_segments if first else memory.segments
    ):
        run = -1 if block < 0 else max(r for r, start in enumerate(starts) if start <= block)
        role = (label, run, -1 if block < 0 else block - starts[run])
        events.append((role, (device_peak - device, device_end - device, host_peak - host, host_end - host)))
        device, host = device_end, host_end
    return events


def _composed_segments(reduced: StepMemory, shares: list[Share], base: list[int], first: bool = False) -> list[Segment]:
    """The whole model's segments: the reduced model's events, each moved by the runs' shares, with each
    lengthened run's inner block's events (from its share's trace) repeated where the run lacks blocks."""
    events = _events(reduced, base, first)
    moved = [list(values) for _, values in events]
    inserts: list[tuple[int, int, list[Event]]] = []  # (before which event, how often, the inner block's events)
    for share in shares:
        lengths = [n + (run == share.run) for run, n in enumerate(base)]
        inner = base[share.run] - 1  # the longer run's last but one: its first steady block (`base_run`)
        kept: list[Event] = []
        for role, values in _events(share.memory, lengths, first):
            label, run, position = role
            if run == share.run and position == inner:  # the inner block: repeated `extra` times
                if not inserts or inserts[-1][0] != len(kept) or inserts[-1][2][-1][0][1:] != (run, inner):
                    inserts.append((len(kept), share.extra, []))
                inserts[-1][2].append((role, values))
                continue
            kept.append(((label, run, position - (run == share.run and position > inner)), values))
        if [role for role, _ in kept] != [role for role, _ in events]:
            raise CompositionError(f"run {share.run}'s segments differ from the reduced model's")
        for total, (_, values), (_, base_values) in zip(moved, kept, events):
            for i, (value, base_value) in enumerate(zip(values, base_values)):
                total[i] += share.extra * (value - base_value)
    sequence: list[tuple[str, tuple[int, ...]]] = []
    for index, ((role, _), values) in enumerate(zip(events, moved)):
        for before, times, block in sorted(inserts, key=lambda insert: insert[0]):
            if before == index:
                sequence += [(role[0], inner) for _ in range(times) for role, inner in block]
        sequence.append((role[0], tuple(values)))
    segments: list[Segment] = []
    device = host = 0
    for label, (device_rise, device_drift, host_rise, host_drift) in sequence:
        segments.append((label, -1, device + device_rise, host + host_rise, device + device_drift, host + host_drift))
        device, host = device + device_drift, host + host_drift
    return segments


def _work(
    scaled: Callable[[Callable[[StepMemory], int]], int], part: Callable[[StepMemory], StepWork], reduced: StepMemory
) -> StepWork | None:
    if part(reduced) is None:  # traced without the work (`count_work=False`)
        return None
    return StepWork(**{name: scaled(lambda m, n=name: getattr(part(m), n)) for name in asdict(part(reduced))})


def _blocks(reduced: StepMemory, shares: list[Share], base: list[int], target: list[int]) -> list[int]:
    """Each block's figure: a lengthened run's first ones, its inner one repeated, its last (from its share's trace)."""
    longer = {s.run: s.memory for s in shares}
    blocks: list[int] = []
    for run, n in enumerate(target):
        memory = longer.get(run, reduced)
        lengths = [*base[:run], base[run] + (run in longer), *base[run + 1 :]]
        start = sum(lengths[:run])
        values = memory.block_activation_bytes[start : start + lengths[run]]
        inner = base[run] - 1
        blocks += values if run not in longer else [*values[:inner], *[values[inner]] * (n - base[run]), values[-1]]
    return blocks


@dataclass
class Tracer:
    """The traces of one search: each config traced once (composed from its runs unless `compose=False`) and
    counted (`traces`: the `trace_step` calls made, reduced models and whole ones)."""

    world_size: int = 1
    compose: bool = True
    traces: int = 0
    _done: dict[tuple[str, bool], StepMemory] = field(default_factory=dict)

    def step(self, cfg: RunConfig, count_work: bool = True, *, approximate: bool = False) -> StepMemory:
        """`cfg`'s step, composed (`count_work=False`: the memory figures only; `approximate`: composed also
        where it is not `composable`: see `exact`)."""
        if not self.compose:
            return self.whole(cfg, count_work)
        return trace_composed(cfg, self.world_size, count_work=count_work, trace=self.whole, approximate=approximate)

    def exact(self, cfg: RunConfig) -> bool:
        """Whether `step(cfg, approximate=True)` is the whole trace's figures (within 0.5 %); else within
        `APPROXIMATE_MARGIN` as measured."""
        return not self.compose or composable(cfg, self.world_size) or traced_whole(cfg)

    def whole(self, cfg: RunConfig, count_work: bool = False) -> StepMemory:
        """`cfg`'s step traced whole, once per search (a trace with the work counted serves both)."""
        key = cfg.model_dump_json()
        done = self._done.get((key, True)) or (None if count_work else self._done.get((key, False)))
        if done is None:
            self.traces += 1
            done = self._done[(key, count_work)] = trace_step(cfg, self.world_size, count_work=count_work)
        return done

"""Choose the activation and optimizer settings with the fastest predicted step that fits the budgets.

The settings come from `knobs.py` (the search space as a list of knobs, one axis each); this file only
prices, orders and checks them.

Candidates are one activation setting (none, checkpoint 0.5 or 1.0, offload of half or all but one of
the blocks) times one optimizer setting (AdamW, hybrid 0.5 or 1.0, swap; the last two also with gradient
offload; under FSDP2 its CPU offload policy), over the knobs left to the
planner (all of them for `tools/plan`, those set to "auto" in a config with `memory_budget`);
`tools/plan` also tries each activation setting at smaller micro-batches of the same global batch
(`batch_settings`). The step time is separable: a micro-batch's cost depends only on the activation
setting and the micro-batch shape, the optimizer's only on the optimizer setting (gradient offload's
copies during backward are the optimizer setting's share of the micro-batch work), so A + O - 1 traces
give every candidate's exact predicted time. Their memory is estimated as
`peak(a, o0) + peak(a0, o) - peak(a0, o0)` (and, where that is over budget, also along the leanest
activation and optimizer settings: `LeanEstimate`) and the candidates are tried fastest first: one whose estimate
fits is traced whole, and the first that really fits is the choice. A smaller budget can only
remove candidates, so the chosen step time never decreases as the budget shrinks, and a choice has
always been traced and found to fit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from internlm_offload.config import ConfigError, RunConfig, merge_overrides, resolve_config
from internlm_offload.planner.compose import APPROXIMATE_MARGIN, Tracer, state_composes
from internlm_offload.planner.cost import Hardware, StepWork, step_time
from internlm_offload.planner.knobs import Setting, Space, activations_for, search_axes
from internlm_offload.planner.pipeline import StageMemory, planned_step_time
from internlm_offload.planner.progress import SearchProgress
from internlm_offload.planner.stage_offload import fewest_per_rank, offload_count, offload_ladder, per_rank_setting
from internlm_offload.planner.trace import StepMemory, UnsupportedLayout, shared_sharding_decisions
from internlm_offload.planner.tracker import largest_component
from internlm_offload.config.sizes import human_bytes

ConfigFor = Callable[[dict[str, Any]], RunConfig]  # knob overrides -> the resolved config
ActivationsFor = Callable[[RunConfig], list[Setting]]  # a layout's config -> its activation settings


def candidate_configs(raw: dict[str, Any], world_size: int = 1) -> ConfigFor:
    """The `ConfigFor` of a loaded config (`load_config_file`): each candidate's overrides merged into a
    copy of `raw`, then validated; the file is read once, not once per candidate."""

    def config_for(overrides: dict[str, Any]) -> RunConfig:
        return resolve_config(merge_overrides(raw, overrides), world_size=world_size)

    return config_for


@dataclass
class Candidate:
    activation: Setting
    optimizer: Setting
    step_s: float
    estimated_device: int
    estimated_host: int
    verdict: str = "not tried: a faster one fits"
    memory: StepMemory | None = field(default=None, repr=False)
    tensor_mode: Setting = field(default_factory=lambda: Setting("", {}))

    @property
    def name(self) -> str:
        mode = f"{self.tensor_mode.name}: " if self.tensor_mode.name else ""
        return f"{mode}{self.activation.name} + {self.optimizer.name}"

    @property
    def options(self) -> dict[str, Any]:
        return {**self.tensor_mode.options, **self.activation.options, **self.optimizer.options}


def over_budget(
    device: int,
    host: int,
    device_budget: int | None,
    host_budget: int | None,
    disk: int = 0,
    disk_budget: int | None = None,
) -> list[tuple[str, str]]:
    """(tier, 'tier peak X > budget Y') for each peak over its budget; empty when all fit."""
    peaks = (("device", device, device_budget), ("host", host, host_budget), ("disk", disk, disk_budget))
    return [
        (tier, f"{tier} peak {human_bytes(peak)} > budget {human_bytes(budget)}")
        for tier, peak, budget in peaks
        if budget is not None and peak > budget
    ]


@dataclass
class Budgets:
    device: int | None
    host: int | None
    disk: int | None = None


@dataclass
class PricedMode:
    """One tensor mode's candidates, fastest first, priced from its settings' traces, and how to try each."""

    config_for: ConfigFor
    base_activation: Setting
    base_optimizer: Setting
    by_activation: dict[str, StepMemory]
    by_optimizer: dict[str, StepMemory]
    candidates: list[Candidate]
    lean: LeanEstimate
    tracer: Tracer

    def fits(self, candidate: Candidate, budgets: Budgets) -> bool:
        """Try the candidate: its estimate, then its composed trace, then its whole trace; set its verdict (and,
        when it fits, its memory: the whole trace's, with the composed work) and say whether it fits."""
        try:
            config = self.config_for(candidate.options)
        except ConfigError as exc:  # a setting this layout does not take (a pipeline's schedule and checkpointing)
            candidate.verdict = f"refused: {exc}"
            return False
        exact = self.tracer.exact(config)
        # composed where blocks share events: the budgets widened by its margin until the whole trace decides
        slack = 1.0 if exact else 1 + APPROXIMATE_MARGIN
        widened = [None if b is None else int(b * slack) for b in (budgets.device, budgets.host)]
        # No activation setting peaks below what the optimizer setting holds at rest (its parameters, masters and
        # states, composed exactly where the peaks may not be: `state_composes`): a candidate over the budget so gets no
        # trace, composed or whole (GLM-4.5's LoRA base alone is 82.1 GiB a rank on an 80 GiB device)
        state = model_state(self.by_optimizer[candidate.optimizer.name])
        exact_state = exact or state_composes(config)
        if over_budget(*state, *(widened if not exact_state else (budgets.device, budgets.host))):
            held = over_budget(*state, budgets.device, budgets.host)[0][1].replace(" peak ", " peak at least ", 1)
            margin = "" if exact_state else " by more than its margin"
            candidate.verdict = f"estimated {held}{margin}: its parameters, masters and states alone"
            return False
        problems = over_budget(candidate.estimated_device, candidate.estimated_host, *widened)
        # A candidate on the base optimizer's column is estimated by its own trace when that is exact: a lean
        # estimate could only send it to that same trace, over the budget again.
        own_trace = exact and candidate.optimizer is self.base_optimizer
        if problems and candidate.activation is not self.base_activation and not own_trace:
            self.lean.refine(candidate)
            problems = over_budget(candidate.estimated_device, candidate.estimated_host, *widened)
        if problems:
            problem = over_budget(candidate.estimated_device, candidate.estimated_host, budgets.device, budgets.host)[0]
            candidate.verdict = f"estimated {problem[1]}" + ("" if slack == 1 else " by more than its margin")
            return False
        memory = candidate.memory = self.lean.trace(candidate.activation, candidate.optimizer)
        if _problems(memory, budgets, slack):
            problem = _problems(memory, budgets)[0][1]
            candidate.verdict = f"traced {problem}" if slack == 1 else f"composed {problem} by more than its margin"
            return False
        # the composed figures fit (or may): the whole model's trace decides, and is what the choice reports
        whole = self.tracer.whole(config)
        problems = _problems(whole, budgets)
        if problems:
            candidate.verdict = f"traced whole {problems[0][1]}"
            return False
        by_a, by_o = self.by_activation[candidate.activation.name], self.by_optimizer[candidate.optimizer.name]
        base = self.by_activation[self.base_activation.name]
        work = _work(by_a, by_o, base)
        # a pipeline's ranks: the whole trace's peaks with the separable work of each (what the step time reads)
        stages = [
            dataclasses.replace(rank, micro_batch_work=mine.micro_batch_work)
            for rank, mine in zip(whole.stages, _stages(by_a, by_o, base))
        ]
        candidate.memory = dataclasses.replace(whole, micro_batch_work=work[0], optimizer_work=work[1], stages=stages)
        candidate.verdict = "chosen"
        return True

    def per_stage(self, chosen: Candidate, budgets: Budgets, hardware: Hardware) -> Candidate | None:
        """`chosen` (which fits) with its offload lowered per pipeline rank (planner/stage_offload.py), when some
        rank can offload fewer blocks: the new candidate if it is as fast and its whole trace fits, else None."""
        ladder = offload_ladder(chosen.activation, (c.activation for c in self.candidates))
        count = offload_count(chosen.activation)
        if len(ladder) < 2 or count is None or budgets.device is None:
            return None
        base, by_o = self.by_activation[self.base_activation.name], self.by_optimizer[chosen.optimizer.name]
        if len(base.stages) < 2:  # no pipeline: one rank, one count
            return None
        peaks = {
            n: [
                a.device_peak_bytes + o.device_peak_bytes - b.device_peak_bytes
                for a, o, b in zip(self.by_activation[s.name].stages, by_o.stages, base.stages)
            ]
            for n, s in ladder.items()
        }
        counts = fewest_per_rank(peaks, budgets.device, count)
        if len(set(counts)) <= 1:
            return None
        setting = per_rank_setting(chosen.activation, counts)
        options = {**setting.options, **self.base_optimizer.options}
        self.by_activation[setting.name] = by_a = self.tracer.step(self.config_for(options), approximate=True)
        candidate = _candidate(setting, chosen.optimizer, by_a, by_o, base, hardware, self.config_for)
        candidate.tensor_mode = chosen.tensor_mode
        if round(candidate.step_s, 6) > round(chosen.step_s, 6) or not self.fits(candidate, budgets):
            return None
        chosen.verdict = f"fits; {setting.name} offloads less"
        return candidate


def priced(
    config_for: ConfigFor,
    activations: list[Setting],
    optimizers: list[Setting],
    hardware: Hardware,
    tracer: Tracer,
    progress: SearchProgress,
) -> PricedMode:
    """Every candidate priced: `activations[0]` and `optimizers[0]` are the base settings the others are traced
    against (module docstring), A + O - 1 composed steps."""
    activations = [a for a in activations if _takes(config_for, {**a.options, **optimizers[0].options})]
    optimizers = [o for o in optimizers if _takes(config_for, {**activations[0].options, **o.options})]
    progress.add(len(activations) + len(optimizers) - 1 + len(activations) * len(optimizers))

    def traced(options: dict[str, Any]) -> StepMemory:
        memory = tracer.step(config_for(options), approximate=True)
        progress.advance()
        return memory

    by_activation = {a.name: traced({**a.options, **optimizers[0].options}) for a in activations}
    by_optimizer = {o.name: traced({**activations[0].options, **o.options}) for o in optimizers[1:]}
    base = by_activation[activations[0].name]
    by_optimizer[optimizers[0].name] = base
    candidates = [
        _candidate(a, o, by_activation[a.name], by_optimizer[o.name], base, hardware, config_for)
        for a in activations
        for o in optimizers
    ]
    # The cost model counts FLOPs, so the same work in smaller micro-batches costs the same up to rounding:
    # equal times keep the listed order (the configured shape first).
    candidates.sort(key=lambda c: round(c.step_s, 6))
    lean = LeanEstimate(config_for, by_activation, by_optimizer, activations, optimizers, tracer)
    return PricedMode(config_for, activations[0], optimizers[0], by_activation, by_optimizer, candidates, lean, tracer)


def search(
    config_for: ConfigFor,
    activations: list[Setting],
    optimizers: list[Setting],
    hardware: Hardware,
    device_budget: int | None,
    host_budget: int | None,
    world_size: int = 1,
    disk_budget: int | None = None,
    tracer: Tracer | None = None,
    progress: SearchProgress | None = None,
) -> tuple[Candidate | None, list[Candidate]]:
    """The chosen candidate (None when nothing fits) and every candidate, fastest first, with its verdict.

    Steps are composed from their blocks' traces (`tracer`, `compose.py`); the candidate chosen is traced
    whole too, and chosen only when that trace fits."""
    tracer = tracer or Tracer(world_size)
    progress = progress or SearchProgress(enabled=False)
    mode = priced(config_for, activations, optimizers, hardware, tracer, progress)
    budgets = Budgets(device_budget, host_budget, disk_budget)
    for tried, candidate in enumerate(mode.candidates, 1):
        progress.advance()
        if mode.fits(candidate, budgets):
            progress.advance(len(mode.candidates) - tried)
            progress.found(candidate.name, candidate.step_s)
            return candidate, mode.candidates
    return None, mode.candidates


def model_state(memory: StepMemory) -> tuple[int, int]:
    """Device and host bytes of the parameters, masters and optimizer states of a step (every component the
    optimizer setting places, none the activation setting does): live from one step into the next, so no activation
    setting with this optimizer setting peaks below them on either tier."""
    c = memory.components
    device = sum(c.get(name, 0) for name in ("model_params", "master_weights", "optimizer_states"))
    return device, sum(c.get(name, 0) for name in ("host_params", "host_master_weights", "host_optimizer_states"))


def _problems(memory: StepMemory, budgets: Budgets, slack: float = 1.0) -> list[tuple[str, str]]:
    """`over_budget` of the traced peaks, each budget widened by `slack` (an approximate trace's margin)."""
    widened = [None if b is None else int(b * slack) for b in (budgets.device, budgets.host, budgets.disk)]
    peaks = (memory.device_peak_bytes, memory.host_peak_bytes)
    return over_budget(*peaks, widened[0], widened[1], memory.disk_peak_bytes, widened[2])


def _takes(config_for: ConfigFor, options: dict[str, Any]) -> bool:
    """Whether the layout takes the setting (a zero-bubble schedule refuses checkpointing, a config error)."""
    try:
        config_for(options)
    except ConfigError:
        return False
    return True


def _stages(by_a: StepMemory, by_o: StepMemory, base: StepMemory) -> list[StageMemory]:
    """A pipeline's ranks, each with its micro-batch work separable as the step's (`_work`); empty without one."""
    return [
        dataclasses.replace(a, micro_batch_work=a.micro_batch_work + o.micro_batch_work - b.micro_batch_work)
        for a, o, b in zip(by_a.stages, by_o.stages, base.stages)
    ]


def _work(by_a: StepMemory, by_o: StepMemory, base: StepMemory) -> tuple[StepWork, StepWork]:
    """A candidate's micro-batch and optimizer work: separable (module docstring). Gradient offload's copies
    run during backward: an optimizer setting's share of the micro-batch work."""
    return by_a.micro_batch_work + by_o.micro_batch_work - base.micro_batch_work, by_o.optimizer_work


def search_tensor_modes(
    config_for: ConfigFor,
    modes: list[Setting],
    activations: list[Setting],
    optimizers: list[Setting],
    hardware: Hardware,
    device_budget: int | None,
    host_budget: int | None,
    world_size: int = 1,
    disk_budget: int | None = None,
    *,
    tracer: Tracer | None = None,
    progress: SearchProgress | None = None,
    activations_for: ActivationsFor | None = None,
) -> tuple[Candidate | None, list[Candidate], list[str]]:
    """`search` in each layout (a tensor mode, an expert-parallel size, a pipeline: `knobs.py`'s `LAYOUT` axis;
    `activations_for`: each layout's own activation settings, where they count its blocks): the fastest of the modes' choices, every
    candidate fastest first, and a line for each mode the config cannot take (its config error).

    A mode changes what both the activation and the optimizer settings cost (which weights are sharded,
    which collectives run), so each mode is priced on its own traces. The modes' candidates are then tried
    together, fastest first: once one fits, only the other modes' candidates as fast as it are tried (one of
    them may be leaner), so no mode's slower choice is traced whole. Each mode's choice is the one `search`
    in that mode alone would make wherever it can be the answer."""
    tracer = tracer or Tracer(world_size)  # one for every mode: each config is traced once
    progress = progress or SearchProgress(enabled=False)
    priced_modes: list[tuple[Setting, PricedMode]] = []
    refused: list[str] = []
    for mode in modes:
        in_mode = functools.partial(_in_mode, config_for, mode.options)
        try:
            layout = in_mode({**activations[0].options, **optimizers[0].options})
        except ConfigError as exc:
            refused.append(f"{mode.name}: {exc}")
            continue
        own = activations if activations_for is None else activations_for(layout)
        try:
            priced_modes.append((mode, priced(in_mode, own, optimizers, hardware, tracer, progress)))
        except UnsupportedLayout as exc:  # a layout the planner does not trace (FSDP2 per pipeline stage)
            refused.append(f"{mode.name}: {exc}")
            continue
        for candidate in priced_modes[-1][1].candidates:
            candidate.tensor_mode = mode
    # fastest first; equal times in the modes' order, each mode's candidates in its own order
    queue = sorted(
        (
            (round(c.step_s, 6), index, position, c)
            for index, (_, m) in enumerate(priced_modes)
            for position, c in enumerate(m.candidates)
        ),
        key=lambda item: item[:3],
    )
    budgets = Budgets(device_budget, host_budget, disk_budget)
    bests: dict[int, Candidate] = {}
    for tried, (step_s, index, _, candidate) in enumerate(queue, 1):
        progress.advance()
        if bests and step_s > min(round(b.step_s, 6) for b in bests.values()):
            for _, other, _, rest in queue[tried - 1 :]:
                if other not in bests:
                    rest.verdict = "not tried: another layout's choice is faster"
            progress.advance(len(queue) - tried)
            break
        if index not in bests and priced_modes[index][1].fits(candidate, budgets):
            # under a pipeline a rank with room to spare offloads fewer blocks
            leaner = priced_modes[index][1].per_stage(candidate, budgets, hardware)
            bests[index] = leaner or candidate
            progress.found(bests[index].name, bests[index].step_s)
    # Equal times (mtp and msp send the same bytes and do the same FLOPs): the one with less memory.
    ordered = [bests[index] for index in sorted(bests)]
    chosen = min(ordered, key=lambda c: (round(c.step_s, 6), c.memory.device_peak_bytes), default=None)
    for best in ordered:
        if best is not chosen:
            best.verdict = f"fits; {chosen.tensor_mode.name} is faster or leaner"
    candidates = [c for _, _, _, c in queue]
    candidates += [best for best in ordered if all(best is not c for c in candidates)]  # offload per pipeline rank
    return chosen, candidates, refused


def search_space(
    config_for: ConfigFor,
    space: Space,
    hardware: Hardware,
    device_budget: int | None,
    host_budget: int | None,
    disk_budget: int | None = None,
    *,
    tracer: Tracer | None = None,
    progress: SearchProgress | None = None,
) -> tuple[Candidate | None, list[Candidate], list[str]]:
    """`search_tensor_modes` over `space`'s three axes (`knobs.search_axes`), each layout with its own activation
    settings (`knobs.activations_for`): what `tools.plan` and a config's "auto" knobs both search."""
    modes, activations, optimizers = search_axes(space)
    with shared_sharding_decisions():
        return search_tensor_modes(
            config_for,
            modes,
            activations,
            optimizers,
            hardware,
            device_budget,
            host_budget,
            space.world_size,
            disk_budget,
            tracer=tracer,
            progress=progress,
            activations_for=activations_for(space),
        )


def _in_mode(config_for: ConfigFor, mode: dict[str, Any], overrides: dict[str, Any]) -> RunConfig:
    return config_for({**mode, **overrides})


class LeanEstimate:
    """Two more memory estimates, along the leanest traced settings, for candidates the first puts over budget.

    The first estimate adds an optimizer setting's saving as measured beside the base activations, where the
    peak may sit elsewhere: gradient offload saves 28.8 GiB of 7B's peak there, and the first estimate put
    checkpoint 1.0 + hybrid 1.0 + gradient offload at 29.6 GiB against a traced 18.2. So the candidate is
    also estimated from traces at the activation setting with the smallest peak (`lean_activation`: its
    optimizer column, traced lazily) and with the optimizer setting with the smallest peak (`lean_optimizer`:
    its activation row, traced lazily), each as `peak(a, o') + peak(a', o) - peak(a', o')`; a candidate on
    that row or column is estimated by its own trace. The smallest estimate counts: a candidate is always
    traced whole before it is chosen, so an estimate too low costs one trace, one too high a choice.

    It keeps every trace the search takes (`trace`): a candidate traced for an estimate, or on the first
    estimate's row or column, is not traced again when it is tried.
    """

    def __init__(
        self,
        config_for: ConfigFor,
        by_activation: dict[str, StepMemory],
        by_optimizer: dict[str, StepMemory],
        activations: list[Setting],
        optimizers: list[Setting],
        tracer: Tracer,
    ) -> None:
        self.config_for, self.tracer = config_for, tracer
        self.base_activation, self.base_optimizer = activations[0], optimizers[0]
        self.lean_activation = min(activations, key=lambda a: by_activation[a.name].device_peak_bytes)
        self.lean_optimizer = min(optimizers, key=lambda o: by_optimizer[o.name].device_peak_bytes)
        # (activation, optimizer) names -> trace; the first estimate's row and column are traced already
        self.traces = {(a.name, self.base_optimizer.name): by_activation[a.name] for a in activations}
        self.traces |= {(self.base_activation.name, o.name): by_optimizer[o.name] for o in optimizers}

    def refine(self, candidate: Candidate) -> None:
        """Lower the candidate's estimates to the lean ones where those are smaller."""
        a, o = candidate.activation, candidate.optimizer
        for a_ref, o_ref in ((self.lean_activation, self.base_optimizer), (self.base_activation, self.lean_optimizer)):
            if (a_ref, o_ref) == (self.base_activation, self.base_optimizer):  # the first estimate again
                continue
            beside, across, corner = self.trace(a, o_ref), self.trace(a_ref, o), self.trace(a_ref, o_ref)
            device = beside.device_peak_bytes + across.device_peak_bytes - corner.device_peak_bytes
            host = beside.host_peak_bytes + across.host_peak_bytes - corner.host_peak_bytes
            candidate.estimated_device = min(candidate.estimated_device, device)
            candidate.estimated_host = min(candidate.estimated_host, host)

    def trace(self, activation: Setting, optimizer: Setting) -> StepMemory:
        """The step traced with both settings (taken once per search; its memory only)."""
        key = (activation.name, optimizer.name)
        if key not in self.traces:
            options = {**activation.options, **optimizer.options}
            self.traces[key] = self.tracer.step(self.config_for(options), count_work=False, approximate=True)
        return self.traces[key]


def _candidate(
    activation: Setting,
    optimizer: Setting,
    by_a: StepMemory,
    by_o: StepMemory,
    base: StepMemory,
    hw: Hardware,
    config_for: ConfigFor,
) -> Candidate:
    """Priced: its step time from the separable work (a pipeline's with its bubble, from each rank's work), its
    memory estimated."""
    micro_batch, optimizer_work = _work(by_a, by_o, base)
    stages = _stages(by_a, by_o, base)
    if stages:
        layout = config_for({**activation.options, **optimizer.options})  # its micro-batches: the schedule's
        time = planned_step_time(layout, stages, micro_batch, optimizer_work, hw).step_s
    else:
        time = step_time(micro_batch, optimizer_work, by_a.micro_num, hw).step_s
    device = by_a.device_peak_bytes + by_o.device_peak_bytes - base.device_peak_bytes
    host = by_a.host_peak_bytes + by_o.host_peak_bytes - base.host_peak_bytes
    return Candidate(activation, optimizer, time, device, host)


def smallest_peak(
    candidates: list[Candidate],
    config_for: ConfigFor,
    world_size: int = 1,
    tracer: Tracer | None = None,
    budgets: Budgets | None = None,
) -> str:
    """The candidate with the smallest estimated device peak, traced, and what dominates it: the 'nothing fits'
    line; with `budgets`, where that candidate's device peak fits, the peak that does not and what dominates it."""
    if not candidates:  # every tensor mode refused (`search_tensor_modes` names why)
        return "no candidate: the config takes none of the tensor modes"
    best = min(candidates, key=lambda c: c.estimated_device)
    memory = best.memory or (tracer or Tracer(world_size)).step(config_for(best.options), count_work=False)
    line = (
        f"smallest device peak {human_bytes(memory.device_peak_bytes)} ({best.name}), "
        f"largest: {largest_component(memory.components, 'device')}"
    )
    problems = [] if budgets is None else _problems(memory, budgets)
    if problems and problems[0][0] != "device":  # it fits the device: say what it does not fit
        tier, text = problems[0]
        line += f"; its {text} (largest: {largest_component(memory.components, tier)})"
    return line

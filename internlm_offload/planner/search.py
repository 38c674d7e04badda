"""Choose the activation and optimizer settings with the fastest predicted step that fits the budgets.

Candidates are one activation setting (none, checkpoint 0.5 or 1.0, offload of half or all but one of
the blocks) times one optimizer setting (AdamW, hybrid 0.5, swap). The step time is separable: a
micro-batch's cost depends only on the activation setting and the optimizer's only on the optimizer
setting, so 3 + 5 - 1 traces give every candidate's exact predicted time. Their memory is estimated as
`peak(a, o0) + peak(a0, o) - peak(a0, o0)` and the candidates are tried fastest first: one whose
estimate fits is traced whole, and the first that really fits is the choice. A smaller budget can only
remove candidates, so the chosen step time never decreases as the budget shrinks, and a choice has
always been traced and found to fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from internlm_offload.config import RunConfig
from internlm_offload.planner.cost import Hardware, step_time
from internlm_offload.planner.trace import StepMemory, trace_step
from internlm_offload.planner.tracker import human_bytes

ConfigFor = Callable[[dict[str, Any]], RunConfig]  # knob overrides -> the resolved config


@dataclass(frozen=True)
class Setting:
    name: str
    options: dict[str, Any]


def activation_settings(num_layers: int) -> list[Setting]:
    none = {"model.checkpoint": 0.0, "cpu_offloading.enable": False, "cpu_offloading.num_layers": 0}
    settings = [Setting("no recompute", none),
                Setting("checkpoint 0.5", {**none, "model.checkpoint": 0.5}),
                Setting("checkpoint 1.0", {**none, "model.checkpoint": 1.0})]  # fmt: skip
    for blocks in sorted({max(1, num_layers // 2), num_layers - 1}):
        if blocks >= 1:
            settings.append(Setting(f"offload {blocks} blocks", {**none, "cpu_offloading.enable": True,
                                                                  "cpu_offloading.num_layers": blocks}))  # fmt: skip
    return settings


OPTIMIZER_SETTINGS = [
    Setting("AdamW", {"swap_optimizer": False, "hybrid_optimizer.enable": False}),
    Setting("hybrid 0.5", {"swap_optimizer": False, "hybrid_optimizer.enable": True,
                           "hybrid_optimizer.offload_fraction": 0.5}),
    Setting("swap", {"swap_optimizer": True, "hybrid_optimizer.enable": False}),
]  # fmt: skip


@dataclass
class Candidate:
    activation: Setting
    optimizer: Setting
    step_s: float
    estimated_device: int
    estimated_host: int
    verdict: str = "not tried: a faster one fits"
    memory: StepMemory | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.activation.name} + {self.optimizer.name}"

    @property
    def options(self) -> dict[str, Any]:
        return {**self.activation.options, **self.optimizer.options}


def over_budget(device: int, host: int, device_budget: int | None, host_budget: int | None) -> list[tuple[str, str]]:
    """(tier, 'tier peak X > budget Y') for each peak over its budget; empty when both fit."""
    peaks = (("device", device, device_budget), ("host", host, host_budget))
    return [(tier, f"{tier} peak {human_bytes(peak)} > budget {human_bytes(budget)}")
            for tier, peak, budget in peaks if budget is not None and peak > budget]  # fmt: skip


def search(
    config_for: ConfigFor, num_layers: int, hardware: Hardware, device_budget: int | None, host_budget: int | None,
    world_size: int = 1,
) -> tuple[Candidate | None, list[Candidate]]:  # fmt: skip
    """The chosen candidate (None when nothing fits) and every candidate, fastest first, with its verdict."""
    activations, optimizers = activation_settings(num_layers), OPTIMIZER_SETTINGS
    by_activation = {a.name: trace_step(config_for({**a.options, **optimizers[0].options}), world_size)
                     for a in activations}  # fmt: skip
    by_optimizer = {o.name: trace_step(config_for({**activations[0].options, **o.options}), world_size)
                    for o in optimizers[1:]}  # fmt: skip
    base = by_activation[activations[0].name]
    by_optimizer[optimizers[0].name] = base
    candidates = [_candidate(a, o, by_activation[a.name], by_optimizer[o.name], base, hardware)
                  for a in activations for o in optimizers]  # fmt: skip
    candidates.sort(key=lambda c: c.step_s)
    for candidate in candidates:
        problems = over_budget(candidate.estimated_device, candidate.estimated_host, device_budget, host_budget)
        if problems:
            candidate.verdict = f"estimated {problems[0][1]}"
            continue
        memory = candidate.memory = trace_step(config_for(candidate.options), world_size)
        problems = over_budget(memory.device_peak_bytes, memory.host_peak_bytes, device_budget, host_budget)
        if not problems:
            candidate.verdict = "chosen"
            return candidate, candidates
        candidate.verdict = f"traced {problems[0][1]}"
    return None, candidates


def _candidate(
    activation: Setting, optimizer: Setting, by_a: StepMemory, by_o: StepMemory, base: StepMemory, hw: Hardware
) -> Candidate:
    time = step_time(by_a.micro_batch_work, by_o.optimizer_work, by_a.micro_num, hw).step_s
    device = by_a.device_peak_bytes + by_o.device_peak_bytes - base.device_peak_bytes
    host = by_a.host_peak_bytes + by_o.host_peak_bytes - base.host_peak_bytes
    return Candidate(activation, optimizer, time, device, host)

"""Preflight: refuse a run whose predicted memory exceeds this machine's, before the model is allocated.

`check_fits(cfg, ...)` traces the configured step (`trace.py`, seconds and a few hundred MB even at
7B) and compares its per-rank peaks with what the machine has: the device's total memory (cuda/npu)
and the host's available memory shared by the local ranks; the device also holds what was in use on it
before the run (the context, measured at start-up: `engine/runtime_memory.py`). On the cpu backend the
device *is* host memory, so the two peaks are added and compared with the host's. A run that cannot fit stops with
`PreflightError` (exit 2, one line: predicted vs available and what would help), instead of an
out-of-memory kill minutes later.

Every layout is traced as this rank's (`trace_composed(cfg, world_size)`): FSDP2 over torch's fake process
group divides the model state as the run will; DDP adds its gradient buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

from internlm_offload.config import ConfigError, RunConfig
from internlm_offload.log import get_logger
from internlm_offload.optim.memory import available_host_bytes
from internlm_offload.planner.compose import trace_composed
from internlm_offload.planner.trace import StepMemory
from internlm_offload.planner.tracker import largest_component
from internlm_offload.config.sizes import human_bytes

logger = get_logger(__name__)

# What to try when a component dominates the predicted peak.
REMEDIES = {
    "optimizer_states": "swap_optimizer=True (AdamW states and fp32 masters live on the host)",
    "master_weights": "swap_optimizer=True (AdamW states and fp32 masters live on the host)",
    "activations": "model.checkpoint=1.0 or cpu_offloading.enable=True (saved activations)",
    "host_optimizer_states": "more hosts, or hybrid_optimizer.offload_fraction below 1 instead of swap_optimizer",
}
DEFAULT_REMEDY = "more data-parallel ranks (parallel.mode='fsdp2'), a smaller data.micro_bsz or a smaller model"


class PreflightError(ConfigError):
    """The run's predicted memory exceeds what this machine has (exit 2)."""


@dataclass(frozen=True)
class Prediction:
    """Per-rank peaks the check compares, and the components they came from."""

    device_peak: int
    host_peak: int
    components: dict[str, int]


def predict(cfg: RunConfig, world_size: int, traced: StepMemory | None = None) -> Prediction:
    """This rank's traced peaks; `traced`: this config's trace when one was already made (the planner's
    choice of "auto" knobs). Runs before the process group exists: the trace brings its own fake one. The
    step is composed from its blocks' traces (`compose.py`: a 7B model's from models of 2 and 3 blocks)."""
    memory = traced or trace_composed(cfg, world_size, count_work=False)
    return Prediction(memory.device_peak_bytes, memory.host_peak_bytes, memory.components)


def check_fits(
    cfg: RunConfig,
    *,
    world_size: int,
    local_world_size: int,
    device_total: int | None,
    config_path: str,
    runtime_bytes: int = 0,
    traced: StepMemory | None = None,
) -> Prediction:
    """Raise `PreflightError` when the predicted peaks exceed this machine; returns the prediction.

    `device_total`: the device's memory in bytes, None on the cpu backend (device memory is host memory);
    `runtime_bytes`: the device memory in use before the run (the context and the like), measured at
    start-up (`engine/runtime_memory.py`), which the traced peak does not hold; `traced`: see `predict`.
    """
    prediction = predict(cfg, world_size, traced)
    host_available = available_host_bytes() // max(1, local_world_size)
    if device_total is None:  # what this process holds already is not in the host's available memory
        need, available = prediction.device_peak + prediction.host_peak, host_available
        problem = need > available > 0 and (
            f"predicted {human_bytes(need)} per process (device {human_bytes(prediction.device_peak)} + host "
            f"{human_bytes(prediction.host_peak)}), {human_bytes(available)} available on this host"
        )
        largest = largest_component(prediction.components, None)
    elif prediction.device_peak + runtime_bytes > device_total:
        problem = (
            f"predicted device peak {human_bytes(prediction.device_peak)} per rank + {human_bytes(runtime_bytes)} in use "
            f"before the run, the device has {human_bytes(device_total)}"
        )
        largest = largest_component(prediction.components, "device")
    else:
        problem = prediction.host_peak > host_available > 0 and (
            f"predicted host peak {human_bytes(prediction.host_peak)} per rank, "
            f"{human_bytes(host_available)} available per local rank"
        )
        largest = largest_component(prediction.components, "host")
    logger.info(
        "Preflight: predicted per-rank peak device %s%s, host %s",
        human_bytes(prediction.device_peak),
        f" (+ {human_bytes(runtime_bytes)} in use before the run)" if runtime_bytes else "",
        human_bytes(prediction.host_peak),
    )
    if problem:
        raise PreflightError(
            f"preflight: {problem}; largest: {largest}; try {REMEDIES.get(largest.split()[0], DEFAULT_REMEDY)} "
            f"(python -m internlm_offload.tools.plan --config {config_path}; preflight=False skips this check)"
        )
    return prediction

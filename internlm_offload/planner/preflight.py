"""Preflight: refuse a run whose predicted memory exceeds this machine's, before the model is allocated.

`check_fits(cfg, ...)` traces the configured step (`trace.py`, seconds and a few hundred MB even at
7B) and compares its per-rank peaks with what the machine has: the device's total memory (cuda/npu)
and the host's available memory shared by the local ranks. On the cpu backend the device *is* host
memory, so the two peaks are added and compared with the host's. A run that cannot fit stops with
`PreflightError` (exit 2, one line: predicted vs available and what would help), instead of an
out-of-memory kill minutes later.

FSDP2 is not traced yet (see `trace.py`); for it the check uses a lower bound, the single-process
trace with the parameter-sized components (params, masters, states, grads) divided over the ranks:
a real FSDP2 step needs at least that, so the bound refuses only what cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from internlm_offload.config import ConfigError, RunConfig
from internlm_offload.log import get_logger
from internlm_offload.optim.memory import available_host_bytes
from internlm_offload.planner.trace import StepMemory, trace_step
from internlm_offload.planner.tracker import human_bytes, largest_component

logger = get_logger(__name__)

SHARDED = ("model_params", "master_weights", "optimizer_states", "gradients_at_step")
HOST_SHARDED = ("host_params", "host_master_weights", "host_optimizer_states")
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
    lower_bound: bool  # FSDP2: a bound from the single-process trace


def predict(cfg: RunConfig, world_size: int, traced: StepMemory | None = None) -> Prediction:
    """The traced peaks; for FSDP2 the sharded lower bound (module docstring). `traced`: this config's
    trace when one was already made (the planner's choice of "auto" knobs).

    Traced as one process: the config already holds this rank's batch shape, and without DDP/FSDP2
    wrappers a rank's memory does not depend on the others (no process group exists yet at preflight).
    """
    if cfg.parallel.mode != "fsdp2":
        memory = traced or trace_step(cfg)
        return Prediction(memory.device_peak_bytes, memory.host_peak_bytes, memory.components, lower_bound=False)
    single = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"mode": "none"})})
    return _sharded_bound(trace_step(single), world_size)


def _sharded_bound(memory: StepMemory, world_size: int) -> Prediction:
    keep = 1 - 1 / world_size
    components = dict(memory.components)
    device_saved = sum(components[name] for name in SHARDED) * keep
    host_saved = sum(components[name] for name in HOST_SHARDED) * keep
    for name in (*SHARDED, *HOST_SHARDED):
        components[name] = int(components[name] / world_size)
    return Prediction(int(memory.device_peak_bytes - device_saved), int(memory.host_peak_bytes - host_saved),
                      components, lower_bound=True)  # fmt: skip


def check_fits(
    cfg: RunConfig, *, world_size: int, local_world_size: int, device_total: int | None, config_path: str,
    traced: StepMemory | None = None,
) -> Prediction:
    """Raise `PreflightError` when the predicted peaks exceed this machine; returns the prediction.

    `device_total`: the device's memory in bytes, None on the cpu backend (device memory is host memory);
    `traced`: see `predict`.
    """
    prediction = predict(cfg, world_size, traced)
    host_available = available_host_bytes() // max(1, local_world_size)
    what = "at least " if prediction.lower_bound else ""
    if device_total is None:
        need, available = prediction.device_peak + prediction.host_peak, host_available
        problem = need > available > 0 and (
            f"predicted {what}{human_bytes(need)} per process (device {human_bytes(prediction.device_peak)} + host "
            f"{human_bytes(prediction.host_peak)}), {human_bytes(available)} available on this host")  # fmt: skip
        largest = largest_component(prediction.components, None)
    elif prediction.device_peak > device_total:
        problem = (f"predicted device peak {what}{human_bytes(prediction.device_peak)} per rank, the device has "
                   f"{human_bytes(device_total)}")  # fmt: skip
        largest = largest_component(prediction.components, "device")
    else:
        problem = prediction.host_peak > host_available > 0 and (
            f"predicted host peak {what}{human_bytes(prediction.host_peak)} per rank, "
            f"{human_bytes(host_available)} available per local rank")  # fmt: skip
        largest = largest_component(prediction.components, "host")
    logger.info("Preflight: predicted per-rank peak %sdevice %s, host %s", what, human_bytes(prediction.device_peak),
                human_bytes(prediction.host_peak))  # fmt: skip
    if problem:
        raise PreflightError(
            f"preflight: {problem}; largest: {largest}; try {REMEDIES.get(largest.split()[0], DEFAULT_REMEDY)} "
            f"(python -m internlm_offload.tools.plan --config {config_path}; preflight=False skips this check)"
        )
    return prediction


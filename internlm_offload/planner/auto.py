"""Knobs set to "auto" in a config: chosen at start-up by the planner's search, within `memory_budget`.

`choose_auto_knobs(cfg, config_for, ...)` searches the settings of the knobs the config left to the
planner (`search.activation_settings` / `optimizer_settings` over `cfg.auto_knobs`, in each tensor mode when
`parallel.tensor.mode` is one of them: `search.search_tensor_modes`; the others stay as configured) for the
fastest predicted step whose traced peaks fit `memory_budget.device` (and `.host` when given), and returns the
config with them set. Nothing fitting is a `PreflightError` (exit 2) naming the smallest traced peak. Step
times come from the cost model with the hardware row of the accelerator (`HARDWARE_FOR`; cpu is calibrated on
the spot).
"""

from __future__ import annotations

from internlm_offload.config import RunConfig
from internlm_offload.family import block_count
from internlm_offload.log import get_logger
from internlm_offload.planner.cost import HARDWARE, Hardware, calibrate, shared_by
from internlm_offload.planner.preflight import PreflightError
from internlm_offload.planner.knobs import Space
from internlm_offload.planner.search import Candidate, ConfigFor, search_space, smallest_peak
from internlm_offload.config.sizes import human_bytes
from internlm_offload.torchrun_env import env_local_world_size

logger = get_logger(__name__)

HARDWARE_FOR = {"cuda": "h100", "npu": "910b"}  # assumed rows (cost.py); cpu: calibrate()


def hardware_for(accelerator_name: str) -> Hardware:
    """The accelerator's row, its host shared by this node's ranks (torchrun's LOCAL_WORLD_SIZE)."""
    row = HARDWARE_FOR.get(accelerator_name)
    return shared_by(HARDWARE[row] if row else calibrate(), env_local_world_size())


def choose_auto_knobs(
    cfg: RunConfig, config_for: ConfigFor, *, accelerator_name: str, world_size: int = 1, runtime_bytes: int = 0
) -> tuple[RunConfig, Candidate]:
    """The config with its "auto" knobs set by the search (module docstring), and the chosen candidate.

    `runtime_bytes`: the device memory in use before the run (`engine/runtime_memory.py`); the traced peaks
    must fit what the device budget leaves beside it."""
    budget = cfg.memory_budget
    device_budget = budget.device - runtime_bytes
    runtime_note = f" less {human_bytes(runtime_bytes)} in use before the run" if runtime_bytes else ""
    # the model's blocks: a deepseek_v3 folder's num_hidden_layers, not the section's `model.num_layers`
    space = Space(cfg, frozenset(cfg.auto_knobs), num_layers=block_count(cfg.model), world_size=world_size)
    chosen, candidates, refused = search_space(
        config_for, space, hardware_for(accelerator_name), device_budget, budget.host
    )
    for line in refused:
        logger.info("memory_budget: layout %s", line)
    for candidate in candidates:
        logger.info(
            "memory_budget: %-39s step %.4g s, est. device %s, host %s: %s",
            candidate.name,
            candidate.step_s,
            human_bytes(candidate.estimated_device),
            human_bytes(candidate.estimated_host),
            candidate.verdict,
        )
    if chosen is None:
        raise PreflightError(
            f"memory_budget: no setting of {', '.join(cfg.auto_knobs)} fits device {human_bytes(budget.device)}{runtime_note}"
            f"{'' if budget.host is None else f' and host {human_bytes(budget.host)}'} per rank; "
            f"{smallest_peak(candidates, config_for, world_size)}"
        )
    assert chosen.memory is not None  # a chosen candidate has been traced whole
    logger.info(
        "memory_budget: chose %s for %s: predicted device peak %s, host peak %s per rank, step %.4g s",
        chosen.name,
        ", ".join(cfg.auto_knobs),
        human_bytes(chosen.memory.device_peak_bytes),
        human_bytes(chosen.memory.host_peak_bytes),
        chosen.step_s,
    )
    return config_for(chosen.options), chosen

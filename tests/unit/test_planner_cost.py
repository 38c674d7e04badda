"""The planner's FLOP counter (planner/cost.py) counts what torch's FlopCounterMode counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.flop_counter import FlopCounterMode

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner import trace
from internlm_offload.planner.trace import trace_step

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = {"data.seq_len": 64, "data.micro_bsz": 2, "data.micro_num": 2, "data.global_bsz": None}


def _torch_counter(custom_mapping):
    return FlopCounterMode(display=False, custom_mapping=custom_mapping)


@pytest.mark.parametrize(
    "world_size, options",
    [
        (1, {"model.checkpoint": 0.5, "cpu_offloading.enable": True, "cpu_offloading.num_layers": 1}),
        (2, {"parallel.tensor.size": 2, "parallel.tensor.mode": "fsp", "parallel.mode": "none"}),
    ],
    ids=["recompute-offload", "fsp-2"],
)
def test_flop_counter_totals_equal_torchs_flop_counter_mode(monkeypatch, world_size, options):
    """Every traced step's FLOPs (recomputation, the cpu flash-attention formulas, DTensor ops counted at this
    rank's share) are the same with the planner's lean counter as with torch's FlopCounterMode, exactly."""
    cfg = resolve_config(load_config_file(CONFIGS / "internlm2_tiny.py", {**SMALL, **options}), world_size=world_size)
    lean = trace_step(cfg, world_size)
    monkeypatch.setattr(trace, "FlopCounter", _torch_counter)
    reference = trace_step(cfg, world_size)
    assert lean.micro_batch_work.flops > 0
    assert lean.micro_batch_work == reference.micro_batch_work
    assert lean.optimizer_work == reference.optimizer_work

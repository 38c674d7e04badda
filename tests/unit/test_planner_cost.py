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


def test_stacked_experts_count_their_grouped_gemm_flops():
    """A mixture of experts in bf16 runs its experts as one grouped GEMM (torch's meta kernel in the trace), in
    fp32 on meta as matmuls of every row through one expert's weights: the same multiply-adds, so the same FLOPs,
    forward and both backward products (torch's counter has no formula for the grouped GEMM)."""
    moe = {**SMALL, "model.num_experts": 4, "model.top_k": 2, "model.moe_type": "Dropless", "model.mlp_ratio": 1.0}
    dense = resolve_config(load_config_file(CONFIGS / "internlm2_tiny.py", SMALL))
    fp32 = resolve_config(load_config_file(CONFIGS / "internlm2_tiny.py", moe))
    bf16 = resolve_config(load_config_file(CONFIGS / "internlm2_tiny.py", {**moe, "model.dtype": "torch.bfloat16"}))
    flops = {name: trace_step(cfg).micro_batch_work.flops for name, cfg in (("fp32", fp32), ("bf16", bf16))}
    assert flops["bf16"] == flops["fp32"] > trace_step(dense).micro_batch_work.flops // 2, flops

"""monitor.profile_step's trace, and tools.trace_overlap's measure of copies hidden behind kernels."""

import gzip
import json
from pathlib import Path

import pytest
import torch

from internlm_offload.device import Accelerator
from internlm_offload.engine.profiling import profiled_step, trace_path
from internlm_offload.tools import trace_overlap
from internlm_offload.tools.trace_overlap import covered, merged, overlap_report

CPU = Accelerator("cpu")
REPO = Path(__file__).resolve().parents[2]


def test_only_the_asked_step_is_profiled_and_its_trace_is_gzipped_chrome_json(tmp_path):
    a = torch.randn(64, 64)
    for step in (1, 2, 3):
        with profiled_step(step, profile_step=2, out_dir=tmp_path, accelerator=CPU, rank=0):
            a @ a
    assert sorted(p.name for p in tmp_path.iterdir()) == [trace_path(tmp_path, 2, 0).name]
    events = json.loads(gzip.decompress(trace_path(tmp_path, 2, 0).read_bytes()))["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)


def test_profile_step_zero_profiles_nothing(tmp_path):
    with profiled_step(1, profile_step=0, out_dir=tmp_path, accelerator=CPU, rank=0):
        pass
    assert list(tmp_path.iterdir()) == []


def test_merged_and_covered_follow_interval_union_rules():
    assert merged([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]
    # copies [0,10) and [20,30); kernels [5,25): 5 of the first and 5 of the second are covered
    assert covered([(0, 10), (20, 30)], [(5, 25)]) == 10
    assert covered([(0, 10)], [(2, 3), (2.5, 4), (8, 12)]) == 4  # overlapping kernels count once
    assert covered([(0, 10)], []) == 0


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {}}


def test_overlap_report_splits_directions_and_counts_hidden_time():
    events = [
        _event("kernel", "gemm", 0, 100),
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50, 100),  # half behind the kernel
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 10, 20),  # all behind it
        _event("cpu_op", "aten::copy_", 0, 500),  # host operators are neither copies nor kernels
    ]
    report = overlap_report(events)
    assert report["kernel_busy_us"] == 100
    assert report["copies"]["DtoH"] == {"count": 1, "busy_us": 100, "hidden_fraction": 0.5}
    assert report["copies"]["HtoD"]["hidden_fraction"] == 1.0 and "other" not in report["copies"]


def test_the_tool_reads_a_trace_and_refuses_a_cpu_one(tmp_path, capsys):
    device = tmp_path / "device.json"
    device.write_text(
        json.dumps({"traceEvents": [_event("kernel", "k", 0, 10), _event("gpu_memcpy", "Memcpy HtoD", 0, 10)]})
    )
    assert trace_overlap.main([str(device)]) == 0
    assert json.loads(capsys.readouterr().out)["copies"]["HtoD"]["hidden_fraction"] == 1.0
    cpu = tmp_path / "cpu.json.gz"
    cpu.write_bytes(gzip.compress(json.dumps({"traceEvents": [_event("cpu_op", "aten::mm", 0, 5)]}).encode()))
    assert trace_overlap.main([str(cpu)]) == 2
    assert "no device events" in capsys.readouterr().err
    assert trace_overlap.main([str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("profile_step", [0, 2])
def test_the_run_settings_carry_profile_step_and_the_work_dir(tmp_path, profile_step):
    from internlm_offload.builder.run import trainer_settings
    from internlm_offload.config import load_config_file, resolve_config

    cfg = resolve_config(
        load_config_file(REPO / "configs" / "internlm2_tiny.py", {"monitor.profile_step": profile_step})
    )
    settings = trainer_settings(cfg, work_dir=tmp_path)
    assert settings.profile_step == profile_step and settings.profile_dir == tmp_path / "profile"
    assert trainer_settings(cfg).profile_dir is None  # the planner's trace writes nothing

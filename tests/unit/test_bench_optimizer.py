"""The optimizer benchmark runs end to end at tiny sizes: every configuration, bitwise params, JSON and PNG."""

import json
from pathlib import Path

import pytest
import torch

from internlm_offload.bench import optimizer as bench
from internlm_offload.optim.adamw import AdamW


def test_quick_run_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    records = {rec["name"]: rec for rec in data["results"]}
    assert list(records) == [*bench.CONFIGS, "swap_t4_nvme"]  # swap_t4 again, its states in a file
    assert all(rec["bitwise_equal"] for rec in records.values()), "a configuration changed the params"
    assert records["baseline_adamw_fused"]["ratio"] == 1.0
    for rec in records.values():
        assert len(rec["step_s"]) == bench.QUICK["repeats"]
        assert 0 < rec["step_s_p10"] <= rec["step_s_median"] <= rec["step_s_p90"]
    peak = {name: rec["peak_device_state_bytes"] for name, rec in records.items()}
    assert peak["swap_t16"] <= peak["swap_t4"] < peak["swap_t1"]
    # t1 holds every state at once, as the baseline does, plus the chunks' alignment padding
    assert 0 < peak["baseline_adamw_fused"] <= peak["swap_t1"] < 1.01 * peak["baseline_adamw_fused"]
    assert peak["hybrid_f1.0"] == 0 < peak["hybrid_f0.5"] == peak["hybrid_f0.5_no_overlap"]
    assert records["baseline_adamw_fused"]["host_state_bytes"] == 0 < records["swap_t4"]["host_state_bytes"]
    nvme = records["swap_t4_nvme"]
    assert nvme["host_state_bytes"] == 0 and nvme["disk_state_bytes"] == records["swap_t4"]["host_state_bytes"]
    disk = data["disk_bandwidth"]
    assert disk["write_gb_per_s"] > 0 and disk["read_gb_per_s"] > 0 and disk["bytes"] == 4 * 2**20
    printed = capsys.readouterr().out
    assert "NVMe tier" in printed and "hybrid_f0.5_no_overlap" in printed
    handoff = data["stream_handoff"]
    assert handoff["cpu_stream_round_trip_us"] > 0 and handoff["bare_threads_round_trip_us"] > 0
    floor = data["swap_copy_floor"]
    assert floor["floor_ratio"] > 1 and floor["overlap_ratio"] > 0 and floor["overlapped_s"] > 0
    env = data["env"]
    assert env["torch"] == torch.__version__ and env["threads"] >= 1 and env["cpu_count"] >= 1
    assert abs(env["elements"] - bench.QUICK["elements"]) <= env["tensors"]
    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_config_that_differs_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other_lr = lambda params, acc: AdamW(params, fused=True, lr=2e-3)  # noqa: E731
    configs = {"baseline_adamw_fused": bench.CONFIGS["baseline_adamw_fused"], "other_lr": other_lr}
    monkeypatch.setattr(bench, "CONFIGS", configs)
    out = tmp_path / "o.json"
    assert bench.main(["--quick", "--elements", "2000", "--tensors", "3", "--out", str(out)]) == 1
    flags = {rec["name"]: rec["bitwise_equal"] for rec in json.loads(out.read_text())["results"]}
    assert flags == {"baseline_adamw_fused": True, "other_lr": False}


def test_tensor_sizes_are_odd_varied_and_add_up() -> None:
    sizes = bench.tensor_sizes(1_000_000, 50)
    assert len(sizes) == 50 and all(n % 2 == 1 for n in sizes)
    assert abs(sum(sizes) - 1_000_000) <= 50 and max(sizes) > 20 * min(sizes)
    assert sizes == bench.tensor_sizes(1_000_000, 50)

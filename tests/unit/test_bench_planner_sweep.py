"""The budget sweep writes its JSON and plot, and its choice fits (the search itself: test_plan_tool.py)."""

import json

from internlm_offload.bench import planner_sweep
from internlm_offload.bench.planner_sweep import REPO


def test_sweep_writes_json_and_png_with_a_choice_that_fits(tmp_path):
    config = REPO / "configs" / "internlm2_tiny.py"
    assert planner_sweep.main(["--config", str(config), "--fractions", "0.6", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "planner_sweep.json").read_text())["rows"]
    assert row["chosen"] and row["device_peak_bytes"] <= row["budget_bytes"] and row["step_time_s"] > 0
    assert (tmp_path / "planner_sweep.png").stat().st_size > 0

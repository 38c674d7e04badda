"""The planner's speed bench writes a row per question with its wall time, candidates and traces."""

import json

from internlm_offload.bench import planner_speed

SMALL = [
    "data.seq_len=32",
    "data.micro_bsz=2",
    "data.micro_num=2",
    "data.global_bsz=4",
    "model.num_layers=2",
]  # CI time


def test_speed_rows_carry_wall_time_candidates_and_traces(tmp_path, monkeypatch):
    question = ["--config", planner_speed.TINY, "--device-memory", "6MiB", "--cfg-options", *SMALL]
    monkeypatch.setitem(planner_speed.QUESTIONS, "tiny", question)
    assert planner_speed.main(["--questions", "tiny", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "planner_speed.json").read_text())["rows"]
    assert row["question"] == "tiny" and row["argv"] == question and row["wall_s"] > 0
    assert row["exit_code"] in (0, 3) and row["candidates"] > 0 and row["traces"] > 0

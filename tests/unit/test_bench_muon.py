"""The Muon benchmark runs end to end at tiny sizes: every configuration bitwise its reference, Muon's states half
of AdamW's, JSON written."""

import json
from pathlib import Path

from internlm_offload.bench import muon as bench


def test_quick_run_writes_json_with_every_configuration_bitwise(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == list(bench.CONFIGS) and all(row["bitwise"] for row in rows.values())
    assert 2 * rows["muon"]["state_bytes"] == rows["adamw_fused"]["state_bytes"] == rows["swap_adamw_t4"]["state_bytes"]
    assert rows["swap_muon_t4"]["state_bytes"] == rows["muon"]["state_bytes"]
    assert all(row["median_ms"] > 0 for row in rows.values()) and rows["swap_muon_t4"]["copy_floor_ms"] > 0

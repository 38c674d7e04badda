"""tools/plan while it searches: a progress bar on a terminal's stderr only, and the trace count in --json."""

import json
import sys
from pathlib import Path

import pytest

from internlm_offload.tools import plan

pytestmark = pytest.mark.usefixtures("shared_traces")  # the four searches are one: traced once (CI time)

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "internlm2_tiny.py")
# Two blocks, short sequences: what these tests check (the bar, the JSON keys) does not depend on size (CI time).
SMALL = ["data.seq_len=32", "data.micro_bsz=2", "data.micro_num=2", "data.global_bsz=4", "model.num_layers=2"]


def search(tmp_path, *extra):
    out = tmp_path / "plan.json"
    argv = ["--config", TINY, "--cfg-options", *SMALL, "--device-memory", "12MiB", "--json", str(out), *extra]
    assert plan.main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "terminal, flags, shown", [(True, [], True), (True, ["--no-progress"], False), (False, [], False)]
)
def test_the_progress_bar_shows_on_a_terminal_unless_turned_off(tmp_path, capsys, monkeypatch, terminal, flags, shown):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    report = search(tmp_path, *flags)
    err = capsys.readouterr().err
    assert ("best fit: " + report["verdict"].removeprefix("chosen: ") in err) == shown
    assert ("plan: " in err) == shown


def test_json_keeps_its_shape_and_adds_the_trace_count(tmp_path):
    """The keys the report had, with the parallel mode and the traces the search took: reduced models, the
    choice traced whole once."""
    report = search(tmp_path, "--no-progress")
    assert {"fits", "verdict", "cfg_options", "parallel_mode", "step_time_s", "search", "components"} <= set(report)
    assert report["fits"] and report["parallel_mode"] in ("none", "fsdp2")
    assert 0 < report["traces"] and len(report["search"]) > 0

"""The pipeline bench's bubble arithmetic and its report from given step times (the runs themselves are torchrun
launches: `python -m internlm_offload.bench.pipeline`, docs/benchmarks.md)."""

import pytest

from internlm_offload.bench import pipeline as bench


@pytest.mark.parametrize(
    "schedule, size, micro_num, bubble",
    [
        ("1F1B", 2, 8, 1 / 9),  # (P-1)/(m+P-1)
        ("1F1B", 4, 8, 3 / 11),
        ("interleaved", 4, 8, 3 / 19),  # (P-1)/(2m+P-1)
        ("ZBH1", 4, 8, 3 / 27),  # (P-1)/(3m+P-1)
        ("ZBV", 4, 8, 0.0),
    ],
)
def test_theory_is_each_schedules_idle_share(schedule, size, micro_num, bubble):
    assert bench.theory_bubble(schedule, size, micro_num) == pytest.approx(bubble, rel=1e-12)


def test_the_measured_bubble_is_what_a_rank_holds_beyond_its_share():
    """A P=2 step twice as long as half the one-process step is half bubble; exactly half of it, none."""
    assert bench.measured_bubble(1.0, 2, 1.0) == 0.5
    assert bench.measured_bubble(1.0, 2, 0.5) == 0.0


def test_the_report_from_step_times(tmp_path):
    """Medians (over each run's median), ratios to one process and both bubbles per layout; the plot is written."""
    times = {("one process", 1): [[1.0, 1.1], [5.0, 5.0], [0.8, 1.0]]}  # run medians 1.05, 5.0, 0.9
    for name, _, _ in bench.SCHEDULES:
        times[(name, 2)] = [[0.6, 0.7, 0.5], [0.8]]  # 0.6, 0.8
        times[(name, 4)] = [[0.4]]
    rows = bench.summarize(times, micro_num=8)
    one, first = rows[0], rows[1]
    assert (one["schedule"], one["median_step_s"]) == ("one process", 1.05)  # the slow run outvoted
    assert first["schedule"] == "1F1B" and first["size"] == 2 and first["median_step_s"] == pytest.approx(0.7)
    assert first["speedup"] == pytest.approx(1.05 / 0.7)
    assert first["bubble_measured"] == pytest.approx(1 - 1.05 / 1.4)
    assert first["bubble_theory"] == pytest.approx(1 / 9)
    table = bench.markdown(rows)
    assert "| 2 | 1F1B | 0.700 | 0.67 | 1.50 | 0.25 | 0.11 |" in table
    bench.plot(rows, tmp_path / "pipeline.png")
    assert (tmp_path / "pipeline.png").stat().st_size > 0
    assert [bench.layouts([2])[i][:2] for i in range(2)] == [("one process", 1), ("1F1B", 2)]

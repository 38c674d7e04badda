"""The planner's predicted device peak against a measured `train.py` run on cpu (docs/planner.md).

Two of the benchmark's settings, on its 12-block validation model: the one with every feature (activation
offload, checkpointing with selective offload, swap optimizer with its host arena) and the hybrid
optimizer (its CPU step's states). `python -m internlm_offload.bench.planner` runs all ten.
"""

import pytest

from internlm_offload.bench.planner import CONFIG, TOLERANCE, validate


@pytest.mark.parametrize("setting", ["all", "hybrid 0.5"])
def test_predicted_device_peak_is_within_5_percent_of_measured(setting: str) -> None:
    row = validate(CONFIG, setting, steps=2)
    assert abs(row["error"]) <= TOLERANCE, (
        f"{setting}: predicted {row['device_peak_bytes']} B, measured {row['measured_bytes']} B "
        f"(steps {row['measured_step_peaks_bytes']}): {row['error']:+.1%}"
    )

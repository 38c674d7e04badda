"""The planner's predicted device peak against a measured `train.py` run on cpu (docs/planner.md).

One of the benchmark's settings, on its 12-block validation model: the one with every feature (activation
offload, checkpointing with selective offload, swap optimizer with its host arena), and FSDP2 on two
processes (torchrun, gloo: rank 0's measured peak against its trace over the fake process group);
`tests/e2e/test_memory_budget.py` measures another (the planner's choice), and
`python -m internlm_offload.bench.planner` runs all ten.
"""

import pytest

from internlm_offload.bench.planner import CONFIG, TOLERANCE, validate

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("setting", ["all", "fsdp2 x2"])
def test_predicted_device_peak_is_within_5_percent_of_measured(setting: str) -> None:
    row = validate(CONFIG, setting, steps=2)
    assert abs(row["error"]) <= TOLERANCE, (
        f"{setting}: predicted {row['device_peak_bytes']} B, measured {row['measured_bytes']} B "
        f"(steps {row['measured_step_peaks_bytes']}): {row['error']:+.1%}"
    )

"""`memory_budget` with "auto" knobs: the planner chooses at start-up and the run stays within the budget.

The validation model (configs/planner_validation_auto.py) asks for 60 % of its baseline's device peak;
the measured peak of the steady step must be within that budget + 10 % (issue 9's criterion). Here at sequence 256
(`SHORT`, CI time): the config's 840 MiB is 60 % of its 1.40 GiB baseline at 512; at 256 the baseline traces 906 MiB
and 60 % of it is 540 MiB, where the planner makes the same choice (offload 6 blocks + hybrid 0.5, predicted 529.8 MiB,
measured 531.2) and the run takes 19 s of CPU instead of 29.
"""

import re
from pathlib import Path

import pytest
from runner import REPO, metrics, train

pytestmark = pytest.mark.e2e

AUTO_CONFIG = REPO / "configs" / "planner_validation_auto.py"
BUDGET = 540 * 2**20  # 60 % of the baseline's 906 MiB at sequence 256
SHORT = ["data.seq_len=256", f"memory_budget.device={BUDGET >> 20}MiB"]


def test_a_plan_chosen_for_60_percent_of_the_baseline_trains_within_it(tmp_path: Path) -> None:
    options = ["data.total_steps=2", "ckpt.enable_save_ckpt=False", *SHORT]
    proc = train(tmp_path, *options, config=AUTO_CONFIG, fast=False)
    assert "memory_budget: chose" in proc.stderr
    steady = metrics(tmp_path)[1]["device_peak_mem_bytes"]
    assert 0 < steady <= 1.10 * BUDGET, f"measured {steady / 2**20:.1f} MiB against a budget of {BUDGET >> 20} MiB"
    assert "Memory: device peak of step 2 measured" in proc.stderr  # a 2-step run: its second step


def test_parameter_offload_is_chosen_when_only_it_fits(tmp_path: Path) -> None:
    """The tiny config in bf16 under FSDP2 in one process: 17.2 MiB traced on the device as configured, 4.2 MiB
    with FSDP2's CPU offload policy; a 10 MiB budget leaves the planner that knob only (at 20 MiB both fit, and
    which the cpu's calibrated step times make faster changed from run to run: 2 % apart). On cpu the policy's
    host tensors are ordinary memory, so the memory line compares with the traced device + host peaks."""
    options = ["model.dtype=torch.bfloat16", "parallel.mode=fsdp2", "parallel.fsdp_cpu_offload=auto"]
    proc = train(tmp_path, *options, "memory_budget.device=10MiB", "data.total_steps=3", "ckpt.enable_save_ckpt=False")
    assert "memory_budget: chose activations as configured + params on host (FSDP2)" in proc.stderr
    assert "with CPU offload policy" in proc.stderr
    line = re.search(r"measured ([\d.]+) MiB, predicted ([\d.]+) MiB", proc.stderr)
    assert line is not None and abs(float(line[2]) / float(line[1]) - 1) <= 0.05, line


def test_the_tensor_mode_is_chosen_among_the_four(tmp_path: Path) -> None:
    """The tiny config at sequence 512 on two processes, one tensor group under FSDP2, the mode left to the
    planner: traced peaks mtp 35.8, isp 31.3, msp 31.0, fsp 29.0 MiB; a 30 MiB budget leaves fsp alone (isp,
    the fastest on this machine, is rejected), and the run trains fsp within 5 % of its prediction."""
    shape = ["data.seq_len=512", "data.micro_bsz=2", "data.micro_num=1", "data.total_steps=3"]
    tensor = ["parallel.tensor.size=2", "parallel.tensor.mode=auto", "parallel.mode=fsdp2"]
    proc = train(
        tmp_path, *shape, *tensor, "memory_budget.device=30MiB", "ckpt.enable_save_ckpt=False", nproc=2, fast=False
    )
    assert "memory_budget: chose fsp: activations as configured + optimizer as configured" in proc.stderr
    assert re.search(r"memory_budget: isp: .* device peak [\d.]+ MiB > budget 30.0 MiB", proc.stderr), proc.stderr[
        -3000:
    ]
    assert "Applied tensor parallel fsp over 2 ranks" in proc.stderr
    line = re.search(r"measured ([\d.]+) MiB, predicted ([\d.]+) MiB", proc.stderr)
    assert line is not None and abs(float(line[2]) / float(line[1]) - 1) <= 0.05, line


def test_nothing_fitting_the_budget_is_exit_2_naming_the_smallest(tmp_path: Path) -> None:
    auto = ["model.checkpoint=auto", "cpu_offloading.num_layers=auto", "swap_optimizer=auto"]
    proc = train(tmp_path, "memory_budget.device=1MiB", *auto, check=False)  # the tiny config
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert (
        error.startswith("error: memory_budget: no setting of model.checkpoint") and "; smallest device peak " in error
    )
    assert not (tmp_path / "metrics.jsonl").exists()

"""Activation offload configs against the baseline, end to end: `loss_compare --exact` must pass."""

import subprocess
import sys

import pytest
from runner import REPO, metrics, train

pytestmark = pytest.mark.e2e

OFFLOAD_CONFIGS = ["internlm2_tiny_act_offload.py", "internlm2_tiny_ckpt_offload.py"]
STEPS = ["data.total_steps=20", "ckpt.enable_save_ckpt=False", "data.global_bsz=8"]


def loss_compare(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "internlm_offload.tools.loss_compare", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.parametrize("mode", ["none", "ddp", "fsdp2"])
def test_offload_configs_align_bitwise_with_baseline(tmp_path, mode):
    nproc = 1 if mode == "none" else 2
    base = tmp_path / "base"
    train(base, *STEPS, f"parallel.mode={mode}", nproc=nproc)
    for name in OFFLOAD_CONFIGS:
        run = tmp_path / name
        proc = train(run, *STEPS, f"parallel.mode={mode}", nproc=nproc, config=REPO / "configs" / name)
        assert "offload" in proc.stderr  # the plan table names the offloaded blocks
        compared = loss_compare(str(base), str(run), "--exact", "--quiet")
        assert compared.returncode == 0, compared.stdout
        compared = loss_compare(str(base), str(run), "--exact", "--quiet", "--metric", "grad_norm")
        assert compared.returncode == 0, compared.stdout
        assert metrics(run)[-1]["act_offload_offloaded_bytes"] > 0


def test_loss_compare_catches_a_changed_run(tmp_path):
    """The check above can fail: a different learning rate is misaligned (exit 1)."""
    base, other = tmp_path / "base", tmp_path / "other"
    train(base, "data.total_steps=3", "ckpt.enable_save_ckpt=False")
    train(other, "data.total_steps=3", "ckpt.enable_save_ckpt=False", "adam.lr=0.0031")
    assert loss_compare(str(base), str(other), "--exact", "--quiet").returncode == 1

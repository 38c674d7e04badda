"""The tiny config against its stored CPU loss curve, through the loss_compare CLI.

Regenerate after an intended numerics change:
    python train.py --config configs/internlm2_tiny.py --work-dir work_dirs/golden --cfg-options \\
        data.seq_len=64 data.micro_bsz=2 data.micro_num=2 data.total_steps=20 ckpt.enable_save_ckpt=False
    python -m internlm_offload.tools.loss_compare work_dirs/golden --export tests/golden/internlm2_tiny_cpu.txt
"""

import sys

import pytest
from runner import REPO, run_python, train

pytestmark = pytest.mark.e2e

GOLDEN = REPO / "tests" / "golden" / "internlm2_tiny_cpu.txt"


def test_tiny_config_matches_golden_curve(tmp_path):
    train(tmp_path, "data.total_steps=20", "ckpt.enable_save_ckpt=False")
    # CPU GEMM kernels differ by instruction set (AVX2, AVX-512, ...), so another machine can differ in
    # the last bits; 1e-4 relative still catches any real change of the model, data or optimizer.
    proc = run_python(
        [sys.executable, "-m", "internlm_offload.tools.loss_compare", str(GOLDEN), str(tmp_path), "--rtol=1e-4"]
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "ALIGNED" in proc.stdout

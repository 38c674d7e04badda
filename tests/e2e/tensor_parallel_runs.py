"""What the tensor-parallel e2e files share: layouts, the curve comparisons and their tolerances."""

import subprocess
import sys

STEPS = ["data.total_steps=20", "ckpt.enable_save_ckpt=False"]
OFFLOAD = ["cpu_offloading.enable=True", "cpu_offloading.num_layers=1", "model.checkpoint=0.75"]


def tensor(mode: str, size: int = 2) -> list[str]:
    """A tensor group of `size`; isp needs a wrapper that sums the sequence chunks' gradients (DDP)."""
    options = [f"parallel.tensor.size={size}", f"parallel.tensor.mode={mode}"]
    return options + (["parallel.mode=ddp"] if mode == "isp" else [])


def loss_compare(base, run, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "internlm_offload.tools.loss_compare", str(base), str(run), "--quiet", *flags]
    return subprocess.run(cmd, capture_output=True, text=True)


# The loss within 1e-5 relative (the bar). The gradient norm within 5e-3: on the steps where it
# spikes (9.1 at step 15 of the one-process run, against about 1 around it) the other reduction order shows
# up magnified (up to 2.6e-3 relative under isp at step 16) while the loss stays within 1e-6.
NEAR = {"loss": ["--rtol", "1e-5"], "grad_norm": ["--rtol", "5e-3"]}
EXACT = {"loss": ["--exact"], "grad_norm": ["--exact"]}


def assert_curves(base, run, tolerance: dict[str, list[str]] = EXACT) -> None:
    """Loss and grad norm of every step of `run` against `base`."""
    for metric, flags in tolerance.items():
        compared = loss_compare(base, run, "--metric", metric, *flags)
        assert compared.returncode == 0, (metric, compared.stdout)

"""The memory tiers end to end: gradient offload, parameter offload (FSDP2's CPU offload policy) and the NVMe
tier against the baseline, bitwise.

(Apart from test_offload_e2e.py so that pytest-xdist's per-file distribution can run them beside it.)"""

import shutil
import subprocess
import sys

import pytest
from runner import REPO, baseline_options, metrics, run_python, train

pytestmark = pytest.mark.e2e

NO_CKPT = "ckpt.enable_save_ckpt=False"


def loss_compare(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "internlm_offload.tools.loss_compare", *args]
    return run_python(cmd)


SWAP_GRADS = {"internlm2_tiny_swap.py": []}
HYBRID_GRADS = {"internlm2_tiny_hybrid.py": ["hybrid_optimizer.offload_fraction=1.0"]}


@pytest.mark.parametrize(
    "dtype, mode, runs",
    [
        ("torch.float32", "none", {**SWAP_GRADS, **HYBRID_GRADS}),
        ("torch.bfloat16", "none", {**SWAP_GRADS, **HYBRID_GRADS}),
        ("torch.bfloat16", "ddp", SWAP_GRADS),  # fp32 masters' sums reduced bucket by bucket
        ("torch.float32", "ddp", HYBRID_GRADS),  # the model's own gradients (no masters) reduced
        ("torch.bfloat16", "fsdp2", {**SWAP_GRADS, **HYBRID_GRADS}),  # fp32 shards' reduce-scattered gradients
    ],
    ids=["fp32", "bf16", "bf16-ddp", "fp32-ddp", "bf16-fsdp2"],
)
def test_gradient_offload_trains_the_baseline_curve_bitwise(tmp_path, baseline, dtype, mode, runs):
    """Gradients on the host (several buckets per backward) under the swap optimizer and the hybrid one at
    fraction 1.0, on one rank or two (DDP, FSDP2): loss and grad norm equal the AdamW baseline's (the suite's
    shared one, conftest.py)."""
    nproc = 1 if mode == "none" else 2
    options = [*baseline_options(mode, dtype), NO_CKPT]
    base = baseline(mode, dtype)
    for name, optimizer in runs.items():
        run = tmp_path / name
        config = REPO / "configs" / name
        train(run, *options, *optimizer, "grad_offload=True", "grad_offload_bucket_mb=0.25", nproc=nproc, config=config)
        assert metrics(run)[-1]["grad_offload_host_bytes"] > 0
        for metric in ("loss", "grad_norm"):
            compared = loss_compare(str(base), str(run), "--exact", "--quiet", "--metric", metric)
            assert compared.returncode == 0, compared.stdout


def test_nvme_tier_trains_the_baseline_curve_and_resumes_bitwise(tmp_path, reference_run):
    """Swap states in a file on "NVMe" (here tmp_path's disk): the host arena's curve bitwise, and a host-arena
    checkpoint resumed onto the disk tier continues it bitwise; no file is left behind. (The host arena's run:
    the bf16 baseline's options on the swap config, trained once per pytest run: test_precision_e2e.py compares
    it with the baseline.)"""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = REPO / "configs" / "internlm2_tiny_swap.py"
    common = baseline_options("none", "torch.bfloat16")
    full, on_disk, resumed = reference_run(*common, config=config), tmp_path / "on_disk", tmp_path / "resumed"
    proc = train(on_disk, *common, "nvme_offload.enable=True", f"nvme_offload.path={nvme}", config=config)
    assert f"file under {nvme}" in proc.stderr
    for metric in ("loss", "grad_norm"):
        compared = loss_compare(str(full), str(on_disk), "--exact", "--quiet", "--metric", metric)
        assert compared.returncode == 0, compared.stdout
    shutil.copytree(full / "checkpoints" / "step_00000004", resumed / "checkpoints" / "step_00000004")
    train(resumed, *common, "nvme_offload.enable=True", f"nvme_offload.path={nvme}", config=config, resume=True)
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(full) if r["step"] > 4]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(resumed)] == expected
    assert not list(nvme.iterdir())


def test_nvme_tier_under_fsdp2_trains_the_baseline_curve_bitwise(tmp_path, baseline):
    """Two ranks, each with its own states file (DTensor shards' states) in one directory, and gradient
    offload: FSDP2's curve (the shared baseline's) bitwise, nothing left behind."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    options = [*baseline_options("fsdp2", "torch.bfloat16"), NO_CKPT]
    base, on_disk = baseline("fsdp2", "torch.bfloat16"), tmp_path / "on_disk"
    offload = ["nvme_offload.enable=True", f"nvme_offload.path={nvme}", "grad_offload=True"]
    train(on_disk, *options, *offload, nproc=2, config=REPO / "configs" / "internlm2_tiny_swap.py")
    assert metrics(on_disk)[-1]["optim_disk_state_bytes"] > 0
    for metric in ("loss", "grad_norm"):
        compared = loss_compare(str(base), str(on_disk), "--exact", "--quiet", "--metric", metric)
        assert compared.returncode == 0, compared.stdout
    assert not list(nvme.iterdir())


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_fsdp2_cpu_offload_policy_aligns_with_fsdp2(tmp_path, baseline, dtype):
    """FSDP2's own CPUOffloadPolicy (params, grads, states on the host; bf16: the fp32 shards are the masters)
    changes no bits on CPU, on two ranks (against the suite's shared FSDP2 baseline)."""
    base, offloaded = baseline("fsdp2", dtype), tmp_path / "policy"
    options = [*baseline_options("fsdp2", dtype), NO_CKPT]
    proc = train(offloaded, *options, "parallel.fsdp_cpu_offload=True", nproc=2)
    assert "with CPU offload policy" in proc.stderr
    assert loss_compare(str(base), str(offloaded), "--exact", "--quiet").returncode == 0


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_one_process_fsdp2_cpu_offload_policy_composes_with_activation_offload(tmp_path, dtype):
    """`python train.py` without torchrun (a process group of one): FSDP2's CPUOffloadPolicy under activation
    offload and checkpointing, fp32 or bf16 with the fp32 masters on the host, trains FSDP2's curve bitwise;
    the preflight traces it."""
    base, offloaded = tmp_path / "base", tmp_path / "policy"
    options = ["data.total_steps=4", "ckpt.enable_save_ckpt=False", "parallel.mode=fsdp2", f"model.dtype={dtype}"]
    options += ["cpu_offloading.enable=True", "cpu_offloading.num_layers=2", "model.checkpoint=0.75"]
    train(base, *options)
    proc = train(offloaded, *options, "parallel.fsdp_cpu_offload=True", "preflight=True")
    assert "with CPU offload policy" in proc.stderr and "Preflight: predicted" in proc.stderr
    assert loss_compare(str(base), str(offloaded), "--exact", "--quiet").returncode == 0

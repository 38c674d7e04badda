"""Activation offload configs against the baseline, end to end: `loss_compare --exact` must pass."""

import shutil
import subprocess
import sys

import pytest
from runner import REPO, baseline_options, metrics, run_python, train

pytestmark = pytest.mark.e2e

OFFLOAD_CONFIGS = [
    "internlm2_tiny_act_offload.py",
    "internlm2_tiny_ckpt_offload.py",
    "internlm2_tiny_swap.py",
    "internlm2_tiny_hybrid.py",
    "internlm2_tiny_all_offload.py",
    "internlm2_tiny_grad_offload.py",
]
# Data parallelism adds the gradient all-reduce (DDP) or DTensor params and states (FSDP2) to what the
# hooks see: one config with every activation and swap feature, and the hybrid optimizer (its own grad
# path), cover them; "none" runs every config. (Swap and hybrid alone under FSDP2 are unit-tested on two
# ranks, and resumed across settings below.)
PARALLEL_OFFLOAD_CONFIGS = ["internlm2_tiny_hybrid.py", "internlm2_tiny_all_offload.py"]
# Trained once per pytest run (conftest's `reference_run`, with the baseline's checkpoints at 4 and 8): compared
# with the baseline here, resumed with other settings below, in bf16 also by test_precision_e2e.py and
# test_memory_tiers_e2e.py (CI time).
SHARED_CONFIGS = ["internlm2_tiny_swap.py", "internlm2_tiny_hybrid.py"]


def offload_configs(mode: str) -> list[str]:
    """The offload configs compared with the baseline under `mode`."""
    return OFFLOAD_CONFIGS if mode == "none" else PARALLEL_OFFLOAD_CONFIGS


def loss_compare(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "internlm_offload.tools.loss_compare", *args]
    return run_python(cmd)


@pytest.mark.parametrize("mode", ["none", "ddp", "fsdp2"])
def test_offload_configs_align_bitwise_with_baseline(tmp_path, baseline, reference_run, mode):
    """Each config against the suite's shared fp32 baseline of `mode` (conftest.py), of which it is a variant."""
    nproc = 1 if mode == "none" else 2
    base = baseline(mode)
    for name in offload_configs(mode):
        config = REPO / "configs" / name
        if name in SHARED_CONFIGS:  # no log read below for these
            run, proc = reference_run(*baseline_options(mode), nproc=nproc, config=config), None
        else:
            run = tmp_path / name
            options = [*baseline_options(mode), "ckpt.enable_save_ckpt=False"]
            proc = train(run, *options, nproc=nproc, config=config)
        record = metrics(run)[-1]
        if "swap" in name or "all" in name:
            assert record["optim_device_state_bytes"] == 0 and record["optim_host_state_bytes"] > 0
        if "hybrid" in name or "grad" in name:
            assert record["optim_host_state_bytes"] > 0
        if "grad" in name:
            assert record["grad_offload_host_bytes"] > 0
        if "act" in name or "ckpt" in name or "all" in name:
            assert "offload" in proc.stderr and record["act_offload_offloaded_bytes"] > 0
        compared = loss_compare(str(base), str(run), "--exact", "--quiet")
        assert compared.returncode == 0, f"{name}: {compared.stdout}"
        compared = loss_compare(str(base), str(run), "--exact", "--quiet", "--metric", "grad_norm")
        assert compared.returncode == 0, f"{name}: {compared.stdout}"


def test_loss_compare_catches_a_changed_run(tmp_path):
    """The check above can fail: a different learning rate is misaligned (exit 1)."""
    base, other = tmp_path / "base", tmp_path / "other"
    train(base, "data.total_steps=3", "ckpt.enable_save_ckpt=False")
    train(other, "data.total_steps=3", "ckpt.enable_save_ckpt=False", "adam.lr=0.0031")
    assert loss_compare(str(base), str(other), "--exact", "--quiet").returncode == 1


@pytest.mark.parametrize(
    "mode, config_name, other",
    [
        ("none", "internlm2_tiny_swap.py", "swap_optimizer_times=2"),
        ("none", "internlm2_tiny_swap.py", "grad_offload=True"),
        ("fsdp2", "internlm2_tiny_swap.py", "swap_optimizer_times=2"),
        ("none", "internlm2_tiny_hybrid.py", "hybrid_optimizer.offload_fraction=1.0"),
        ("fsdp2", "internlm2_tiny_hybrid.py", "hybrid_optimizer.offload_fraction=1.0"),
    ],
)
def test_optimizer_offload_resume_with_other_settings_is_bitwise(tmp_path, reference_run, mode, config_name, other):
    """Checkpoint at step 4, resume with another chunking / fraction: steps 5..8 equal the full run (8 steps,
    checkpoints at 4 and 8: the baseline's options, shared with the test above where it runs the config)."""
    nproc = 1 if mode == "none" else 2
    config = REPO / "configs" / config_name
    common = baseline_options(mode)
    full = reference_run(*common, nproc=nproc, config=config)
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "step_00000004", resumed / "checkpoints" / "step_00000004")
    train(resumed, *common, other, nproc=nproc, config=config, resume=True)
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(full) if r["step"] > 4]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(resumed)] == expected


@pytest.mark.parametrize("mode", ["none", "fsdp2"])
def test_hugging_face_model_with_every_offload_aligns(tmp_path, mode):
    """The HF wrapper's decoder layers take the same plan: offload, selective+offload, swap optimizer."""
    nproc = 1 if mode == "none" else 2
    config = REPO / "configs" / "hf_llama_tiny.py"
    options = ["data.total_steps=5", "ckpt.enable_save_ckpt=False", f"parallel.mode={mode}", "data.global_bsz=8"]
    offload = [
        "cpu_offloading.enable=True",
        "cpu_offloading.num_layers=2",
        "model.checkpoint=0.75",
        "selective_checkpoint=True",
        "selective_checkpoint_offload=True",
        "swap_optimizer=True",
    ]
    base, run = tmp_path / "base", tmp_path / "offload"
    train(base, *options, nproc=nproc, config=config)
    proc = train(run, *options, *offload, nproc=nproc, config=config)
    assert "selective+offload" in proc.stderr
    assert loss_compare(str(base), str(run), "--exact", "--quiet").returncode == 0
    record = metrics(run)[-1]
    assert record["act_offload_offloaded_bytes"] > 0 and record["sc_offload_offloaded_bytes"] > 0

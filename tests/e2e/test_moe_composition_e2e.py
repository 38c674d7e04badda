"""Every memory feature on a mixture-of-experts model, bitwise against the MoE run's own baseline: loss, grad norm,
load-balancing loss, per-expert token counts (and the fp16 loss scale) equal at every step.

Launches are few on purpose: one baseline per dtype and parallel mode (shared through conftest's `reference_run`),
and one run per variant that switches on every feature that composes with the others. The MoE blocks route by
data (GShard drops choices over capacity; the counts and permutation differ per micro-batch), so what activation
offload moves and brings back (router logits, permutation order, expert intermediates, the routed rows) and what
checkpointing recomputes must come back exactly for the counts and the loss to match.
"""

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner import REPO, TINY, ForkedRun, assert_same_metrics, metrics, spawn_python, train, train_argv

pytestmark = pytest.mark.e2e

# configs/internlm2_tiny_moe.py as options on the tiny config (so that `reference_run` shares the baselines): 4
# sparse blocks, GShard, 4 experts top-2, one shared expert.
MOE = [
    "model.num_experts=4",
    "model.top_k=2",
    "model.num_shared_experts=1",
    "model.mlp_ratio=1.0",
    "loss.moe_loss_coeff=0.01",
    "data.total_steps=6",
    "data.global_bsz=8",
]
GSHARD, DROPLESS = "model.moe_type=GShard", "model.moe_type=Dropless"
NO_CKPT = "ckpt.enable_save_ckpt=False"
KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_tokens_per_expert", "moe_max_load")
# activation offload of block 0, selective checkpoint (with offload of what it saves) of blocks 1-2, block 3 plain
ACTIVATIONS = [
    "cpu_offloading.enable=True",
    "cpu_offloading.num_layers=1",
    "cpu_offloading.min_offload_bytes=0",  # the int64 routing indices and counts too, however small
    "model.checkpoint=0.75",
    "selective_checkpoint=True",
    "selective_checkpoint_offload=True",
]
# activation offload of blocks 0-1, full checkpoint of block 2
FULL_CHECKPOINT = [
    "cpu_offloading.enable=True",
    "cpu_offloading.num_layers=2",
    "cpu_offloading.min_offload_bytes=0",
    "model.checkpoint=0.75",
]


def baseline_of(reference_run, dtype: str, moe_type: str, mode: str = "none") -> Path:
    nproc = 1 if mode == "none" else 2
    return reference_run(*MOE, moe_type, f"model.dtype={dtype}", f"parallel.mode={mode}", NO_CKPT, nproc=nproc)


def assert_bitwise(base: Path, run: Path, keys: tuple[str, ...] = KEYS) -> None:
    """Every step's values of `keys` equal (runner.assert_same_metrics), the load-balancing loss finite and positive."""
    assert_same_metrics(base, run, keys)
    assert all(math.isfinite(r["moe_aux_loss"]) and r["moe_aux_loss"] > 0 for r in metrics(run))


def test_fp32_gshard_with_activation_offload_selective_checkpoint_swap_gradient_offload_and_nvme(
    tmp_path, reference_run
):
    """fp32, GShard: offloaded and selectively checkpointed MoE blocks, the swap optimizer's states in a file on
    "NVMe" and the gradients on the host: the baseline's every value."""
    base = baseline_of(reference_run, "torch.float32", GSHARD)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    run = tmp_path / "run"
    tiers = ["swap_optimizer=True", "grad_offload=True", "grad_offload_bucket_mb=0.25"]
    tiers += ["nvme_offload.enable=True", f"nvme_offload.path={nvme}"]
    options = [*MOE, GSHARD, "model.dtype=torch.float32", "parallel.mode=none", NO_CKPT, *ACTIVATIONS, *tiers]
    train(run, *options)
    record = metrics(run)[-1]
    assert record["act_offload_offloaded_bytes"] > 0 and record["grad_offload_host_bytes"] > 0
    assert record["optim_disk_state_bytes"] > 0 and record["optim_device_state_bytes"] == 0
    assert_bitwise(base, run)
    assert not list(nvme.iterdir())


def _spawn(work_dir: Path, *options: str, resume: bool = False) -> ForkedRun | subprocess.Popen:
    """train.py in the background, its log in `<work_dir>.stderr` (a pipe nobody reads could fill and stall it)."""
    argv = train_argv(work_dir, *options, config=TINY, resume=resume)
    return spawn_python([sys.executable, str(REPO / "train.py"), *argv], work_dir)


def test_bf16_dropless_with_offload_full_checkpoint_hybrid_gradient_offload_killed_and_resumed(tmp_path, reference_run):
    """bf16 with fp32 masters, Dropless: offloaded and fully checkpointed MoE blocks, the hybrid optimizer (half
    the states stepped on the host); SIGKILL once step 2's checkpoint is written, `--resume`: every step
    equals the uninterrupted baseline's."""
    base = baseline_of(reference_run, "torch.bfloat16", DROPLESS)
    run = tmp_path / "run"
    tiers = ["hybrid_optimizer.enable=True", "hybrid_optimizer.offload_fraction=0.5"]
    ckpt = ["ckpt.checkpoint_every=2", "ckpt.keep_last=0"]
    options = [*MOE, DROPLESS, "model.dtype=torch.bfloat16", "parallel.mode=none", *ckpt, *FULL_CHECKPOINT, *tiers]
    proc = _spawn(run, *options)
    log = proc.stderr_path
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step_00000002").is_dir():
        assert proc.poll() is None, f"the run ended before it could be killed: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 2 <= len(metrics(run)) < 6
    assert _spawn(run, *options, resume=True).wait(timeout=600) == 0, log.read_text()[-3000:]
    record = metrics(run)[-1]
    assert record["act_offload_offloaded_bytes"] > 0 and record["optim_host_state_bytes"] > 0
    assert_bitwise(base, run)


def test_fp16_loss_scaling_with_activation_offload_selective_checkpoint_and_swap(tmp_path, reference_run):
    """fp16 with fp32 masters and the loss scaler (the experts run as a loop over contiguous slices: no grouped
    GEMM in fp16 on cpu): the fp16 baseline's values and loss scale at every step."""
    base = baseline_of(reference_run, "torch.float16", GSHARD)
    run = tmp_path / "run"
    options = [*MOE, GSHARD, "model.dtype=torch.float16", "parallel.mode=none", NO_CKPT, *ACTIVATIONS]
    train(run, *options, "swap_optimizer=True")
    assert metrics(run)[-1]["act_offload_offloaded_bytes"] > 0
    assert_bitwise(base, run, (*KEYS, "loss_scale"))


def test_ddp_on_two_processes_with_offload_selective_checkpoint_and_gradient_offload(tmp_path, reference_run):
    """DDP, fp32 GShard (each rank's capacity from its own tokens): activation offload, selective checkpoint and
    host gradients under the swap optimizer, against DDP's MoE baseline."""
    base = baseline_of(reference_run, "torch.float32", GSHARD, mode="ddp")
    run = tmp_path / "run"
    tiers = ["swap_optimizer=True", "grad_offload=True", "grad_offload_bucket_mb=0.25"]
    options = [*MOE, GSHARD, "model.dtype=torch.float32", "parallel.mode=ddp", NO_CKPT, *ACTIVATIONS, *tiers]
    train(run, *options, nproc=2)
    assert metrics(run)[-1]["grad_offload_host_bytes"] > 0
    assert_bitwise(base, run)


def test_fsdp2_on_two_processes_with_its_cpu_offload_policy_offload_and_full_checkpoint(tmp_path, reference_run):
    """FSDP2, bf16 Dropless (the fp32 shards are the masters): FSDP2's CPU offload policy with offloaded and fully
    checkpointed MoE blocks, against FSDP2's MoE baseline."""
    base = baseline_of(reference_run, "torch.bfloat16", DROPLESS, mode="fsdp2")
    run = tmp_path / "run"
    options = [*MOE, DROPLESS, "model.dtype=torch.bfloat16", "parallel.mode=fsdp2", NO_CKPT, *FULL_CHECKPOINT]
    proc = train(run, *options, "parallel.fsdp_cpu_offload=True", nproc=2)
    assert "with CPU offload policy" in proc.stderr and metrics(run)[-1]["act_offload_offloaded_bytes"] > 0
    assert_bitwise(base, run)

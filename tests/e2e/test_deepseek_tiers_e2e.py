"""Every memory tier on the DeepSeek-V3 family (configs/deepseek_v3_tiny.py: MLA, a dense first block, three sparse
blocks of the bias router with groups and a shared expert, and a multi-token-prediction depth: one more sparse block with
its own router), bitwise against the family's own baseline, in fp32 and in bf16 with fp32 masters: loss, `mtp_loss`,
grad norm, the expert loads and `moe_maxvio` at every step, and the router biases the last step leaves (saved in its
checkpoint; the MTP router's among them) equal with `torch.equal`. The MTP block itself is never offloaded or
checkpointed (the layer plan acts on the main blocks); what the tiers change around it (the optimizer's states, the
gradients on the host, the main blocks' activations) must leave its numbers alone too.

The biases pick the experts, so one bit of an activation brought back wrong or a recompute routing differently moves
a choice, then a bias, then every later step. Runs are few: one baseline per dtype and
wrapper (shared through conftest's `reference_run`: test_deepseek_parallel_e2e.py compares the fp32 ones with other
layouts) and one run per group of tiers that compose.
"""

import shutil
from pathlib import Path

import pytest
from deepseek_runs import DEEPSEEK, DTYPES, STEPS, assert_same_biases, biases, family_baseline
from runner import assert_same_metrics, metrics, train

pytestmark = pytest.mark.e2e

KEYS = ("loss", "mtp_loss", "grad_norm", "moe_maxvio", "moe_tokens_per_expert", "moe_max_load")
# activation offload of block 0 (the dense one), selective checkpointing with its kept outputs offloaded of blocks
# 1-2, block 3 plain; every saved tensor offloaded, the routing indices and counts too, however small
SELECTIVE = [
    "cpu_offloading.enable=True",
    "cpu_offloading.num_layers=1",
    "cpu_offloading.min_offload_bytes=0",
    "model.checkpoint=0.75",
    "selective_checkpoint=True",
    "selective_checkpoint_offload=True",
]
# activation offload of blocks 0-1, full checkpointing of block 2
FULL = ["cpu_offloading.enable=True", "cpu_offloading.num_layers=2", "cpu_offloading.min_offload_bytes=0"]
FULL += ["model.checkpoint=0.75"]
SWAP = ["swap_optimizer=True", "grad_offload=True", "grad_offload_bucket_mb=0.25", "nvme_offload.enable=True"]
HYBRID = ["hybrid_optimizer.enable=True", "hybrid_optimizer.offload_fraction=0.5"]


def assert_bitwise(base: Path, run: Path, keys: tuple[str, ...] = KEYS) -> None:
    """Every step's `keys` equal (runner.assert_same_metrics), and the last step's biases equal."""
    assert_same_metrics(base, run, keys)
    assert_same_biases(base, run)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tiers",
    [
        pytest.param([*SELECTIVE, *SWAP], id="selective-offload-swap-gradoffload-nvme"),
        pytest.param([*FULL, *HYBRID], id="offload-full-checkpoint-hybrid"),
    ],
)
def test_tiers_change_no_bits(tmp_path, reference_run, dtype, tiers):
    """One process: activation offload with selective checkpointing (its kept outputs offloaded too), the swap
    optimizer with its states in a file on "NVMe" and the gradients on the host; or activation offload with full
    checkpointing and the hybrid optimizer stepping half the masters on the host. Each the baseline bit for bit."""
    base = family_baseline(reference_run, dtype)
    run, nvme = tmp_path / "run", tmp_path / "nvme"
    nvme.mkdir()
    swap = "swap_optimizer=True" in tiers
    disk = [f"nvme_offload.path={nvme}"] if swap else []
    train(run, *STEPS, f"model.dtype={DTYPES[dtype]}", *tiers, *disk, config=DEEPSEEK)
    record = metrics(run)[-1]
    assert record["act_offload_offloaded_bytes"] > 0
    if swap:
        assert record["sc_offload_offloaded_bytes"] > 0 and record["grad_offload_host_bytes"] > 0
        assert record["optim_disk_state_bytes"] > 0 and record["optim_device_state_bytes"] == 0
    else:
        assert record["optim_host_state_bytes"] > 0
    assert_bitwise(base, run)
    assert not list(nvme.iterdir())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fsdp2_cpu_offload_policy_changes_no_bits(tmp_path, reference_run, dtype):
    """FSDP2 on two processes with its CPU offload policy (parameters, gradients and states on the host; bf16: the
    fp32 shards are the masters), against FSDP2's own baseline. The biases stay replicated: every rank applies the
    counts pooled over both."""
    base = family_baseline(reference_run, dtype, mode="fsdp2")
    run = tmp_path / "policy"
    options = [*STEPS, f"model.dtype={DTYPES[dtype]}", "parallel.mode=fsdp2", "parallel.fsdp_cpu_offload=True"]
    proc = train(run, *options, nproc=2, config=DEEPSEEK)
    assert "with CPU offload policy" in proc.stderr
    assert_bitwise(base, run)


@pytest.mark.parametrize("dtype", DTYPES)
def test_resume_from_step_2_is_the_straight_run(tmp_path, reference_run, dtype):
    """The baseline's step-2 checkpoint resumed: steps 3-6 and the last biases equal the straight run's. The biases
    come back from the checkpoint (a resume that lost them would pick other experts from step 3 on)."""
    base = family_baseline(reference_run, dtype)
    run = tmp_path / "resumed"
    shutil.copytree(base / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
    train(run, *STEPS, f"model.dtype={DTYPES[dtype]}", config=DEEPSEEK, resume=True)
    assert [r["step"] for r in metrics(run)] == [3, 4, 5, 6]
    moved = biases(base, "step_00000002")
    assert all(t.abs().sum() > 0 for t in moved.values())  # what the resume must bring back is not the init's zeros
    expected = [r for r in metrics(base) if r["step"] > 2]
    for key in KEYS:
        assert [r[key] for r in metrics(run)] == [r[key] for r in expected], key
    assert_same_biases(base, run)

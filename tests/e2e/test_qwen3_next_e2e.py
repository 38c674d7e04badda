"""Qwen3-Next as a native family (model/families/qwen3_next; configs/qwen3_next_tiny.py: three Gated DeltaNet blocks
and one gated full attention, experts beside a sigmoid-gated shared expert) composed with the memory tiers: every
step's loss, grad norm and expert loads the family's baseline bit for bit."""

import pytest
from runner import REPO, assert_same_metrics, metrics, train

pytestmark = pytest.mark.e2e

QWEN3_NEXT = REPO / "configs" / "qwen3_next_tiny.py"
# 4 steps of a global batch of 4 (2 micro-batches of 2 on one process)
STEPS = ["data.total_steps=4", "data.global_bsz=4", "adam.lr=1e-3", "ckpt.checkpoint_every=4", "ckpt.keep_last=0"]
KEYS = ("loss", "grad_norm", "moe_tokens_per_expert", "moe_max_load")
TIERS = ["cpu_offloading.enable=True", "cpu_offloading.num_layers=1", "cpu_offloading.min_offload_bytes=0",
         "model.checkpoint=0.75", "swap_optimizer=True", "grad_offload=True", "grad_offload_bucket_mb=0.25",
         "nvme_offload.enable=True"]  # fmt: skip


def test_tiers_change_no_bits(tmp_path, reference_run):
    """Block 0 (DeltaNet) offloads every saved tensor (the chunked rule's solves and states), blocks 1 and 2
    (DeltaNet) are checkpointed (a recompute rebuilds the documents' chunk layout), block 3 (attention) plain; the
    swap optimizer with its states on "NVMe" and the gradients on the host: the baseline's metrics bit for bit."""
    baseline = reference_run(*STEPS, nproc=1, config=QWEN3_NEXT)
    run, nvme = tmp_path / "run", tmp_path / "nvme"
    nvme.mkdir()
    train(run, *STEPS, *TIERS, f"nvme_offload.path={nvme}", config=QWEN3_NEXT)
    assert metrics(run)[-1]["act_offload_offloaded_bytes"] > 0
    assert_same_metrics(baseline, run, KEYS)


# two depths through one shared MTP layer (model/mtp.py: a gated full-attention block with its own experts after the
# stack), λ 0.3
MTP = [
    "model.mtp_config.num_layers=2",
    "model.mtp_config.share_weights=True",
    "model.mtp_config.loss_scaling_factor=0.3",
]


def test_tiers_with_multi_token_prediction_change_no_bits(tmp_path, reference_run):
    """The same tiers with multi-token prediction on (its layer after the offloaded and checkpointed blocks): the
    MTP baseline's loss, mtp_loss, grad norm and expert loads bit for bit, mtp_loss logged every step."""
    baseline = reference_run(*STEPS, *MTP, nproc=1, config=QWEN3_NEXT)
    run, nvme = tmp_path / "run", tmp_path / "nvme"
    nvme.mkdir()
    train(run, *STEPS, *MTP, *TIERS, f"nvme_offload.path={nvme}", config=QWEN3_NEXT)
    records = metrics(run)
    assert records[-1]["act_offload_offloaded_bytes"] > 0 and all(r["mtp_loss"] > 0 for r in records)
    assert_same_metrics(baseline, run, (*KEYS, "mtp_loss"))

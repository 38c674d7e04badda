"""DeepSeek Sparse Attention end to end (configs/glm5_tiny.py: GLM-5's `glm_moe_dsa`, top-k 16 below the 64-token
packs, blocks 0 and 2 with an indexer, 1 and 3 sharing their top-k): it trains from the config, its loss goes down, the
frozen indexer is saved in every checkpoint and never moves; and the memory tiers change no bit of loss and grad norm.

The tiers put each kind of block under each treatment: activation offload of blocks 0-1 (a full block's saved top-k
indices and its sharer's go to the host and back) with full checkpointing of block 2 (its indexer recomputes the
top-k in backward, block 3 reads it again from the forward's store); or offload of block 0 and selective
checkpointing of blocks 1-2 with its kept outputs offloaded.
"""

import shutil

import pytest
from deepseek_runs import LAST, STEPS
from runner import REPO, assert_same_metrics, metrics, train
from tensor_parallel_runs import NEAR, assert_curves, tensor

from internlm_offload.tools.export import load_weights

pytestmark = pytest.mark.e2e

GLM5 = REPO / "configs" / "glm5_tiny.py"
KEYS = ("loss", "grad_norm", "moe_maxvio", "moe_tokens_per_expert")
OFFLOAD = ["cpu_offloading.enable=True", "cpu_offloading.min_offload_bytes=0"]
TIERS = {
    "offload-full-checkpoint": [*OFFLOAD, "cpu_offloading.num_layers=2", "model.checkpoint=0.75"],
    "offload-selective-checkpoint-offload": [
        *OFFLOAD,
        "cpu_offloading.num_layers=1",
        "model.checkpoint=0.75",
        "selective_checkpoint=True",
        "selective_checkpoint_offload=True",
    ],
}


def indexer_weights(run, step: str) -> dict:
    return {k: v for k, v in load_weights(run / "checkpoints" / step).items() if ".indexer." in k}


def test_trains_from_the_config_with_a_frozen_indexer(reference_run):
    run = reference_run(*STEPS, config=GLM5)
    losses = [r["loss"] for r in metrics(run)]
    assert losses[-1] < losses[0] - 0.5, losses
    first, last = indexer_weights(run, "step_00000002"), indexer_weights(run, LAST)
    assert len(first) == 10 and {k.split(".")[1] for k in first} == {"0", "2"}  # blocks 0 and 2 own one
    assert first.keys() == last.keys() and all(first[k].equal(last[k]) for k in first)


@pytest.mark.parametrize(
    ("tier", "dtype"),
    [("offload-full-checkpoint", "torch.float32"), ("offload-selective-checkpoint-offload", "torch.bfloat16")],
    ids=["offload-full-checkpoint-fp32", "offload-selective-checkpoint-offload-bf16"],
)
def test_tiers_change_no_bits(tmp_path, reference_run, tier, dtype):
    """Each tier in one precision (fp32, or bf16 with fp32 masters), each precision once: the baseline bit for bit.
    The tier x precision grid on the family is test_deepseek_tiers_e2e.py's. Red with the offloaded top-k indices
    brought back rolled along k (the same keys summed in another order: off in the last bits at step 4 or 5)."""
    precision = [] if dtype == "torch.float32" else [f"model.dtype={dtype}"]
    base = reference_run(*STEPS, *precision, config=GLM5)
    run = tmp_path / "run"
    train(run, *STEPS, *precision, *TIERS[tier], config=GLM5)
    assert metrics(run)[-1]["act_offload_offloaded_bytes"] > 0
    assert_same_metrics(base, run, KEYS)


def test_resume_from_step_2_is_the_straight_run(tmp_path, reference_run):
    """The baseline's step-2 checkpoint resumed: steps 3-6 equal the straight run's (the indexer read back with it)."""
    base = reference_run(*STEPS, config=GLM5)
    run = tmp_path / "resumed"
    shutil.copytree(base / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
    train(run, *STEPS, config=GLM5, resume=True)
    assert [r["step"] for r in metrics(run)] == [3, 4, 5, 6]
    expected = [r for r in metrics(base) if r["step"] > 2]
    for key in KEYS:
        assert [r[key] for r in metrics(run)] == [r[key] for r in expected], key


@pytest.mark.parametrize(
    ("options", "nproc"),
    [
        pytest.param(["parallel.mode=fsdp2"], 2, id="fsdp2"),
        pytest.param(["parallel.mode=ddp", "parallel.expert.size=2"], 2, id="ep2-ddp"),
        pytest.param(tensor("isp"), 2, id="isp2"),
        pytest.param([*tensor("fsp"), "parallel.mode=fsdp2", "parallel.expert.no_tp=True"], 2, id="fsp2"),
        pytest.param(["parallel.pipeline.size=2", "parallel.mode=ddp"], 4, id="pp2-ddp2"),
    ],
)
def test_layouts_follow_one_process(tmp_path, reference_run, options, nproc):
    """FSDP2 on two processes (the frozen indexer sharded beside the trained weights, drawn by the meta build),
    expert parallel over two under DDP (the frozen indexer left out of DDP's reduction with the experts; expert data
    2 on four ranks, the same path with its counts pooled wider, is test_deepseek_parallel_e2e.py's), isp on two
    (each rank's indexer scores the whole sequence from inputs gathered along it, its heads attend every token after
    Ulysses' exchange), fsp on two (MLA's heads split as for plain MLA; the indexer whole on both ranks over the
    sequence the attention's input is gathered to, run again in backward inside fsp's recomputed region: mtp and msp
    take the same path without the recompute) and two pipeline stages of DDP over two ranks each (blocks 0-1 and 2-3:
    each stage begins at a full block, so its shared block takes the top-k of its own stage; DDP alone is this
    launch's data-parallel half, and ep2-ddp's): one process's curve within NEAR (the reductions run in another
    order; the indexer's choices, integers, the same unless a score sits at a near tie within that rounding). Red
    with DDP leaving the attention's weights unreduced under expert parallel (off from step 2), and with the
    indexer fed only this rank's half of the sequence under fsp (its keys elsewhere zeroed: the loss off at step 1,
    see docs/deepseek.md)."""
    base = reference_run(*STEPS, config=GLM5)
    run = tmp_path / "run"
    proc = train(run, *STEPS, *options, config=GLM5, nproc=nproc)
    if "parallel.expert.size=2" in options:
        assert "Applied expert parallel over 2 ranks (1 expert-data groups)" in proc.stderr
    for mode in ("isp", "fsp"):
        if f"parallel.tensor.mode={mode}" in options:
            assert f"Applied tensor parallel {mode} over 2 ranks" in proc.stderr
    if "parallel.pipeline.size=2" in options:
        assert "Pipeline rank 0 of 2: stages [0] of 2 (Schedule1F1B), DDP over 2 ranks each" in proc.stderr
    assert_curves(base, run, NEAR)

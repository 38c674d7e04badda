"""Mixtures of experts over pipeline stages (torchrun over gloo) against one process of the same global batch: the
native MoE with InternEvo's load-balancing loss (each stage backpropagating its own sparse blocks' share) under ZBV,
and the DeepSeek-V3 family (its dense first block on stage 0, multi-token prediction on the last, its router biases
moved from choices counted by each stage's data-parallel ranks) at P = 2 x DDP 2. Loss within 1e-5, grad norm within 1e-4 relative (the stages' norms
summed over the pipeline: reduction order alone), the aux loss within 1e-5 (summed per stage, then over the stages),
`moe_maxvio` within 1 % and the biases bit for bit (integer counts pooled over every rank, as in
test_deepseek_parallel_e2e.py). Measured: the loss bitwise or 1 ulp (1.2e-7), the grad norm within 2.1e-7, the aux
loss within 1 ulp (8.2e-8), `moe_maxvio` equal at every step.
"""

import pytest
from deepseek_runs import DEEPSEEK, STEPS, assert_same_biases, family_baseline
from runner import metrics, train
from tensor_parallel_runs import NEAR, assert_curves

pytestmark = pytest.mark.e2e

# test_moe_composition_e2e.py's fp32 GShard baseline, option for option (so that `reference_run` trains it once):
# 4 sparse blocks, 4 experts top-2, one shared expert, 6 steps of a global batch of 8 (4 micro-batches of 2)
MOE = [
    "model.num_experts=4",
    "model.top_k=2",
    "model.num_shared_experts=1",
    "model.mlp_ratio=1.0",
    "loss.moe_loss_coeff=0.01",
    "data.total_steps=6",
    "data.global_bsz=8",
    "model.moe_type=GShard",
    "model.dtype=torch.float32",
    "parallel.mode=none",
    "ckpt.enable_save_ckpt=False",
]
WITH_AUX = {**NEAR, "moe_aux_loss": ["--rtol", "1e-5"]}


def test_the_load_balancing_loss_of_every_stage_trains_as_in_one_process(tmp_path, reference_run):
    """ZBV at P = 2 on 2 processes: stages 0 and 3 (blocks 0 and 3) on rank 0, 1 and 2 on rank 1, each stage's
    sparse block carrying its load-balancing loss into its own backward (through torch's split input and weight
    passes), the logged `moe_aux_loss` summed over the stages. Red with the carried loss's gradient dropped (the
    routers then learn from the token loss alone: the grad norm 6.0699 against 6.0715 at step 1, the loss off
    from step 2, 0.0128 at step 4)."""
    one = reference_run(*MOE)
    run = tmp_path / "zbv"
    proc = train(run, *MOE, "parallel.pipeline.size=2", "parallel.pipeline.mode=ZBV", nproc=2)
    assert "Pipeline rank 0 of 2: stages [0, 3] of 4 (ScheduleZBVZeroBubble)" in proc.stderr
    assert [record["step"] for record in metrics(run)] == list(range(1, 7))
    assert_curves(one, run, WITH_AUX)


def test_deepseek_at_p2_by_ddp2_counts_every_stages_choices_and_moves_the_biases_as_one_process(
    tmp_path, reference_run
):
    """Four ranks, stages {0, 1} (the dense block 0 and sparse block 1) and {2, 3} (sparse blocks 2, 3, then the
    multi-token-prediction layer), DDP over each stage's two ranks: each rank counts its own routers' choices in a
    table of the model's 4, the tables summed over all four, so every router's row pools the tokens of its stage's
    two data-parallel ranks; every rank moves the biases it holds and logs `moe_maxvio` over all of them. The first
    stage embeds the depth's rolled ids and sends them on beside the hidden state; the last stage runs the depth and
    its loss, logged as `mtp_loss` (within 1e-5, as the loss). Red with the table summed over the pipeline group
    alone (each row half its stage's tokens: the loss off from step 2, 5.0e-4 at step 6), and with the depth's
    labels not rolled (the loss off from step 2)."""
    one = family_baseline(reference_run)  # test_deepseek_parallel_e2e.py's one process, multi-token prediction on
    run = tmp_path / "p2_ddp2"
    proc = train(run, *STEPS, "parallel.pipeline.size=2", "parallel.mode=ddp", config=DEEPSEEK, nproc=4)
    assert "Pipeline rank 0 of 2: stages [0] of 2 (Schedule1F1B), DDP over 2 ranks each" in proc.stderr
    assert_curves(one, run, NEAR)
    got, want = ([r["moe_maxvio"] for r in metrics(path)] for path in (run, one))
    assert got == pytest.approx(want, rel=1e-2), (got, want)
    got, want = ([r["mtp_loss"] for r in metrics(path)] for path in (run, one))
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert_same_biases(one, run, mtp=True)

"""`model.balancing_loss='global_batch'` (XTuner's global-batch balancing loss) over ranks (torchrun over gloo): two DDP
ranks of 2 rows per micro-batch follow one process of the same 4 rows per micro-batch (the sampler gives rank r rows
2r, 2r + 1 of each micro-batch of 4) within tensor_parallel_runs.NEAR, the logged `moe_aux_loss` too. The loss reads
the choices and the router weights of every rank's tokens (engine/router_pool.py): the counts summed without gradient,
the weights' sums with an all-reduce whose backward sums the gradients over the ranks, so DDP's average of the ranks'
gradients is the one process's. Red with that backward the identity (each rank's router then learns from its own
share of the gradient alone: the loss off from step 2, 8.4e-4 by step 5), and with no pool at all (each rank's own
micro-batch loss: the loss off from step 2)."""

import pytest
from deepseek_runs import DEEPSEEK, STEPS, assert_same_biases
from runner import metrics, train
from tensor_parallel_runs import NEAR, assert_curves

pytestmark = pytest.mark.e2e

GLOBAL = ["model.balancing_loss=global_batch", "loss.moe_loss_coeff=0.01"]


def test_two_ranks_follow_one_process_of_their_pooled_rows(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, *STEPS, *GLOBAL, "data.micro_bsz=4", "data.micro_num=2", config=DEEPSEEK)
    train(two, *STEPS, *GLOBAL, "data.micro_bsz=2", "data.micro_num=2", "parallel.mode=ddp", config=DEEPSEEK, nproc=2)
    assert_curves(one, two, NEAR)
    want, got = ([r["moe_aux_loss"] for r in metrics(run)] for run in (one, two))
    assert got == pytest.approx(want, rel=1e-5) and all(0.03 < value < 0.07 for value in want), want  # 3 blocks + MTP's
    assert_same_biases(one, two)

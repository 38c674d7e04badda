"""DeepSeek-V3's bias router in the native sparse block under expert parallel (torchrun over gloo): four ranks in two
expert groups of two count their own tokens' choices, and the counts pooled over every rank give one process's update
of the same global batch. One single-process run and one torchrun launch (CI time)."""

import pytest
import torch
from runner import REPO, metrics, train
from tensor_parallel_runs import CALM, NEAR, assert_curves

from internlm_offload.tools.export import load_weights

pytestmark = pytest.mark.e2e
MOE = REPO / "configs" / "internlm2_tiny_moe.py"
# 4 experts in 2 groups of 2, the best group kept: top-2 inside one group; the shared expert added as it is
BIAS_ROUTER = [
    "model.moe_type=Dropless",
    "model.moe_layer_kwargs.scoring_func=sigmoid",
    "model.moe_layer_kwargs.score_correction_bias=True",
    "model.moe_layer_kwargs.n_group=2",
    "model.moe_layer_kwargs.topk_group=1",
    "model.shared_expert_gate=none",
]
# 4 steps of a global batch of 8 (micro-batch 2): one process runs 4 micro-batches a step, four ranks 1 each
STEPS = ["data.total_steps=4", "data.global_bsz=8", "model.dtype=torch.float32", "ckpt.enable_save_ckpt=True",
         "ckpt.checkpoint_every=4", "ckpt.keep_last=0"]  # fmt: skip
BIASES = "feed_forward.router.e_score_correction_bias"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("bias") / "one_process"
    train(run, *STEPS, *CALM, *BIAS_ROUTER, config=MOE)
    return run


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_ep_2_by_expert_data_2_moves_the_bias_as_one_process(tmp_path, one_process, mode):
    """Four ranks, expert groups {0, 1} and {2, 3}, under DDP and under FSDP2 (its meta build zeroes the bias): each
    step's choices, pooled over all four (the expert-data and the expert ranks), give one process's counts (XTuner's
    maxvio the same at every step) and its biases, bit for bit, saved once; the losses within 1e-5. Pooling over an
    expert group or an expert-data pair alone would see half the tokens."""
    one, four = one_process, tmp_path / "ep2_edp2"
    layout = [f"parallel.mode={mode}", "parallel.expert.size=2"]
    proc = train(four, *STEPS, *CALM, *BIAS_ROUTER, *layout, config=MOE, nproc=4)
    assert "Applied expert parallel over 2 ranks (2 expert-data groups)" in proc.stderr
    assert "Router bias: the e_score_correction_bias of 4 routers moves against its experts' load" in proc.stderr
    assert [r["moe_maxvio"] for r in metrics(four)] == [r["moe_maxvio"] for r in metrics(one)]
    assert_curves(one, four, NEAR)
    want, got = (load_weights(run / "checkpoints" / "step_00000004") for run in (one, four))
    biases = [key for key in want if key.endswith(BIASES)]
    assert len(biases) == 4 and not torch.equal(want[biases[0]], torch.zeros(4))
    assert all(got[key].dtype == torch.float32 and torch.equal(got[key], want[key]) for key in biases)

"""Qwen3-Next over ranks (torchrun over gloo; configs/qwen3_next_tiny.py: three Gated DeltaNet blocks and one gated
full attention, 2 key heads of 2 value heads each in the DeltaNet): each layout follows one process of the same global
batch within tensor_parallel_runs.NEAR (loss 1e-5 relative, grad norm 1e-4). Three launches fold the layouts
(docs/qwen3_next.md, "Layouts", has every layout measured apart):

- isp 2 with expert parallel 2 under FSDP2: each rank projects its half of the sequence, the DeltaNet's key-head
  groups are exchanged for the whole sequence of its own group (its conv and recurrence never cut at the shard
  boundary), each rank holding 4 of the 8 experts of every block (an expert-data group of one: FSDP2's reduction of
  the experts' gradients, engine/parallel.py `shard_experts`).
- msp 2 x FSDP2 2 (four processes): the fused in_proj_qkvz / in_proj_ba split by whole key-head groups, out_proj by
  rows, the conv, A_log, dt_bias and gated norm whole with summed gradients; the gated attention by whole heads.
- a pipeline of 2 stages (1F1B, two blocks each) x DDP 2 (four processes, micro-batches of 1 so that each rank has
  the two a 1F1B pipeline needs: the same global batch).
"""

import pytest
from runner import REPO, train
from tensor_parallel_runs import NEAR, assert_curves, tensor

pytestmark = pytest.mark.e2e

QWEN3_NEXT = REPO / "configs" / "qwen3_next_tiny.py"
# test_qwen3_next_e2e.py's steps: the same one-process baseline (`reference_run` trains it once per pytest run)
STEPS = ["data.total_steps=4", "data.global_bsz=4", "adam.lr=1e-3", "ckpt.checkpoint_every=4", "ckpt.keep_last=0"]
FSDP2_COLUMN_ROW = ["parallel.mode=fsdp2", "parallel.expert.no_tp=True"]  # each sparse block whole on a tensor rank
LAYOUTS = {
    "isp_ep_fsdp2": (
        2,
        ["parallel.tensor.size=2", "parallel.tensor.mode=isp", "parallel.mode=fsdp2", "parallel.expert.size=2"],
        "Applied tensor parallel isp over 2 ranks",
    ),
    "msp_fsdp2": (4, [*tensor("msp"), *FSDP2_COLUMN_ROW], "Applied tensor parallel msp over 2 ranks"),
    "pipeline_ddp": (
        4,
        ["parallel.pipeline.size=2", "parallel.mode=ddp", "data.micro_bsz=1"],
        "Pipeline rank 0 of 2: stages [0] of 2 (Schedule1F1B), DDP over 2 ranks each",
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_follows_one_process(tmp_path, reference_run, layout):
    """The layout's loss and grad norm within NEAR of one process at every step. Red with the conv run on each
    rank's sequence chunk before isp's exchange (its taps cut at the shard boundary; isp x DDP: step 1's loss 8.3e-5
    off, 2.3e-4 by step 4), with the conv's channels taken as one even run of rows per rank under msp (rank 0 then
    reads all the Q and K channels and no V channel of its group: step 1's loss 3.1e-4 off, 1.4e-3 by step 3), and
    with FSDP2's force-sum left on for the experts' group of one (their gradients halved: step 1's grad norm 1.3e-2
    off, the loss 1.4e-5 by step 4)."""
    nproc, options, said = LAYOUTS[layout]
    one = reference_run(*STEPS, nproc=1, config=QWEN3_NEXT)
    run = tmp_path / layout
    proc = train(run, *STEPS, *options, config=QWEN3_NEXT, nproc=nproc)
    assert said in proc.stderr
    assert_curves(one, run, NEAR)


# test_qwen3_next_e2e.py's multi-token prediction: two depths through one shared layer, λ 0.3
MTP = [
    "model.mtp_config.num_layers=2",
    "model.mtp_config.share_weights=True",
    "model.mtp_config.loss_scaling_factor=0.3",
]


@pytest.mark.parametrize("layout", ["isp_ep_fsdp2", "msp_fsdp2", "pipeline_ddp"])
def test_multi_token_prediction_follows_one_process(tmp_path, reference_run, layout):
    """The same layouts with multi-token prediction on (its layer a side block of the tensor plan: its attention split
    by heads under msp, exchanged under isp, its experts sharded by expert parallel; on the pipeline's last stage, the
    depths' embeddings sent on from the first): loss, grad norm and mtp_loss within NEAR of one process with MTP."""
    nproc, options, said = LAYOUTS[layout]
    one = reference_run(*STEPS, *MTP, nproc=1, config=QWEN3_NEXT)
    run = tmp_path / layout
    proc = train(run, *STEPS, *MTP, *options, config=QWEN3_NEXT, nproc=nproc)
    assert said in proc.stderr
    assert_curves(one, run, {**NEAR, "mtp_loss": ["--rtol", "1e-5"]})

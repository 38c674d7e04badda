"""Pipeline parallel (InternEvo's `parallel.pipeline` on torch.distributed.pipelining) end to end under torchrun
over gloo, from the shipped configs/internlm2_tiny_pp2.py.

In fp32 (at lr 1e-3, `CALM`) every schedule follows the one-process curve of the same global batch (8 sequences a
step) within 1e-5 relative per step for 20 steps: 1F1B at P=2 with 2 data-parallel ranks per stage (DDP), ZBH1 at
P=4, interleaved 1F1B over 2 chunks at P=2 with FSDP2 over 2 ranks per stage, ZBV at P=2; ZBV run again gives the
same bits. Red with a micro-batch's loss scaled twice (the schedule's `scale_grads=True` over the trainer's weighted
loss) and with the gradient norm not summed over the stages.
"""

import pytest
from runner import REPO, metrics, train
from tensor_parallel_runs import CALM, NEAR, STEPS, assert_curves

pytestmark = pytest.mark.e2e

PP2 = REPO / "configs" / "internlm2_tiny_pp2.py"
BATCH = ["data.global_bsz=8"]  # 4 micro-batches of 2 on one rank per stage, 2 on each of 2 data-parallel ranks


@pytest.fixture(scope="module")
def one_process(one_process_reference):
    """The fp32 curve of one process over the same global batch, in 4 micro-batches."""
    return one_process_reference(*STEPS, *CALM, *BATCH)


@pytest.mark.parametrize(
    "name, nproc, options, schedule",
    [
        ("1f1b_p2_ddp2", 4, ["parallel.mode=ddp"], "0 of 2: stages [0] of 2 (Schedule1F1B), DDP over 2 ranks each"),
        (
            "zbh1_p4",
            4,
            ["parallel.pipeline.size=4", "parallel.pipeline.mode=zbh1"],
            "0 of 4: stages [0] of 4 (ScheduleInterleavedZeroBubble)",
        ),
        (
            "interleaved_p2_fsdp2",
            4,
            ["model.num_chunks=2", "parallel.mode=fsdp2"],
            "0 of 2: stages [0, 2] of 4 (ScheduleInterleaved1F1B), FSDP2 over 2 ranks each",
        ),
    ],
)
def test_each_schedule_follows_the_one_process_curve(tmp_path, one_process, name, nproc, options, schedule):
    """The loss within 1e-5 relative of one process for 20 steps, logged once (rank 0, from the last stage)."""
    run = tmp_path / name
    proc = train(run, *STEPS, *CALM, *BATCH, *options, nproc=nproc, config=PP2)
    assert f"Pipeline rank {schedule}" in proc.stderr
    assert [record["step"] for record in metrics(run)] == list(range(1, 21))
    assert_curves(one_process, run, NEAR)


def test_zbv_follows_the_one_process_curve_and_repeats_bitwise(tmp_path, one_process):
    """ZBV (two chunks per rank in a V: rank 0 holds the first and the last stage) within 1e-5 of one process; the
    same config again (4 steps of the same 20-step schedule) gives the same bits."""
    zbv = [*STEPS, *CALM, *BATCH, "parallel.pipeline.mode=ZBV", "lr_scheduler.total_steps=20"]
    first, again = tmp_path / "zbv", tmp_path / "zbv_again"
    proc = train(first, *zbv, nproc=2, config=PP2)
    assert "Pipeline rank 0 of 2: stages [0, 3] of 4 (ScheduleZBVZeroBubble)" in proc.stderr
    assert_curves(one_process, first, NEAR)
    train(again, *zbv, "data.total_steps=4", nproc=2, config=PP2)
    repeated = metrics(again)
    assert len(repeated) == 4
    for a, b in zip(metrics(first), repeated):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]

"""Every expert split over the tensor group (InternEvo's `parallel.expert.no_tp=False`, its default;
engine/expert_tensor_parallel.py) under mtp and msp at T = 2 against one process, and its checkpoint resumed without
tensor parallel: one torchrun launch trains every layout one after another (several_runs.py)."""

import pytest
from runner import REPO, metrics, python, run_python, train_argv
from several_runs import THEN
from tensor_parallel_runs import assert_curves
from test_gpt_oss_e2e import GPT_OSS
from test_gpt_oss_e2e import STEPS as GPT_OSS_STEPS
from test_pipeline_moe_e2e import MOE

pytestmark = pytest.mark.e2e

SEVERAL = REPO / "tests" / "e2e" / "several_runs.py"
WITHIN = {"loss": ["--rtol", "1e-5"], "grad_norm": ["--rtol", "1e-5"]}
SPLIT = ["parallel.mode=fsdp2", "parallel.tensor.size=2", "parallel.expert.no_tp=False"]


def test_split_experts_follow_one_process_and_resume_on_another_layout(tmp_path, reference_run):
    """InternLM2's GShard MoE (4 experts top-2, a shared expert mixed by the softmax coefficient) and GPT-OSS (biased
    experts, clamped SwiGLU, biased router) on 2 ranks under FSDP2: each rank holds half of every expert's width (w1 /
    w3 / b1 / b3 rows, w2 columns) and of the shared expert, routes every token and sums its part of the output over
    the tensor group (mtp: all-reduce; msp: the input gathered, the output reduce-scattered), b2 added by one rank.
    Loss and grad norm within 1e-5 (relative) of one process for 6 steps each. The mtp run's DCP checkpoint of step 3
    resumed on the same 2 ranks without tensor parallel (FSDP2 over both: DCP reassembles each expert's halves and
    cuts FSDP2's shards of whole experts) goes on within 1e-5 of one process. Red with b2 added on every tensor rank
    (GPT-OSS mtp: the loss 2.6e-3 off at step 2, the grad norm 0.85 at step 1); by hand, on 4 steps of the same runs:
    with the output's reduction left out (InternLM2 mtp: the loss off from step 1), with the gradient of what the
    experts read not summed over "tp" (InternLM2 msp: the grad norm off from step 1, 0.067 at step 2), and with w2
    split on its rows (a shape error in the grouped GEMM)."""
    moe_one = reference_run(*MOE)
    gpt_one = reference_run(*GPT_OSS_STEPS, nproc=1, config=GPT_OSS)
    saved = ["ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=3", "ckpt.keep_last=0"]
    runs = {
        "moe_mtp": ([*MOE, *SPLIT, "parallel.tensor.mode=mtp", *saved], REPO / "configs" / "internlm2_tiny.py"),
        "moe_msp": ([*MOE, *SPLIT, "parallel.tensor.mode=msp"], REPO / "configs" / "internlm2_tiny.py"),
        "gpt_mtp": ([*GPT_OSS_STEPS, *SPLIT, "parallel.tensor.mode=mtp"], GPT_OSS),
        "gpt_msp": ([*GPT_OSS_STEPS, *SPLIT, "parallel.tensor.mode=msp"], GPT_OSS),
    }
    step_3 = tmp_path / "moe_mtp" / "checkpoints" / "step_00000003"
    resume = [f"ckpt.load_ckpt_info.path={step_3}", "ckpt.load_ckpt_info.content=['all']"]
    runs["resumed_dp2"] = ([*MOE, "parallel.mode=fsdp2", *resume], REPO / "configs" / "internlm2_tiny.py")
    argv = [*python(2), str(SEVERAL)]
    for index, (name, (options, config)) in enumerate(runs.items()):
        argv += [THEN] * bool(index) + train_argv(tmp_path / name, *options, config=config)
    proc = run_python(argv)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("Applied tensor parallel mtp over 2 ranks") == 2
    for name, (_, config) in runs.items():
        if name != "resumed_dp2":
            assert_curves(gpt_one if config == GPT_OSS else moe_one, tmp_path / name, WITHIN)
    resumed = metrics(tmp_path / "resumed_dp2")
    assert [r["step"] for r in resumed] == [4, 5, 6], resumed
    expected = {r["step"]: r for r in metrics(moe_one)}
    for record in resumed:
        want = expected[record["step"]]
        assert record["loss"] == pytest.approx(want["loss"], rel=1e-5), (record, want)
        assert record["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (record, want)

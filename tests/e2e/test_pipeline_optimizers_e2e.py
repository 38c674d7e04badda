"""The offload optimizers per pipeline stage (swap, hybrid, gradient offload, the NVMe tier), fp32 masters and fp16
loss scaling under `parallel.pipeline.size=2`, end to end on 2 gloo processes (4 where a stage is data parallel).

Each layout trains its pipeline baseline once and every variant on it; a variant's loss and grad norm equal the
baseline's bit for bit at every step. The layouts: fp32 under 1F1B (the swap optimizer on device gradients, saving
a checkpoint that resumes bitwise; the hybrid one at fraction 0.5, each stage placing its own parameters), bf16
with fp32 masters under ZBV (two stages per rank; the swap optimizer with gradient offload and its states on
"NVMe", the hybrid one at fraction 1.0 with gradient offload: the zero-bubble weight pass's gradients bypass the
post-accumulate-grad hooks; red without `GradOffload.accumulate_grads` taking them), fp16 under 1F1B at a loss
scale that overflows (the hybrid one at fraction 0.5, host and device masters). The fp16 baseline follows one
process within 1e-5 with the same skipped steps (red with the grad norm not summed over the stages, and with the
masters accumulating once per step instead of per micro-batch: fp16 sums overflow at step 2); bf16 stages data
parallel over 2 ranks (DDP, FSDP2) match one process's first step within 1e-5 (red with FSDP2 computing in fp32).
"""

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from runner import REPO, metrics, train

pytestmark = pytest.mark.e2e

PP2 = REPO / "configs" / "internlm2_tiny_pp2.py"
# 8 steps of 4 micro-batches of 2 sequences (one rank per stage), no checkpoint unless a variant saves one
COMMON = ["data.total_steps=8", "data.global_bsz=8", "ckpt.enable_save_ckpt=False"]
BF16, FP16 = ["model.dtype=torch.bfloat16"], ["model.dtype=torch.float16"]
# fp16 from 2^20 backing off by 4 at once: steps 1 and 4 overflow (a gradient is inf), the others train
OVERFLOW = [
    "grad_scaler.fp16.initial_scale=1048576",
    "grad_scaler.max_scale=1e30",
    "grad_scaler.hysteresis=1",
    "grad_scaler.backoff_factor=0.25",
]
GRADS = ["grad_offload=True", "grad_offload_bucket_mb=0.01"]  # several buckets per stage's backward
SWAP = ["swap_optimizer=True", "swap_optimizer_times=4"]
HALF = ["hybrid_optimizer.enable=True", "hybrid_optimizer.offload_fraction=0.5"]
WHOLE = ["hybrid_optimizer.enable=True", "hybrid_optimizer.offload_fraction=1.0"]
SAVE_AT_4 = ["ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=4", "ckpt.keep_last=0"]
NVME = "nvme"  # stands for the options of the NVMe tier in the run's own folder

# name: (the layout's options, {variant: its options})
LAYOUTS: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "fp32_1f1b": ([], {"swap": [*SWAP, *SAVE_AT_4], "hybrid": HALF}),
    "bf16_zbv": (
        [*BF16, "parallel.pipeline.mode=ZBV"],
        {"swap_grads_nvme": [*SWAP, *GRADS, NVME], "hybrid_grads": [*WHOLE, *GRADS]},
    ),
    "fp16_1f1b": ([*FP16, *OVERFLOW], {"hybrid": HALF}),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """`runs(name)`: the layout's run folders by variant ("baseline" first), trained once per module."""
    trained: dict[str, dict[str, Path]] = {}

    def runs(name: str) -> dict[str, Path]:
        if name not in trained:
            trained[name] = train_layout(tmp_path_factory.mktemp(name), *LAYOUTS[name])
        return trained[name]

    return runs


def train_layout(root: Path, layout: list[str], variants: dict[str, list[str]]) -> dict[str, Path]:
    runs = {"baseline": root / "baseline"}
    train(runs["baseline"], *COMMON, *layout, nproc=2, config=PP2)
    for name, options in variants.items():
        runs[name] = root / name
        train(runs[name], *COMMON, *layout, *tier_options(runs[name], options), nproc=2, config=PP2)
    return runs


def tier_options(run: Path, options: list[str]) -> list[str]:
    """`options` with NVME replaced by the NVMe tier in a fresh folder beside `run`."""
    if NVME not in options:
        return options
    folder = run.with_name(f"{run.name}_nvme")
    folder.mkdir()
    nvme = ["nvme_offload.enable=True", f"nvme_offload.path={folder}"]
    return [option for option in options if option != NVME] + nvme


def one_process(reference: Callable[..., Path], layout: str) -> Path:
    """The layout's baseline on one process (no pipeline), trained once per pytest run."""
    options, _ = LAYOUTS[layout]
    return reference(*COMMON, *options, "parallel.pipeline.size=1", "parallel.pipeline.mode=1F1B", config=PP2)


def curve(run: Path) -> list[tuple[int, float, float]]:
    return [(record["step"], record["loss"], record["grad_norm"]) for record in metrics(run)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_offload_optimizer_trains_its_pipeline_baseline_bitwise(layouts, layout):
    """Loss and grad norm of every step equal the pipeline baseline's; gradient offload held host gradients, the
    NVMe tier left no file behind."""
    runs = layouts(layout)
    base = curve(runs["baseline"])
    assert [step for step, _, _ in base] == list(range(1, 9))
    for name, run in runs.items():
        assert curve(run) == base, name
        if "grads" in name:
            assert metrics(run)[-1]["grad_offload_host_bytes"] > 0, name
        if "nvme" in name:
            assert not list(run.with_name(f"{name}_nvme").iterdir())


def test_fp16_under_the_pipeline_follows_one_process(layouts, one_process_reference):
    """fp16 with fp32 masters at P=2 within 1e-5 of one process on the same batch, skipping the same steps (an
    overflow on any stage is seen by every stage: the grad norm is summed over the stages) at the same loss
    scales."""
    one = metrics(one_process(one_process_reference, "fp16_1f1b"))
    pipeline = metrics(layouts("fp16_1f1b")["baseline"])
    scales = [(r["step"], r["skipped"], r["loss_scale"]) for r in pipeline]
    assert scales == [(r["step"], r["skipped"], r["loss_scale"]) for r in one]
    assert [step for step, skipped, _ in scales if skipped] == [1, 4]
    for mine, theirs in zip(pipeline, one, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5), mine["step"]
        if mine["skipped"]:  # the overflowed norm, inf on every stage
            assert mine["grad_norm"] == theirs["grad_norm"] == float("inf"), mine["step"]
        else:
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4), mine["step"]


def test_the_swap_optimizer_resumes_bitwise_under_the_pipeline(layouts, tmp_path):
    """The fp32 swap run's step-4 checkpoint (each stage's parameters and host-resident AdamW states, by name)
    resumed on the same layout gives steps 5..8 bit for bit (red with the loaded second moments doubled)."""
    full = layouts("fp32_1f1b")["swap"]
    run = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "step_00000004", run / "checkpoints" / "step_00000004")
    train(run, *COMMON, *SWAP, *SAVE_AT_4, nproc=2, config=PP2, resume=True)
    assert curve(run) == curve(full)[4:]


@pytest.mark.parametrize(
    "mode, options, wrapper",
    [
        ("ddp", [*SWAP, *GRADS], "not wrapped: gradient offload reduces the gradients over 2 ranks each"),
        ("fsdp2", [*WHOLE, *GRADS], "FSDP2 over 2 ranks each"),
    ],
)
def test_a_data_parallel_stage_with_masters_follows_one_process(
    tmp_path, one_process_reference, mode, options, wrapper
):
    """bf16 with fp32 masters at P=2 x 2 data-parallel ranks per stage and an offload optimizer against one
    process: the first step's loss and grad norm within 1e-5 (the gradients of the micro-batches add up in fp32;
    computing in fp32 is 5e-5 off in the loss and 1.9e-4 in the norm), 8 steps' losses within 2e-4 (measured
    2.3e-5 under DDP, 1.2e-4 under FSDP2: bf16 weights rounded from masters summed in another order). Under DDP
    gradient offload averages the host gradients over the stage's 2 ranks (not the world's 4), under FSDP2 the
    stages compute in bf16 over fp32 shards. (ZBV's split backward at one rank per stage is 1.7e-4 off at step
    7 too, so bf16 is held bitwise against its pipeline baseline only.)"""
    one = metrics(one_process_reference(*COMMON, *BF16, "parallel.pipeline.size=1", config=PP2))
    run = tmp_path / mode
    proc = train(run, *COMMON, *BF16, f"parallel.mode={mode}", *options, nproc=4, config=PP2)
    assert f"stages [0] of 2 (Schedule1F1B), {wrapper}" in proc.stderr
    got = metrics(run)
    assert [r["step"] for r in got] == [r["step"] for r in one] == list(range(1, 9))
    assert got[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-5)
    assert got[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5)
    for mine, theirs in zip(got, one, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=2e-4), mine["step"]

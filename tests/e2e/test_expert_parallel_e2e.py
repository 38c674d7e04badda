"""Expert parallel under torchrun over gloo: the tiny MoE model's experts split over two ranks follow one process's
curve of the same global batch, the same run twice is bitwise, and its checkpoint resumes bitwise at EP=2 and
continues on one process and at EP=4 (one expert per rank); one process's checkpoint continues at EP=2; two expert
groups of two on four processes under DDP and under FSDP2 too. Nine torchrun launches and three single-process runs
(CI time)."""

import math
import shutil

import pytest
import torch
from runner import REPO, metrics, train
from tensor_parallel_runs import CALM, EXACT, NEAR, OFFLOAD, assert_curves

from internlm_offload.tools.export import load_weights
from internlm_offload.tools.export import main as export

pytestmark = pytest.mark.e2e
MOE = REPO / "configs" / "internlm2_tiny_moe.py"
# 8 steps of a global batch of 8 (micro-batch 2): one process runs 4 micro-batches a step, two ranks 2, four 1.
STEPS = ["data.total_steps=8", "ckpt.enable_save_ckpt=False", "data.global_bsz=8", "model.dtype=torch.float32"]
EP = ["parallel.mode=ddp", "parallel.expert.size=2"]
EP4 = ["parallel.mode=ddp", "parallel.expert.size=4"]
SAVE_AT_3 = ["ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=3", "ckpt.keep_last=0"]
GATHER = REPO / "tests" / "e2e" / "gather_weights.py"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("ep") / "one_process"
    train(run, *STEPS, *CALM, *SAVE_AT_3, config=MOE)  # its step-3 checkpoint continues at EP=2 (saving moves no bit)
    return run


def test_ep_2_follows_one_process_and_repeats_bitwise(tmp_path, one_process):
    """fp32, 2 of the 4 experts per rank (DDP for the rest): loss within 1e-5 and grad norm within 1e-4 of one
    process for 8 steps (the expert gradients averaged as DDP averages the others, the norm summed over both
    ranks' experts); the same run again with activation offload, checkpointing, gradient offload and the swap
    optimizer with its states on NVMe bitwise (its first 4 steps). The checkpoints move between expert layouts: EP=2's at EP=2, 1 and 4,
    one process's at EP=2. Red with each EP=4 rank's expert read from the next rank's slice of the checkpoint
    (step 4's loss 4.7e-4 off), and with each EP=2 rank's two experts read that way from one process's checkpoint
    (6.5e-4)."""
    first, second = tmp_path / "ep2", tmp_path / "ep2_again"
    proc = train(first, *STEPS, *CALM, *EP, *SAVE_AT_3, config=MOE, nproc=2)
    assert "Applied expert parallel over 2 ranks (1 expert-data groups): 4 sparse blocks, 2 of 4 experts" in proc.stderr
    assert_curves(one_process, first, NEAR)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    swap = ["swap_optimizer=True", "grad_offload=True", "nvme_offload.enable=True", f"nvme_offload.path={nvme}"]
    # activation offload of a block (the dispatched rows among what it saves), checkpointing of others, gradient
    # offload (the experts' reduced over their own group) and the swap optimizer with its states in files; a bitwise
    # twin runs the first 4 steps of the same schedule (the tensor-parallel files' convention, CI time)
    first_4 = ["data.total_steps=4", "lr_scheduler.total_steps=8"]  # the later total_steps wins
    train(second, *STEPS, *CALM, *EP, *OFFLOAD, *swap, *first_4, config=MOE, nproc=2)
    assert [r["step"] for r in metrics(second)] == [1, 2, 3, 4]
    assert_curves(first, second, {name: [*flags, "--steps", ":4"] for name, flags in EXACT.items()})
    # the EP=2 run's step-3 checkpoint on its own layout, on one process (every expert on the rank) and at EP=4
    # (four processes, one expert per rank); one process's checkpoint at EP=2
    for source, name, layout, nproc in (
        (first, "same", EP, 2),
        (first, "ep2_to_one_process", [], 1),
        (first, "ep2_to_ep4", EP4, 4),
        (one_process, "one_process_to_ep2", EP, 2),
    ):
        proc = _continue_at(tmp_path / name, source, layout, nproc, exact=name == "same")
        if layout == EP4:
            assert "Applied expert parallel over 4 ranks (1 expert-data groups): 4 sparse blocks, 1 of 4" in proc.stderr
            move = "saved on 2 ranks (data 2, expert 2), loading on 4 ranks (data 4, expert 4); parameters and"
            assert f"Checkpoint step_00000003: {move}" in proc.stderr
    _exports_every_expert(first / "checkpoints" / "step_00000003", tmp_path)


def _exports_every_expert(checkpoint, tmp_path) -> None:
    """`tools.export` of an EP=2 checkpoint: the safetensors file holds each block's expert stacks whole (4 experts),
    and InternEvo's layout (its grouped experts: one file a sparse block) holds them all too, as from one process's
    checkpoint (DCP saved each stack under the whole model's name). This GShard model (a softmax-gated shared
    expert) has no transformers architecture, so no `--hf`."""
    from safetensors.torch import load_file

    assert export([str(checkpoint), str(tmp_path / "weights.safetensors")]) == 0
    assert export([str(checkpoint), str(tmp_path / "internevo"), "--internevo"]) == 0
    stacks = {k: t.shape[0] for k, t in load_file(tmp_path / "weights.safetensors").items() if ".experts." in k}
    assert len(stacks) == 4 * 3 and set(stacks.values()) == {4}
    for layer in range(4):
        grouped = torch.load(tmp_path / "internevo" / f"model_moe_layer{layer}_expert0_tp0.pt", weights_only=True)
        assert grouped and all(t.shape[0] == 4 for t in grouped.values())


def _continue_at(run, source, layout, nproc, *, exact):
    """`source`'s step-3 checkpoint resumed on `layout`: steps 4..8 are `source`'s own bit for bit (`exact`, its
    own layout) or within 1e-5 (loss) and 1e-4 (grad norm) where the experts and the optimizer's groups are
    regrouped; the ranks hold, gathered, the checkpoint's full tensors as `tools.export` reads them."""
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(source) if r["step"] > 3]
    checkpoint = source / "checkpoints" / "step_00000003"
    shutil.copytree(checkpoint, run / "checkpoints" / "step_00000003")
    gathered = run / "gathered.pt"
    env = {"GATHERED_WEIGHTS": str(gathered)}
    proc = train(run, *STEPS, *CALM, *layout, config=MOE, nproc=nproc, resume=True, script=GATHER, env=env)
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(run)]
    if exact:
        assert got == expected
    else:
        assert [step for step, *_ in got] == [4, 5, 6, 7, 8]
        for (step, loss, norm), (_, want_loss, want_norm) in zip(got, expected):
            assert loss == pytest.approx(want_loss, rel=1e-5), (run.name, step)
            assert norm == pytest.approx(want_norm, rel=1e-4), (run.name, step)
    exported = load_weights(checkpoint)
    weights = {key.removeprefix("module."): value for key, value in torch.load(gathered).items()}  # DDP's
    assert weights.keys() == exported.keys()
    assert all(torch.equal(weights[key], value) for key, value in exported.items()), run.name
    return proc


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_ep_2_by_expert_data_2_follows_one_process(tmp_path, one_process, mode):
    """Four processes: expert groups {0, 1} and {2, 3}, ranks 0 and 2 (1 and 3) holding the same experts. DDP sums
    their gradients over that expert-data pair, the rest over all four. FSDP2 shards them over it (one expert of a
    block per rank; expert weight 2, the whole pair) and reduce-scatters there, the rest under isp's weight groups
    of 2 (HSDP: sharded over pairs, replicated across them; the qwen3 layout's test in test_internevo_moe_e2e.py
    shards the rest over all four): one process's curve within the same bars either way."""
    run = tmp_path / f"ep2_edp2_{mode}"
    isp = ["parallel.tensor.mode=isp", "parallel.weight.size=2", "parallel.expert_weight.size=2"]
    layout = ["parallel.expert.size=2", f"parallel.mode={mode}", *(isp if mode == "fsdp2" else [])]
    proc = train(run, *STEPS, *CALM, *layout, config=MOE, nproc=4)
    assert "Applied expert parallel over 2 ranks (2 expert-data groups)" in proc.stderr
    if mode == "fsdp2":
        assert "Applied FSDP2 to the experts over 2 expert-data ranks (w1 here: (1, 128, 128))" in proc.stderr
        assert "Applied FSDP2 over 4 ranks (shards over 2, 2 replicas): 4 blocks + root" in proc.stderr
    assert_curves(one_process, run, NEAR)


def test_bf16_with_fp32_masters_under_ep_2_follows_one_process(tmp_path):
    """bf16 compute with fp32 masters: the masters' gradient buffer reduces the experts apart (summed over their
    expert-data group, divided by the data-parallel size) and the rest over all ranks. 8 steps follow one
    process's bf16 curve within 1e-4 (loss) and the first step's grad norm within 1e-4: measured 1.4e-5 and 0
    (later norms drift to 2e-3: bf16 rounding of expert batches grouped differently). Reducing the experts with
    the rest, as before, is off by 4.3e-4 at step 2 and 5.8e-4 in the first grad norm. The hybrid optimizer stepping
    half the masters on the host is bitwise this run."""
    bf16 = [step for step in STEPS if not step.startswith("model.dtype")] + ["model.dtype=torch.bfloat16", *CALM]
    train(tmp_path / "one", *bf16, config=MOE)
    train(tmp_path / "ep2", *bf16, *EP, config=MOE, nproc=2)
    hybrid = ["hybrid_optimizer.enable=True", "hybrid_optimizer.offload_fraction=0.5"]
    train(tmp_path / "ep2_hybrid", *bf16, *EP, *hybrid, config=MOE, nproc=2)
    assert_curves(tmp_path / "ep2", tmp_path / "ep2_hybrid", EXACT)  # half the masters stepped on the host
    reference, got = metrics(tmp_path / "one"), metrics(tmp_path / "ep2")
    assert [r["step"] for r in got] == [r["step"] for r in reference] == list(range(1, 9))
    for mine, theirs in zip(got, reference):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4), (mine["step"], mine["loss"], theirs["loss"])
    assert got[0]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-4)


def test_fp16_loss_scaling_under_ep_2_skips_overflows_on_every_rank(tmp_path):
    """fp16 with fp32 masters and the loss scaler at EP=2, from a scale of 2^20 backing off by 4 at once: the
    overflowed steps (1 and 2: an expert's gradient sums the rows of both ranks, so it overflows where one process's
    does not at step 2) are skipped with an infinite norm and the scale backed off to 2^16, where steps 3 and 4
    train finite (measured: one process from the same scale skips steps 1 and 4 instead). Red before the loss scale
    was removed per mesh (the experts' DTensor gradients beside the plain ones: `_foreach_mul_` refused the mix,
    the run failed at step 1)."""
    overflow = [
        "model.dtype=torch.float16",
        "grad_scaler.fp16.initial_scale=1048576",
        "grad_scaler.max_scale=1e30",
        "grad_scaler.hysteresis=1",
        "grad_scaler.backoff_factor=0.25",
    ]
    kept = [step for step in STEPS if not step.startswith(("model.dtype", "data.total_steps"))]
    fp16 = [*kept, "data.total_steps=4", *CALM, *overflow]  # fp16's matmuls are slow on cpu: 4 steps
    train(tmp_path / "ep2", *fp16, *EP, config=MOE, nproc=2)
    records = metrics(tmp_path / "ep2")
    scales = [(r["step"], r["skipped"], r["loss_scale"]) for r in records]
    assert scales == [(1, True, 2.0**20), (2, True, 2.0**18), (3, False, 2.0**16), (4, False, 2.0**16)]
    assert all(r["grad_norm"] == float("inf") for r in records[:2])
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records[2:])

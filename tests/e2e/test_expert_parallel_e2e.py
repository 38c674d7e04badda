"""Expert parallel under torchrun over gloo: the tiny MoE model's experts split over two ranks follow one process's
curve of the same global batch, the same run twice is bitwise, and its checkpoint resumes bitwise at EP=2 and
continues on one process; two expert groups of two on four processes under DDP and under FSDP2 too. Five torchrun
launches and two single-process runs (CI time)."""

import shutil

import pytest
import torch
from runner import REPO, metrics, train
from tensor_parallel_runs import CALM, EXACT, NEAR, OFFLOAD, assert_curves

from internlm_offload.tools.export import load_weights

pytestmark = pytest.mark.e2e
MOE = REPO / "configs" / "internlm2_tiny_moe.py"
# 8 steps of a global batch of 8 (micro-batch 2): one process runs 4 micro-batches a step, two ranks 2, four 1.
STEPS = ["data.total_steps=8", "ckpt.enable_save_ckpt=False", "data.global_bsz=8", "model.dtype=torch.float32"]
EP = ["parallel.mode=ddp", "parallel.expert.size=2"]
SAVE_AT_3 = ["ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=3", "ckpt.keep_last=0"]
GATHER = REPO / "tests" / "e2e" / "gather_weights.py"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("ep") / "one_process"
    train(run, *STEPS, *CALM, config=MOE)
    return run


def test_ep_2_follows_one_process_and_repeats_bitwise(tmp_path, one_process):
    """fp32, 2 of the 4 experts per rank (DDP for the rest): loss within 1e-5 and grad norm within 1e-4 of one
    process for 8 steps (the expert gradients averaged as DDP averages the others, the norm summed over both
    ranks' experts); the same run again with activation offload, checkpointing, gradient offload and the swap
    optimizer with its states on NVMe bitwise."""
    first, second = tmp_path / "ep2", tmp_path / "ep2_again"
    proc = train(first, *STEPS, *CALM, *EP, *SAVE_AT_3, config=MOE, nproc=2)
    assert "Applied expert parallel over 2 ranks (1 expert-data groups): 4 sparse blocks, 2 of 4 experts" in proc.stderr
    assert_curves(one_process, first, NEAR)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    swap = ["swap_optimizer=True", "grad_offload=True", "nvme_offload.enable=True", f"nvme_offload.path={nvme}"]
    # activation offload of a block (the dispatched rows among what it saves), checkpointing of others, gradient
    # offload (the experts' reduced over their own group) and the swap optimizer with its states in files
    train(second, *STEPS, *CALM, *EP, *OFFLOAD, *swap, config=MOE, nproc=2)
    assert_curves(first, second, EXACT)
    _resume_on_each_layout(tmp_path, first)


def _resume_on_each_layout(tmp_path, full) -> None:
    """The EP=2 run's step-3 checkpoint: resumed at EP=2, steps 4..8 are the full run's bitwise; on one process
    (every expert on the rank, the optimizer's groups regrouped) it continues within 1e-5 (loss) and 1e-4 (grad
    norm). Both hold, gathered, the checkpoint's full tensors as `tools.export` reads them."""
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(full) if r["step"] > 3]
    checkpoint = full / "checkpoints" / "step_00000003"
    exported = load_weights(checkpoint)
    for name, layout, nproc in (("same", EP, 2), ("one_process", [], 1)):
        run, gathered = tmp_path / name, tmp_path / f"{name}.pt"
        shutil.copytree(checkpoint, run / "checkpoints" / "step_00000003")
        env = {"GATHERED_WEIGHTS": str(gathered)}
        train(run, *STEPS, *CALM, *layout, config=MOE, nproc=nproc, resume=True, script=GATHER, env=env)
        got = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(run)]
        if name == "same":
            assert got == expected
        else:
            assert [step for step, *_ in got] == [4, 5, 6, 7, 8]
            for (_, loss, norm), (_, want_loss, want_norm) in zip(got, expected):
                assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-4)
        weights = {key.removeprefix("module."): value for key, value in torch.load(gathered).items()}  # DDP's
        assert weights.keys() == exported.keys()
        assert all(torch.equal(weights[key], value) for key, value in exported.items()), name


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

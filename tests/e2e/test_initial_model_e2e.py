"""One initial model for every parallel mode: one process, DDP, FSDP2 with and without its meta build, and FSDP2
over tensor parallel start from the same weights, bit for bit, under the same seed (item 7 of issue 32).

Each run trains one step through tests/e2e/gather_weights.py, which writes the weights the run holds before its
first step, gathered from the shards: those are compared with the one-process build's by `torch.equal`, and the
step-1 losses (forward only: the initial weights and the forward's reductions) by float equality. A global batch of
two micro-batches keeps that a same-shape claim on any CPU (tests/README.md): each micro-batch's matmuls are the
same on one process and on a rank, and the two micro-batch losses meet in one addition either way (with four, one
process sums ((l0 + l1) + l2) + l3 and two ranks (l0 + l2) + (l1 + l3): 2 ulp apart under MKL_CBWR=COMPATIBLE).
"""

import pytest
import torch
from runner import REPO, metrics, train

pytestmark = pytest.mark.e2e

GATHER = REPO / "tests" / "e2e" / "gather_weights.py"
ONE_STEP = ["data.total_steps=1", "data.global_bsz=4", "ckpt.enable_save_ckpt=False"]
META = "Materialized and initialized this rank's shards"


def run(tmp_path, name: str, *options: str, nproc: int) -> tuple[dict[str, torch.Tensor], float, str]:
    """(the gathered initial weights, the step-1 loss, the log) of a one-step run."""
    work_dir, weights = tmp_path / name, tmp_path / f"{name}.pt"
    proc = train(work_dir, *ONE_STEP, *options, nproc=nproc, script=GATHER, env={"GATHERED_WEIGHTS": str(weights)})
    (record,) = metrics(work_dir)
    gathered = {key.removeprefix("module."): tensor for key, tensor in torch.load(weights).items()}  # DDP's wrapper
    return gathered, record["loss"], proc.stderr


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], name: str) -> None:
    assert got.keys() == expected.keys(), (name, got.keys() ^ expected.keys())
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), f"{name}: {key} differs from the one-process build"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run(tmp_path_factory.mktemp("one_process"), "none", "parallel.mode=none", nproc=1)


def test_data_parallel_modes_start_from_the_one_process_model(one_process, tmp_path):
    """DDP and FSDP2 (meta build, also with the shards on the host, or whole) on 2 processes: the one-process
    weights and step-1 loss, bitwise."""
    weights, loss, _ = one_process
    runs = {
        "fsdp2_meta": ["parallel.mode=fsdp2", "parallel.meta_init=True"],
        "fsdp2_meta_params_on_host": ["parallel.mode=fsdp2", "parallel.fsdp_cpu_offload=True"],
        "fsdp2_whole": ["parallel.mode=fsdp2", "parallel.meta_init=False"],
        "ddp": ["parallel.mode=ddp"],
    }
    for name, options in runs.items():
        got, got_loss, log = run(tmp_path, name, *options, nproc=2)
        assert (META in log) == name.startswith("fsdp2_meta"), name
        assert_same_weights(got, weights, name)
        assert got_loss == loss, (name, got_loss, loss)


def test_fsdp2_over_tensor_parallel_starts_from_the_one_process_model(one_process, tmp_path):
    """(dp 2, tp 2) msp under FSDP2, meta build or whole: the one-process weights, and one step-1 loss.

    The row-parallel projections sum their partial outputs over the tensor group, another order than one
    process's matmul: the step-1 loss is compared bitwise between the two builds, the weights with one process."""
    weights, _, _ = one_process
    layout = ["parallel.mode=fsdp2", "parallel.tensor.size=2", "parallel.tensor.mode=msp"]
    losses = {}
    for meta in (True, False):
        name = f"msp_meta_{meta}"
        got, losses[meta], log = run(tmp_path, name, *layout, f"parallel.meta_init={meta}", nproc=4)
        assert (META in log) == meta, name  # the meta build runs under tensor parallel too
        assert_same_weights(got, weights, name)
    assert losses[True] == losses[False], losses

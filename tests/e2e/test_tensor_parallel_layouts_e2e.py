"""Tensor parallel across layouts under torchrun over gloo: tensor groups beside data-parallel ranks (FSDP2 2-D,
isp with weight parallel), checkpoints resumed on other layouts, the modes' memory, InternEvo's section as
shipped. (Apart from test_tensor_parallel_e2e.py so that pytest-xdist's per-file distribution runs them beside it.)"""

import shutil
import sys

import pytest
import torch
from runner import REPO, metrics, run_python, train
from safetensors.torch import load_file
from tensor_parallel_runs import CALM, EXACT, NEAR, OFFLOAD, assert_curves, tensor

from internlm_offload.tools.export import load_weights

pytestmark = pytest.mark.e2e
GATHER = REPO / "tests" / "e2e" / "gather_weights.py"


# Four processes, 8 steps, two data-parallel ranks of micro-batch 2 x 2: one process's curve of the same global
# batch (micro-batch 2 x 4) is each 2-D layout's reference; test_train_e2e.py holds DDP and FSDP2 on two ranks
# to it.
LAYOUT_STEPS = ["data.total_steps=8", "ckpt.enable_save_ckpt=False", "data.global_bsz=8", *CALM]
# A feature's bitwise twin of a layout's run runs its first 4 steps (the same schedule): a feature that changes bits
# does so within them (the swap optimizer's gradients scaled by 1 + 2^-7: from step 3's grad norm, AdamW's first
# update barely sees a scale), and four processes on CI's two cores make each step dear (CI time)
FIRST_4 = ["data.total_steps=4", "lr_scheduler.total_steps=8"]
FIRST_4_EXACT = {name: [*flags, "--steps", ":4"] for name, flags in EXACT.items()}


def test_isp_2_by_weight_2_follows_data_parallel(tmp_path, one_process_reference):
    """Four processes, isp over pairs of ranks with FSDP2 sharding the weights over pairs and replicating
    across them (InternEvo's weight parallel): the data-parallel curve (one process's) within 1e-5 for 8
    steps; with offload, swap and gradient offload bitwise its own (its first 4 steps)."""
    isp, offloaded = tmp_path / "isp2_w2", tmp_path / "offloaded"
    layout = ["parallel.tensor.size=2", "parallel.tensor.mode=isp", "parallel.weight.size=2", "parallel.mode=fsdp2"]
    proc = train(isp, *LAYOUT_STEPS, *layout, nproc=4)
    assert "Applied FSDP2 over 4 ranks (shards over 2, 2 replicas)" in proc.stderr
    assert_curves(one_process_reference(*LAYOUT_STEPS), isp, NEAR)
    train(offloaded, *LAYOUT_STEPS, *FIRST_4, *layout, *OFFLOAD, "swap_optimizer=True", "grad_offload=True", nproc=4)
    assert_curves(isp, offloaded, FIRST_4_EXACT)


# The (dp 2, tp 2) msp run under FSDP2 that two tests below read: its curve and its checkpoint of step 3.
DP2_TP2 = [*tensor("msp"), "parallel.mode=fsdp2"]
DP2_TP2_SAVED = ["data.total_steps=8", "data.global_bsz=8", *CALM, "ckpt.checkpoint_every=3", "ckpt.keep_last=0"]


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory):
    """Four processes, (dp 2, tp 2) msp under FSDP2, 8 steps with checkpoints at 3 and 6 (launched once for the
    curve test and the resume test)."""
    run = tmp_path_factory.mktemp("dp2_tp2") / "run"
    train(run, *DP2_TP2_SAVED, *DP2_TP2, nproc=4)
    return run


def internevo_config(folder, mode: str, weight: int):
    """The tiny config with a parallel section written as InternEvo's configs ship it (zero1, tensor, pipeline 1,
    weight with its overlap flags, sequence_2D off) and a cpu_offloading block (one block offloaded, as OFFLOAD)."""
    config = folder / f"internevo_{mode}.py"
    base = (REPO / "configs" / "internlm2_tiny.py").read_text().replace('"./_base_/', f'"{REPO}/configs/_base_/')
    config.write_text(
        base
        + """
parallel = dict(
    _delete_=True,
    zero1=dict(size=-1),
    tensor=dict(size=2, mode="MODE"),
    pipeline=dict(size=1, interleaved_overlap=True),
    weight=dict(size=WEIGHT, overlap=True, memory_pool=True, launch_allgather_before="wo", forward_overlap_per="layer"),
    sequence_2D=dict(enable=False, head_size=2, context_size=1, window_size=1, device_placement_strategy=dict(
        head_first=True, interleaved=False)),
)
cpu_offloading = dict(enable=True, num_layers=1)
""".replace("MODE", mode).replace("WEIGHT", str(weight))
    )
    return config


@pytest.fixture(scope="module")
def internevo_offloaded(tmp_path_factory):
    """(run, log): the (dp 2, tp 2) msp layout under FSDP2 with offload, swap and gradient offload, its parallel
    section and cpu_offloading block written as InternEvo ships them (`internevo_config`), 8 steps on four
    processes: one run for the bitwise test and the as-shipped test below (CI time)."""
    folder = tmp_path_factory.mktemp("internevo_offloaded")
    options = [*LAYOUT_STEPS, "model.checkpoint=0.75", "swap_optimizer=True", "grad_offload=True"]  # OFFLOAD's rest
    proc = train(folder / "run", *options, nproc=4, config=internevo_config(folder, "msp", 1))
    return folder / "run", proc.stderr


def test_tensor_2_by_data_2_under_fsdp2_follows_data_parallel(
    tmp_path, one_process_reference, dp2_tp2, internevo_offloaded
):
    """Four processes, a (dp 2, tp 2) mesh, FSDP2 over dp: the data-parallel curve (one process's) within
    1e-5 for 8 steps; with offload, swap and gradient offload bitwise its own (that run's layout and offload
    written in InternEvo's sections), and with FSDP2's CPU offload policy (parameter offload, its first 4 steps)."""
    options = [*LAYOUT_STEPS, "parallel.mode=fsdp2"]
    both, (offloaded, _) = dp2_tp2, internevo_offloaded
    assert_curves(one_process_reference(*LAYOUT_STEPS), both, NEAR)
    assert_curves(both, offloaded)
    policy = tmp_path / "params_on_host"  # FSDP2's CPU offload policy over the 2-D shards
    proc = train(policy, *options, *FIRST_4, *tensor("msp"), "parallel.fsdp_cpu_offload=True", nproc=4)
    assert "with CPU offload policy" in proc.stderr
    assert_curves(both, policy, FIRST_4_EXACT)


def test_checkpoint_resumes_bitwise_and_continues_on_another_layout(tmp_path, dp2_tp2):
    """A (dp 2, tp 2) checkpoint of step 3: resumed on the same layout steps 4..8 are the full run's; on one
    process and on T=2 alone (DCP reshards the DTensors) it continues within 1e-5. The weights the resumed runs
    hold, gathered from their shards, equal the checkpoint's full tensors as `tools.export` reads them, as a
    one-process model-only load (`load_ckpt_info`) holds them, and as the HF export writes them."""
    options, layout, full = DP2_TP2_SAVED, DP2_TP2, dp2_tp2
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(full) if r["step"] > 3]
    checkpoint = full / "checkpoints" / "step_00000003"
    resumes = {
        "same": (layout, 4),
        "one_process": ([], 1),
        "tensor_only": ([*tensor("mtp")], 2),
    }
    gathered = {}
    for name, (other, nproc) in resumes.items():
        run = tmp_path / name
        shutil.copytree(checkpoint, run / "checkpoints" / "step_00000003")
        gathered[name] = tmp_path / f"{name}.pt"
        env = {"GATHERED_WEIGHTS": str(gathered[name])}
        train(run, *options, *other, nproc=nproc, resume=True, script=GATHER, env=env)
        got = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(run)]
        if name == "same":
            assert got == expected
        else:
            assert [s for s, *_ in got] == [4, 5, 6, 7, 8]
            for (_, loss, norm), (_, want_loss, want_norm) in zip(got, expected):
                assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=5e-3)
    model_only = tmp_path / "model_only.pt"
    info = f"ckpt.load_ckpt_info.path={checkpoint}"  # content ("model",), this trainer's checkpoint
    train(tmp_path / "load", "data.total_steps=1", info, script=GATHER, env={"GATHERED_WEIGHTS": str(model_only)})
    exported = load_weights(checkpoint)  # the full tensors DCP reassembles in one process
    for path in [*gathered.values(), model_only]:
        weights = torch.load(path)
        assert weights.keys() == exported.keys(), path
        for key, value in exported.items():
            assert torch.equal(weights[key], value), (path.name, key)
    proc = run_python(
        [sys.executable, "-m", "internlm_offload.tools.export", str(checkpoint), str(tmp_path / "hf"), "--hf"]
    )
    assert proc.returncode == 0, proc.stderr
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    # the vocab-parallel embedding (259 rows over 2 ranks: uneven shards) and head, as the run held them
    assert torch.equal(hf["model.embed_tokens.weight"], exported["tok_embeddings.weight"])
    assert torch.equal(hf["lm_head.weight"], exported["output.weight"])


def test_fsp_keeps_less_than_msp_and_msp_less_than_mtp(tmp_path):
    """Longer sequences, one micro-batch: the measured device peaks order as InternEvo's modes promise
    (msp shards the activations between the projections, fsp also drops the gathered inputs)."""
    # 2 steps: the second is the steady one (the first creates the optimizer states); a third peaked within 0.8 % of
    # it, the modes 8 % and more apart (CI time)
    options = ["data.total_steps=2", "ckpt.enable_save_ckpt=False", "data.seq_len=1024", "model.hidden_size=256"]
    options.append("data.micro_num=1")
    peaks = {}
    for mode in ("mtp", "msp", "fsp"):
        run = tmp_path / mode
        train(run, *options, *tensor(mode), nproc=2)
        peaks[mode] = metrics(run)[1]["device_peak_mem_bytes"]
    assert peaks["fsp"] < peaks["msp"] < peaks["mtp"], peaks


# isp with weight parallel as shipped: InternEvo's own 7B_isp_sft (shrunk) in tests/e2e/test_internevo_e2e.py
def test_internevo_parallel_section_trains_as_shipped(internevo_offloaded):
    """A parallel section written as InternEvo's configs ship it (zero1, tensor, pipeline 1, weight with its
    overlap flags, sequence_2D off) and a cpu_offloading block, on four processes with size-only changes: msp
    takes FSDP2 over the data-parallel dim (the run the test above holds to the native config's, bitwise)."""
    run, log = internevo_offloaded
    assert "Applied tensor parallel msp over 2 ranks" in log and "Applied FSDP2 over 2 ranks" in log
    assert "Applied async activation offload to 1 of 4 blocks" in log
    assert len(metrics(run)) == 8

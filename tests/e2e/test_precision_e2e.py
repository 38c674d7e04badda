"""Mixed precision, the non-finite guard and model-only loads, end to end through train.py."""

import os
import shutil
import signal
import sys
import time

import pytest
import torch
from runner import REPO, baseline_options, metrics, python, spawn_python, train, train_argv
from test_offload_e2e import SHARED_CONFIGS, loss_compare, offload_configs

pytestmark = pytest.mark.e2e

TINY = REPO / "configs" / "internlm2_tiny.py"
NO_CKPT = "ckpt.enable_save_ckpt=False"
TENSOR_MSP = ["parallel.tensor.size=2", "parallel.tensor.mode=msp"]


def tail_mean(work_dir, n=10):
    records = metrics(work_dir)
    return sum(r["loss"] for r in records[-n:]) / n


def test_bf16_with_master_weights_tracks_fp32_at_a_fine_tuning_lr(tmp_path):
    """The tiny config (its own batch shape), 60 steps at lr 2e-4: masters keep the small updates.

    Pure bf16 (no masters) was 0.018 off on this run, bf16 with masters 0.001.
    """
    options = ["data.total_steps=60", "adam.lr=2e-4", NO_CKPT, "data.seq_len=128", "data.micro_bsz=4"]
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    train(fp32, *options, config=TINY)
    proc = train(bf16, *options, "model.dtype=torch.bfloat16", config=TINY)
    assert "bfloat16 compute, fp32 master weights" in proc.stderr
    assert abs(tail_mean(bf16) - tail_mean(fp32)) < 0.015, (tail_mean(bf16), tail_mean(fp32))


# 30 fp32 steps on one process, trained once per pytest run: the fp16 test's reference and a model-only load's source
FP32_30 = ["data.total_steps=30", "parallel.mode=none", "model.dtype=torch.float32"]


def test_fp16_trains_finite_and_close_to_fp32_with_loss_scaling(tmp_path, reference_run):
    fp32, fp16 = reference_run(*FP32_30), tmp_path / "fp16"
    train(fp16, "data.total_steps=30", NO_CKPT, "model.dtype=torch.float16")
    records = metrics(fp16)
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < 100 for r in records)
    assert records[0]["loss_scale"] == 2.0**16
    assert abs(tail_mean(fp16) - tail_mean(fp32)) < 0.02, (tail_mean(fp16), tail_mean(fp32))


@pytest.mark.parametrize("layout, nproc", [([], 1), (TENSOR_MSP, 2)], ids=["one-process", "msp-2"])
def test_fp16_overflow_is_skipped_and_the_scale_backs_off(tmp_path, layout, nproc):
    """A scale of 2^30 overflows fp16 grads: steps are skipped until hysteresis and back-offs bring it down. Under
    msp at T=2 each rank sees its shards' gradients: the non-finite check agrees over the ranks (or they would
    part ways, one stepping and one not, and hang). 18 steps: the 13 overflows, step 14 the first update, step 15
    one more back-off (CI time: 24 steps added only updates)."""
    options = [
        "data.total_steps=18",
        NO_CKPT,
        "model.dtype=torch.float16",
        f"grad_scaler.fp16.initial_scale={2**30}",
        f"grad_scaler.max_scale={2**30}",
        *layout,
    ]
    train(tmp_path, *options, nproc=nproc)
    records = metrics(tmp_path)
    assert records[0]["skipped"] and records[1]["skipped"]
    assert records[0]["loss_scale"] == records[1]["loss_scale"] == 2**30  # hysteresis=2: first back-off after 2
    assert records[2]["loss_scale"] == 2**29
    good = [r for r in records if not r["skipped"]]
    assert good and all(r["grad_norm"] == r["grad_norm"] for r in good)
    assert records[-1]["skipped_steps"] == sum(r["skipped"] for r in records) > 2
    first_good = good[0]["step"]
    assert records[first_good - 1]["lr"] == records[0]["lr"]  # the schedule waits for the first update


@pytest.mark.parametrize("mode", ["none", "ddp", "fsdp2"])
def test_bf16_offload_configs_align_bitwise_with_the_bf16_baseline(tmp_path, baseline, reference_run, mode):
    """Each offload config in bf16 against the suite's shared bf16 baseline of `mode` (conftest.py)."""
    nproc = 1 if mode == "none" else 2
    options = [*baseline_options(mode, "torch.bfloat16"), NO_CKPT]
    base = baseline(mode, "torch.bfloat16")
    for name in offload_configs(mode):
        config = REPO / "configs" / name
        if name in SHARED_CONFIGS:  # trained once per pytest run, resumed below and in test_memory_tiers_e2e.py
            run = reference_run(*baseline_options(mode, "torch.bfloat16"), nproc=nproc, config=config)
        else:
            run = tmp_path / name
            train(run, *options, nproc=nproc, config=config)
        record = metrics(run)[-1]
        if "swap" in name or "all" in name:  # the fp32 masters live on the host with the states (not under FSDP2)
            assert record["optim_device_state_bytes"] == 0
            assert ("optim_host_param_bytes" in record) == (mode != "fsdp2")
            if mode != "fsdp2":
                assert 0 < 2 * record["optim_host_param_bytes"] <= record["optim_host_state_bytes"]
        for metric in ("loss", "grad_norm"):
            compared = loss_compare(str(base), str(run), "--exact", "--quiet", "--metric", metric)
            assert compared.returncode == 0, (name, metric, compared.stdout)


def _spawn(work_dir, *options, resume=False):
    """train.py started in the background (its stderr beside `work_dir`, as `<name>.stderr`)."""
    argv = train_argv(work_dir, *options, resume=resume)  # FAST: no preflight trace (CI time)
    return spawn_python([sys.executable, str(REPO / "train.py"), *argv], work_dir)


@pytest.mark.parametrize(
    "dtype, offload",
    [
        ("torch.float16", []),  # fp32 masters and the loss scaler's state
        ("torch.bfloat16", ["swap_optimizer=True", "grad_offload=True"]),  # host masters, states and gradients
        ("torch.bfloat16", ["swap_optimizer=True", "nvme_offload.enable=True", "nvme_offload.path={nvme}"]),
        ("torch.bfloat16", ["parallel.mode=fsdp2", "parallel.fsdp_cpu_offload=True"]),  # params on the host
    ],
    ids=["fp16", "bf16-swap-grad-offload", "bf16-nvme", "bf16-fsdp-cpu-offload"],
)
def test_kill_9_and_resume_is_bitwise_in_low_precision(tmp_path, dtype, offload):
    """SIGKILL mid-run, `--resume` from the last checkpoint: every step equals the uninterrupted run's (the
    NVMe tier's file dies with the process: the states come back from the DCP checkpoint)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    offload = [option.format(nvme=nvme) for option in offload]
    # 12 steps, as the rank killed under torchrun in test_checkpoint_failures_e2e.py: killed once step 6's
    # checkpoint is written, resumed from it or a later one, every step compared
    options = ["data.total_steps=12", "ckpt.checkpoint_every=3", "ckpt.keep_last=0", f"model.dtype={dtype}", *offload]
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert _spawn(full, *options).wait(timeout=600) == 0
    proc = _spawn(killed, *options)
    deadline = time.monotonic() + 300
    while not (killed / "checkpoints" / "step_00000006").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_before = len(metrics(killed))
    assert 6 <= steps_before < 12
    assert _spawn(killed, *options, resume=True).wait(timeout=600) == 0
    expected = [(r["step"], r["loss"], r["grad_norm"], r["lr"], r.get("loss_scale")) for r in metrics(full)]
    got = [(r["step"], r["loss"], r["grad_norm"], r["lr"], r.get("loss_scale")) for r in metrics(killed)]
    assert got == expected


def _dcp_weights(step_dir):
    """The fp32 weights a checkpoint holds, read back with DCP's own format utility."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    return torch.load(out, weights_only=True)["model"]


def test_diverging_run_stops_with_one_line_and_keeps_only_finite_checkpoints(tmp_path):
    proc = train(
        tmp_path, "adam.lr=1000", "data.total_steps=40", "ckpt.checkpoint_every=1", "max_skipped_steps=5", check=False
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "5 consecutive steps with a non-finite" in error_lines[0]
    assert "Traceback" not in proc.stderr
    records = metrics(tmp_path)
    assert len(records) < 40 and records[-1]["skipped"]
    folder = tmp_path / "checkpoints"
    saved = sorted(p.name for p in folder.glob("step_*"))
    skipped_steps = {r["step"] for r in records if r["skipped"]}
    assert saved and not {int(name[5:]) for name in saved} & skipped_steps
    for name in saved:
        weights = _dcp_weights(folder / name)
        assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.parametrize("source_mode, dtype", [("none", "torch.float32"), ("fsdp2", "torch.bfloat16")])
def test_model_only_load_starts_a_fresh_run_from_trained_weights(tmp_path, reference_run, source_mode, dtype):
    """Weights of a run written under any layout; step 1, fresh schedule and optimizer, lower loss than scratch
    (the run from scratch is the same for both sources: trained once per pytest run)."""
    nproc = 1 if source_mode == "none" else 2
    source = reference_run("data.total_steps=30", f"parallel.mode={source_mode}", f"model.dtype={dtype}", nproc=nproc)
    tuned = tmp_path / "tuned"
    options = ["data.total_steps=3", NO_CKPT, "data.seed=7"]
    scratch = reference_run(*options)
    config = tmp_path / "finetune.py"  # as users write it, InternEvo's key
    config.write_text(
        f"_base_ = [{str(TINY)!r}]\n"
        f"ckpt = dict(load_ckpt_info=dict(path={str(source / 'checkpoints')!r}, content=('model',), "
        "ckpt_type='internevo'))\n"
    )
    proc = train(tuned, *options, config=config)
    assert "Loaded the weights of" in proc.stderr and "step_00000030" in proc.stderr
    fresh, loaded = metrics(scratch), metrics(tuned)
    assert [r["step"] for r in loaded] == [1, 2, 3]
    assert [r["lr"] for r in loaded] == [r["lr"] for r in fresh]  # a new schedule from its start
    assert loaded[0]["loss"] < metrics(source)[-1]["loss"] + 0.3 < fresh[0]["loss"]


@pytest.mark.parametrize(
    "config_name, other",
    [
        ("internlm2_tiny_hybrid.py", "hybrid_optimizer.offload_fraction=1.0"),
        ("internlm2_tiny_swap.py", "swap_optimizer_times=2"),
    ],
)
def test_bf16_offload_optimizer_resume_with_other_settings_is_bitwise(tmp_path, reference_run, config_name, other):
    """Host-resident masters (hybrid CPU share, swap) checkpoint and reload exactly, into another placement (the
    bf16 baseline's options: 8 steps, checkpoints at 4 and 8; the full run is the one compared above)."""
    config = REPO / "configs" / config_name
    common = baseline_options("none", "torch.bfloat16")
    full, resumed = reference_run(*common, config=config), tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "step_00000004", resumed / "checkpoints" / "step_00000004")
    train(resumed, *common, other, config=config, resume=True)
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(full) if r["step"] > 4]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(resumed)] == expected


@pytest.mark.parametrize(
    "signum, nproc, layout",
    [
        (signal.SIGINT, 1, []),
        # torchrun forwarding SIGTERM to 2 ranks (the stop flag rides on the loss all-reduce); DDP's resume is
        # the kill -9 tests'
        (signal.SIGTERM, 2, [*TENSOR_MSP, "model.dtype=torch.float16", "grad_scaler.fp16.growth_interval=3"]),
    ],
    ids=["ctrl-c", "sigterm-msp-fp16"],
)
def test_sigterm_or_ctrl_c_checkpoints_exits_0_and_resumes_bitwise(tmp_path, signum, nproc, layout):
    """Preemption: the signal finishes the step, writes a checkpoint, exits 0; --resume gives the full curve
    (under msp in fp16 the loss scaler's state and the DTensor shards included)."""
    # 8 steps: the signal goes out as the third step's line appears, and lands within the step after it; the resumed
    # steps still hold a growth of the fp16 scale (every 3 steps: at 6), so the scaler's restored position counts
    # (CI time: 12 steps added only steps of the same kind to the full and the resumed runs)
    options = ["data.total_steps=8", "ckpt.checkpoint_every=1000", "ckpt.keep_last=0", "monitor.progress_bar=off"]
    options += layout
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    train(full, *options, nproc=nproc)
    proc = _spawn_run(stopped, options, nproc)
    deadline = time.monotonic() + 300
    while not ((stopped / "metrics.jsonl").is_file() and len(metrics(stopped)) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
        time.sleep(0.01)
    # torchrun forwards SIGTERM to its workers; a terminal's Ctrl-C reaches the whole process group.
    proc.send_signal(signum)
    proc.wait(timeout=300)
    stderr = proc.stderr_path.read_text()
    if nproc == 1:
        assert proc.returncode == 0, stderr[-3000:]
        assert "Traceback" not in stderr and f"Stopped by {signal.Signals(signum).name}" in stderr
    stopped_at = len(metrics(stopped))
    assert 3 <= stopped_at < 8
    assert (stopped / "checkpoints" / f"step_{stopped_at:08d}").is_dir()
    train(stopped, *options, nproc=nproc, resume=True)
    assert [(r["step"], r["loss"], r["grad_norm"], r.get("loss_scale")) for r in metrics(stopped)] == [
        (r["step"], r["loss"], r["grad_norm"], r.get("loss_scale")) for r in metrics(full)
    ]


def _spawn_run(work_dir, options, nproc):
    """`_spawn` on `nproc` processes (torchrun's signal forwarding: a forked run signals every rank)."""
    argv = train_argv(work_dir, *options)  # FAST, as `train` runs the full and resumed runs
    return spawn_python([*python(nproc), str(REPO / "train.py"), *argv], work_dir)


def test_second_ctrl_c_exits_at_once_without_a_traceback(tmp_path):
    from internlm_offload.engine.interrupts import GracefulStop

    # A process started in the background by a non-interactive shell inherits SIGINT ignored (so does a test
    # worker under it): start from Python's own handler, as an interactive `train.py` does.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with GracefulStop() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested and stop.signal_name == "SIGINT"
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored on leaving
    finally:
        signal.signal(signal.SIGINT, inherited)

"""Failures around checkpoints, through train.py: a full disk on any rank, damaged checkpoints on --resume,
a rank killed under torchrun. Each ends in one line, the documented exit code and nothing lost."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner import FAST, REPO, TINY, metrics, run_python, train

pytestmark = pytest.mark.e2e

FULL_DISK = Path(__file__).with_name("train_on_a_full_disk.py")


def curve(work_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in metrics(work_dir)]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error: " in line]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_full_disk_on_any_rank_exits_4_naming_the_last_good_checkpoint(tmp_path, rank):
    options = ["data.total_steps=6", "ckpt.checkpoint_every=2", "parallel.mode=ddp"]
    env = {"FULL_DISK_RANK": str(rank), "FULL_DISK_FROM_STEP": "4"}
    proc = train(tmp_path, *options, nproc=2, script=FULL_DISK, env=env, check=False)
    # torchrun exits 1 when a worker fails and names the worker's own exit code; each worker prints its line
    # (the first to exit may get torchrun's SIGTERM to the other in before that one prints).
    assert proc.returncode != 0 and "(exitcode: 4)" in proc.stderr, proc.stderr[-3000:]
    folder = tmp_path / "checkpoints"
    lines = error_lines(proc.stderr)
    assert 1 <= len(lines) <= 2, proc.stderr[-3000:]
    for line in lines:
        assert (
            f"error: checkpoint {folder / 'step_00000004'} could not be written on rank {rank}: no space left on "
            f"device: " in line
        )
        assert line.endswith(
            f"the last good checkpoint, {folder / 'step_00000002'}, is intact and the partial folder was removed"
        )
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_00000002"]
    assert (folder / "latest").read_text().strip() == "step_00000002"
    if rank == 1:  # space freed: the run continues from what was kept
        train(tmp_path, *options, nproc=2, resume=True)
        assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_a_checkpoint_folder_too_small_is_named_at_start(tmp_path):
    proc = train(tmp_path, "data.total_steps=4", script=FULL_DISK, env={"FULL_DISK_FREE": "4096"}, check=False)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [proc.stderr.splitlines()[-1]] and proc.stderr.splitlines()[-1].startswith(
        f"error: cannot save checkpoints in {tmp_path / 'checkpoints'}: not enough space: 4.0 KiB free, a "
        "checkpoint needs about "
    )
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_resume_passes_damaged_checkpoints_to_the_newest_intact_one(tmp_path):
    options = ["data.total_steps=6", "ckpt.checkpoint_every=2", "ckpt.keep_last=0"]
    train(tmp_path, *options)
    expected = curve(tmp_path)
    folder = tmp_path / "checkpoints"
    shard = folder / "step_00000006" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    (folder / "step_00000004" / "__0_0.distcp").unlink()  # missing
    verify = [sys.executable, "-m", "internlm_offload.tools.verify_ckpt", str(folder)]
    listing = run_python(verify)
    assert listing.returncode == 1 and listing.stdout.splitlines() == [
        "step_00000002  intact",
        "step_00000004  damaged: __0_0.distcp is missing",
        f"step_00000006  damaged: __0_0.distcp has 100 B, the manifest says {shard_size(folder / 'step_00000002')}",
    ]
    proc = train(tmp_path, *options, resume=True)
    assert (
        "Resume: step_00000006 is damaged (__0_0.distcp has 100 B, the manifest says "
        f"{shard_size(folder / 'step_00000002')}); step_00000004 is damaged (__0_0.distcp is missing); resuming "
        "from step_00000002, the newest intact checkpoint (nothing was deleted)"
    ) in proc.stderr
    assert curve(tmp_path) == expected  # steps 3-6 again, bitwise
    assert sorted(p.name for p in (folder / "damaged").iterdir()) == ["step_00000004", "step_00000006"]
    assert run_python(verify).returncode == 0


def shard_size(step: Path) -> str:
    from internlm_offload.config.sizes import human_bytes

    return human_bytes((step / "__0_0.distcp").stat().st_size)


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher_pid:
                env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
                found[int(env["RANK"])] = int(entry.name)
        except (OSError, KeyError, ValueError):
            continue  # exited meanwhile, or not a worker
    return found


def test_a_rank_killed_under_torchrun_stops_the_run_and_resume_is_bitwise(tmp_path):
    options = ["data.total_steps=12", "ckpt.checkpoint_every=3", "ckpt.keep_last=0", "parallel.mode=ddp"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(full, *options, nproc=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(REPO / "train.py")]
    cmd += ["--config", str(TINY), "--work-dir", str(killed), "--cfg-options", *FAST, *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (killed / "checkpoints" / "step_00000006").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before a rank could be killed"
        time.sleep(0.01)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    started = time.monotonic()
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.monotonic() - started < 60  # torchrun stops the other rank
    assert 6 <= len(metrics(killed)) < 12
    train(killed, *options, nproc=2, resume=True)
    assert curve(killed) == curve(full)

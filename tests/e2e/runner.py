"""Helpers to run `train.py` as users do: in a subprocess, alone or under torchrun."""

import atexit
import functools
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from fork_server import ForkServer, torchrun_envs

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "internlm2_tiny.py"
# Small and fast: the tests check equality, not learning. No preflight trace (about 1.5 s of CPU per process,
# and a trace that fails only warns): the tests of the preflight and the planner turn it on (`preflight=True`).
FAST = ["data.seq_len=64", "data.micro_bsz=2", "data.micro_num=2", "monitor.progress_bar=off", "preflight=False"]
# The baseline several files compare with (conftest's `baseline` fixture trains each once per pytest run): 8 steps
# of a global batch of 8, checkpoints at steps 4 and 8 (test_train_e2e resumes from them; saving changes no bits).
BASELINE = ["data.total_steps=8", "data.global_bsz=8", "ckpt.checkpoint_every=4", "ckpt.keep_last=0"]
BASELINE_NPROC = {"none": 1, "ddp": 2, "fsdp2": 2}
BASE_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
OUTS = (".stdout", ".stderr")


def baseline_options(mode: str = "none", dtype: str = "torch.float32") -> list[str]:
    """The options of the baseline under `mode` in `dtype` (a variant adds its own to these)."""
    return [*BASELINE, f"parallel.mode={mode}", f"model.dtype={dtype}"]


def train(
    work_dir: Path,
    *options: str,
    nproc: int = 1,
    config: Path = TINY,
    resume: bool = False,
    check: bool = True,
    torchrun: bool = False,
    fast: bool = True,
    script: Path = REPO / "train.py",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run train.py (or `script`, a wrapper of it; under torchrun when nproc > 1 or asked) with the FAST
    options (unless `fast=False`) plus `options`; `env` adds to the environment."""
    if nproc > 1 or torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    else:
        launcher = [sys.executable]
    argv = ["--config", str(config), "--work-dir", str(work_dir)]
    argv += ["--cfg-options", *(FAST if fast else ["monitor.progress_bar=off"]), *options]
    if resume:
        argv.append("--resume")
    cmd = [*launcher, str(script), *argv]
    server = fork_server() if check and env is None else None
    if server is not None:  # a run expected to pass, in the default environment: forked (fork_server.py)
        envs = torchrun_envs(BASE_ENV, nproc) if nproc > 1 or torchrun else [BASE_ENV]
        return forked(server, cmd, script, argv, envs)
    env = {**BASE_ENV, **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def forked(
    server: ForkServer, cmd: list[str], script: Path, argv: list[str], envs: list[dict[str, str]]
) -> subprocess.CompletedProcess:
    """`cmd` run by the fork server: the same CompletedProcess (and failure report) as from a subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        code = server.run(script, argv, envs, REPO, out, timeout=600)
        stdout, stderr = (Path(f"{out}{s}").read_text() if Path(f"{out}{s}").exists() else "" for s in OUTS)
    if code != 0:
        raise AssertionError(f"train.py failed ({code}):\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


@functools.cache
def fork_server() -> ForkServer | None:
    """This pytest process's fork server (None where forking is unsafe or RUNNER_FORK=0 asks for none)."""
    if os.environ.get("RUNNER_FORK", "1") == "0" or not hasattr(os, "fork"):
        return None
    server = ForkServer(REPO, BASE_ENV)
    atexit.register(server.close)
    if not server.usable:
        warnings.warn("the fork server holds more than one thread after its imports: runs start real processes")
        return None
    return server


def metrics(work_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()]


def losses(work_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(work_dir)}

"""Helpers to run `train.py` and the tools as users do: `python script`, `python -m tool` or torchrun.

Each run is forked from a process that imported torch and the package once (fork_server.py) wherever that gives
the run a new process would; the rest start real processes (`_forkable` says which)."""

import atexit
import functools
import itertools
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
    cmd = [
        *python(nproc, torchrun),
        str(script),
        *train_argv(work_dir, *options, config=config, resume=resume, fast=fast),
    ]
    proc = run_python(cmd, env=env, expect_success=check)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def python(nproc: int = 1, torchrun: bool = False) -> list[str]:
    """The launcher: python, or torchrun on `nproc` processes (when nproc > 1 or asked)."""
    if nproc > 1 or torchrun:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    return [sys.executable]


def train_argv(
    work_dir: Path, *options: str, config: Path = TINY, resume: bool = False, fast: bool = True
) -> list[str]:
    argv = ["--config", str(config), "--work-dir", str(work_dir)]
    argv += ["--cfg-options", *(FAST if fast else ["monitor.progress_bar=off"]), *options]
    return [*argv, "--resume"] if resume else argv


def run_python(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    timeout: float = 600,
    expect_success: bool = False,
) -> subprocess.CompletedProcess:
    """`cmd` (`python script ...`, `python -m module ...` or torchrun of a script), captured as by
    `subprocess.run`; forked from the fork server where that gives the same run (see `_forkable`)."""
    plan = _forkable(cmd, env, expect_success)
    if plan is None:
        return subprocess.run(cmd, cwd=cwd, env={**BASE_ENV, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    server, target, argv, envs = plan
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        code = server.run(target, argv, envs, cwd, out, timeout=timeout)
        stdout, stderr = (_read(Path(f"{out}{s}")) for s in OUTS)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def spawn_python(cmd: list[str], out: Path, *, env: dict[str, str] | None = None) -> "ForkedRun | subprocess.Popen":
    """`cmd` started and left running, its stderr appended to `<out>.stderr` (`.stderr_path`; a fork's stdout to
    `<out>.stdout`, a subprocess's dropped): a forked run, or a subprocess where a fork would not give the same
    run. Both poll, wait and take signals."""
    stderr = Path(f"{out}.stderr")
    plan = _forkable(cmd, env, expect_success=True)
    if plan is None:
        with stderr.open("a") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env={**BASE_ENV, **(env or {})}, stdout=subprocess.DEVNULL,
                                    stderr=err)  # fmt: skip
        proc.stderr_path = stderr
        return proc
    server, target, argv, envs = plan
    return ForkedRun(server, server.start(target, argv, envs, REPO, out), stderr)


class ForkedRun:
    """A started fork-server run with subprocess.Popen's poll / wait / send_signal (a signal goes to every
    rank, as torchrun's agent forwards it)."""

    def __init__(self, server: ForkServer, pids: list[int], stderr_path: Path) -> None:
        self.server, self.pids, self.stderr_path = server, pids, stderr_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.poll(self.pids)
        return self.returncode

    def wait(self, timeout: float = 600) -> int:
        if self.returncode is None:
            self.returncode = self.server.wait(self.pids, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is not None:  # reaped: its pids may be another process's by now
            return
        for pid in self.pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


# Read when python, torch or the C library start: a forked child would keep the server's.
STARTUP_VARIABLES = ("ATEN_", "MALLOC_", "OMP_", "MKL_", "KMP_", "LD_", "PYTHON", "TORCH_CUDA_SANITIZER")


def _forkable(
    cmd: list[str], env: dict[str, str] | None, expect_success: bool
) -> tuple[ForkServer, dict[str, str], list[str], list[dict[str, str]]] | None:
    """(server, target, argv, each rank's environment) where the fork server gives `cmd` the same run: python
    on a script or a module, or torchrun of a script expected to succeed (a failure's report is torchrun's
    own); no start-up variable in `env`. None otherwise."""
    server = fork_server()
    if server is None or cmd[0] != sys.executable or not _same_start(env):
        return None
    base = {**BASE_ENV, **(env or {})}
    if cmd[1:3] == ["-m", "torch.distributed.run"]:
        flags = list(itertools.takewhile(lambda arg: arg.startswith("--"), cmd[3:]))  # torchrun's, not the script's
        rest = cmd[3 + len(flags) :]
        nproc = [int(f.split("=", 1)[1]) for f in flags if f.startswith(("--nproc_per_node=", "--nproc-per-node="))]
        if not expect_success or set(f.split("=", 1)[0] for f in flags) - TORCHRUN_FLAGS or len(nproc) != 1:
            return None
        return server, {"script": rest[0]}, rest[1:], torchrun_envs(base, nproc[0])
    if cmd[1] == "-m":
        return server, {"module": cmd[2]}, cmd[3:], [base]
    if cmd[1].startswith("-"):
        return None
    return server, {"script": cmd[1]}, cmd[2:], [base]


def _same_start(env: dict[str, str] | None) -> bool:
    """Whether `env` leaves what is read at start-up as the server has it (a PYTHONPATH led by this repository
    too: the server imports the package from there)."""
    for key, value in (env or {}).items():
        if not key.startswith(STARTUP_VARIABLES) or BASE_ENV.get(key) == value:
            continue
        if key != "PYTHONPATH" or value.split(os.pathsep)[0] != str(REPO):
            return False
    return True


TORCHRUN_FLAGS = {"--nproc_per_node", "--nproc-per-node", "--standalone"}


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


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


def assert_same_metrics(base: Path, run: Path, keys: tuple[str, ...]) -> None:
    """`run` logged the steps `base` did, and every step's values of `keys` equal (as logged, compared as float64
    tensors with torch.equal: a list such as moe_tokens_per_expert is one row per step)."""
    import torch

    expected, got = metrics(base), metrics(run)
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for key in keys:
        want = torch.tensor([r[key] for r in expected], dtype=torch.float64)
        have = torch.tensor([r[key] for r in got], dtype=torch.float64)
        assert torch.equal(have, want), (key, want.tolist(), have.tolist())

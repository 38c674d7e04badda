import fcntl
import hashlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # helpers shared with the unit tests (chat_fixtures.py)

from runner import BASELINE_NPROC, TINY, baseline_options, train  # found through the path above

# What decides a run's kernels, and so its last bits, besides its options (tests/README.md)
KERNEL_VARIABLES = ("MKL_CBWR", "ATEN_CPU_CAPABILITY")


def _run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This pytest run's own temporary root, shared by its xdist workers (each has a subfolder of it)."""
    basetemp = tmp_path_factory.getbasetemp()
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`reference(*options, nproc=1, config=TINY)`: the run dir of train.py on `nproc` processes with `options`
    (on `config`), trained once per pytest run. Under `--dist loadfile` two files on two workers may ask for the
    same run: the first trains it holding the run's lock, the other waits on the lock and reads it. The runs are
    shared: read them (or copy a checkpoint out to resume it), never write."""
    root = _run_root(tmp_path_factory) / "reference_runs"
    root.mkdir(exist_ok=True)

    def reference(*options: str, nproc: int = 1, config: Path = TINY) -> Path:
        named = [str(nproc), *options] if config == TINY else [str(nproc), str(config), *options]
        # a worker on other kernels (TEST_SHIFTED_KERNELS=half, tests/conftest.py) trains its own: the last bits differ
        named += [f"{name}={os.environ.get(name, '')}" for name in KERNEL_VARIABLES]
        key = hashlib.sha256("\0".join(named).encode()).hexdigest()[:16]
        run, done = root / key, root / f"{key}.done"
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if train() raises
            if not done.exists():
                shutil.rmtree(run, ignore_errors=True)  # what a failed attempt left
                train(run, *options, nproc=nproc, config=config)
                done.write_text(f"nproc={nproc}\nconfig={config}\n" + "\n".join(options) + "\n")
        return run

    return reference


@pytest.fixture(scope="session")
def one_process_reference(reference_run: Callable[..., Path]) -> Callable[..., Path]:
    """`reference(*options)`: `reference_run` on one process (the tensor-parallel files' fp32 references)."""
    return reference_run


@pytest.fixture(scope="session")
def baseline(reference_run: Callable[..., Path]) -> Callable[..., Path]:
    """`baseline(mode, dtype)`: the plain run (no memory feature) of runner.BASELINE under `parallel.mode=mode`
    (one process for "none", two for DDP and FSDP2) in `dtype`, trained once per pytest run. The offload, tier
    and precision files compare their variants with it; test_train_e2e repeats and resumes it."""

    def run(mode: str = "none", dtype: str = "torch.float32") -> Path:
        return reference_run(*baseline_options(mode, dtype), nproc=BASELINE_NPROC[mode])

    return run

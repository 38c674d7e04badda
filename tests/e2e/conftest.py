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

from runner import train  # found through the path above


def _run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This pytest run's own temporary root, shared by its xdist workers (each has a subfolder of it)."""
    basetemp = tmp_path_factory.getbasetemp()
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


@pytest.fixture(scope="session")
def one_process_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`reference(*options)`: the run dir of train.py on one process with `options`, trained once per pytest run.
    Under `--dist loadfile` two files on two workers may ask for the same run: the first trains it holding
    the run's lock, the other waits on the lock and reads it."""
    root = _run_root(tmp_path_factory) / "one_process_references"
    root.mkdir(exist_ok=True)

    def reference(*options: str) -> Path:
        key = hashlib.sha256("\0".join(options).encode()).hexdigest()[:16]
        run, done = root / key, root / f"{key}.done"
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if train() raises
            if not done.exists():
                shutil.rmtree(run, ignore_errors=True)  # what a failed attempt left
                train(run, *options)
                done.write_text("\n".join(options) + "\n")
        return run

    return reference

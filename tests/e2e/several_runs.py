"""train.py's runs one after another in one process, so one torchrun launch trains several layouts: each run's
arguments as train.py takes them, the runs separated by `--then`. The process group stays up between the runs (each
builds its own meshes over it) and is shut down after the last; the first run that fails ends the launch with its
exit code."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from internlm_offload.builder import build_trainer
from internlm_offload.engine import runtime
from internlm_offload.launch import main

THEN = "--then"


def split_runs(argv: list[str]) -> list[list[str]]:
    """Each run's arguments."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == THEN:
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


if __name__ == "__main__":
    shutdown, runtime.shutdown_runtime = runtime.shutdown_runtime, lambda: None  # launch.run imports it per run
    try:
        for run_argv in split_runs(sys.argv[1:]):
            if code := main(run_argv, build_trainer=build_trainer):
                sys.exit(code)
    finally:
        shutdown()

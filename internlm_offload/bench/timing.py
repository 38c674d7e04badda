"""The block benches' shared timing: variants stepped alternately in one process (the first of each round rotating,
so a slow spell of the shared machine falls on all of them), wall and process CPU time per step, medians and their
ratios to a base variant; what the numbers depend on (`machine`); a bench's own processes under torchrun
(`run_workers`). Not imported by the library."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass
class Variant:
    """One thing to time: `step` runs it once (forward and backward), `block` holds the gradients to clear."""

    name: str
    step: Callable[[], Any]
    block: nn.Module
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def alternate(variants: list[Variant], warmup: int, repeats: int) -> None:
    """`warmup` untimed rounds, then `repeats` timed ones; each round steps every variant once, rotating which goes
    first, and clears its block's gradients after the step (outside the timing)."""
    for rep in range(warmup + repeats):
        k = rep % len(variants)
        for v in variants[k:] + variants[:k]:
            wall, cpu = timed(v.step)
            v.block.zero_grad(set_to_none=True)
            if rep >= warmup:
                v.wall_s.append(wall)
                v.cpu_s.append(cpu)


def summarize(v: Variant, base: Variant) -> dict[str, Any]:
    """The JSON record of one variant: its raw times, medians, and the medians' ratios to `base`'s."""
    return {
        "name": v.name,
        "wall_s": v.wall_s,
        "cpu_s": v.cpu_s,
        "wall_s_median": statistics.median(v.wall_s),
        "cpu_s_median": statistics.median(v.cpu_s),
        "ratio_wall": statistics.median(v.wall_s) / statistics.median(base.wall_s),
        "ratio_cpu": statistics.median(v.cpu_s) / statistics.median(base.cpu_s),
    }


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius norms, in fp32)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def machine(*, transformers: bool = False) -> dict[str, Any]:
    """What every bench's numbers depend on: versions, the cpu, threads and the load at the end (a shared machine)."""
    found = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "loadavg_at_end": os.getloadavg(),
    }
    if transformers:
        import transformers as hf

        found["transformers"] = hf.__version__
    return found


def add_timing_arguments(p: argparse.ArgumentParser, *, out: str, repeats: int, unit: str = "variant") -> None:
    """The options every block bench shares: timed and untimed steps, threads, the JSON path and `--quick`."""
    p.add_argument("--repeats", type=int, default=repeats, help=f"timed steps per {unit}")
    p.add_argument("--warmup", type=int, default=1, help=f"untimed steps per {unit} (>= 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path(out))
    p.add_argument("--quick", action="store_true", help="tiny sizes, for tests")


def parse_timing_arguments(
    p: argparse.ArgumentParser, argv: list[str] | None, quick: dict[str, Any], at_least_one: tuple[str, ...] = ()
) -> argparse.Namespace:
    """Parse `argv`; `--quick` swaps in the `quick` defaults (explicit flags still win); --repeats, --warmup and
    every option in `at_least_one` must be >= 1. Sets torch's threads when --threads is given."""
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    counted = ("repeats", "warmup", *at_least_one)
    if any(getattr(args, name) < 1 for name in counted):
        flags = [f"--{name.replace('_', '-')}" for name in counted]
        p.error(f"{', '.join(flags[:-1])} and {flags[-1]} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def run_workers(module: str, ranks: int, argv: list[str], cwd: Path) -> None:
    """`python -m module --worker *argv` on `ranks` processes under torchrun (one thread each), which write the
    results the caller then reads."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command += ["-m", module, "--worker", *argv]
    subprocess.run(command, check=True, env={"OMP_NUM_THREADS": "1", **os.environ}, cwd=cwd)


def parse_worker_arguments(
    argv: list[str] | None, *, description: str, out: Path, full_steps: int
) -> argparse.Namespace:
    """The torchrun benches' options: --quick, --steps, --out, and the --worker their launch sets."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one step (checks the script, times nothing)")
    p.add_argument("--steps", type=int, help=f"timed steps per variant (default {full_steps})")
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by `run_distributed`
    return p.parse_args(argv)


def run_distributed(
    args: argparse.Namespace,
    module: str,
    ranks: int,
    sizes: tuple[dict[str, Any], dict[str, Any]],
    worker: Callable[[dict[str, Any], Path], None],
    cwd: Path,
) -> dict[str, Any]:
    """A torchrun bench's two sides: in a worker (`--worker`), `worker(settings, args.out)` on OMP_NUM_THREADS
    threads and {}, the settings `sizes`' (quick, full) one as --quick says with --steps over it; in the launching
    process, `ranks` workers with the same --quick / --steps / --out, then the JSON they wrote."""
    if args.worker:
        settings = dict(sizes[0] if args.quick else sizes[1])
        if args.steps is not None:
            settings["steps"] = args.steps
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        worker(settings, args.out)
        return {}
    argv = ["--out", str(args.out), *(["--quick"] if args.quick else [])]
    argv += [f"--steps={args.steps}"] if args.steps is not None else []
    run_workers(module, ranks, argv, cwd)
    return json.loads(args.out.read_text())

"""A family's tiny config under each parallel layout (torchrun over gloo) against one process, for 20 steps: the
largest relative difference of the loss, the gradient norm and the MTP loss per layout, `moe_maxvio`'s, and whether
the router biases of the last step are bit for bit one process's.

    python -m internlm_offload.bench.layouts [--config configs/deepseek_v3_tiny.py] [--steps 20]
        [--layouts ddp fsdp2 ep2 mtp msp fsp isp pp2] [--out bench_results/layouts.json]

The CI's e2e tests hold the same layouts to 6 steps (tests/e2e/test_deepseek_parallel_e2e.py,
test_pipeline_moe_e2e.py); this is the issue's 20-step measurement, recorded in docs/deepseek.md. Each run is
train.py with the config's own options plus the layout's (the tests' lr 1e-3 and global batch 8 of 4 micro-batches
of 2 on one process). Not imported by the library.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from internlm_offload.tools.export import load_weights

REPO = Path(__file__).resolve().parents[2]
COMMON = ["data.seq_len=64", "data.micro_bsz=2", "data.global_bsz=8", "adam.lr=1e-3", "monitor.progress_bar=off",
          "preflight=False", "ckpt.keep_last=1"]  # fmt: skip
COLUMN_ROW = ["parallel.mode=fsdp2", "parallel.expert.no_tp=True"]
BIAS = "router.e_score_correction_bias"
METRICS = ("loss", "grad_norm", "mtp_loss", "moe_maxvio")


@dataclass(frozen=True)
class Layout:
    """A layout's processes and options."""

    nproc: int
    options: tuple[str, ...]


def _tensor(mode: str) -> tuple[str, ...]:
    extra = ["parallel.mode=ddp"] if mode == "isp" else COLUMN_ROW
    return ("parallel.tensor.size=2", f"parallel.tensor.mode={mode}", *extra)


LAYOUTS = {
    "ddp": Layout(2, ("parallel.mode=ddp",)),
    "fsdp2": Layout(2, ("parallel.mode=fsdp2",)),
    "ep2": Layout(4, ("parallel.mode=fsdp2", "parallel.expert.size=2")),
    **{mode: Layout(2, _tensor(mode)) for mode in ("mtp", "msp", "fsp", "isp")},
    "pp2": Layout(4, ("parallel.pipeline.size=2", "parallel.mode=ddp")),
}


def train(work_dir: Path, config: Path, steps: int, nproc: int, options: Sequence[str]) -> None:
    """train.py on `nproc` processes (torchrun when more than one), one thread each."""
    launcher = [sys.executable] + (
        ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"] if nproc > 1 else []
    )
    argv = ["--config", str(config), "--work-dir", str(work_dir), "--cfg-options"]
    argv += [*COMMON, f"data.total_steps={steps}", f"ckpt.checkpoint_every={steps}", *options]
    shutil.rmtree(work_dir, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*launcher, str(REPO / "train.py"), *argv], cwd=REPO, env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{work_dir.name}: train.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def metrics(run: Path) -> list[dict]:
    """The records of `run`'s metrics.jsonl, one per step."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def largest_relative_difference(base: Sequence[float], test: Sequence[float]) -> float:
    """max over steps of |test - base| / |base| (0 where both are 0); the runs must have the same steps."""
    if len(base) != len(test):
        raise ValueError(f"{len(test)} steps against {len(base)}")
    return max((abs(t - b) / abs(b) if b else abs(t)) for b, t in zip(base, test, strict=True))


def last_biases(run: Path) -> dict[str, torch.Tensor]:
    """The router biases of `run`'s last checkpoint."""
    last = max((run / "checkpoints").glob("step_*"))
    return {key: value for key, value in load_weights(last).items() if key.endswith(BIAS)}


def compare(base: Path, run: Path) -> dict:
    """Per metric the largest relative difference over the steps, and whether the last biases are bitwise."""
    want, have = metrics(base), metrics(run)
    result = {
        metric: largest_relative_difference([r[metric] for r in want], [r[metric] for r in have])
        for metric in METRICS
        if metric in want[0]
    }
    biases, theirs = last_biases(base), last_biases(run)
    result["biases_bitwise"] = biases.keys() == theirs.keys() and all(
        torch.equal(biases[key], theirs[key]) for key in biases
    )
    result["steps"] = len(have)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.layouts", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "deepseek_v3_tiny.py")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--work-dir", type=Path, default=REPO / "work_dirs" / "bench_layouts")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "layouts.json")
    args = parser.parse_args(argv)
    one = args.work_dir / "one"
    train(one, args.config, args.steps, 1, [])
    results = {}
    for name in args.layouts:
        layout = LAYOUTS[name]
        run = args.work_dir / name
        train(run, args.config, args.steps, layout.nproc, layout.options)
        results[name] = {"nproc": layout.nproc, "options": list(layout.options), **compare(one, run)}
        print(name, json.dumps(results[name]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": str(args.config), "steps": args.steps, "layouts": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

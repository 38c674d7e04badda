"""Pipeline parallel's step time and bubble on cpu: P = 2 and 4 over gloo against the same run on one process.

    python -m internlm_offload.bench.pipeline [--sizes 2 4] [--micro-num 8] [--steps 8] [--rounds 2]
        [--out bench_results]

Every run is `train.py` under torchrun (one process for P = 1, P processes otherwise, one thread each:
OMP_NUM_THREADS=1) on configs/internlm2_tiny_pp2.py made 8 blocks deep (`SHAPE`: hidden 128, sequences of 128), fp32, one rank per
stage, the same global batch of `--micro-num` micro-batches everywhere. The schedules side by side at each P:
1F1B, interleaved 1F1B over 2 chunks per rank, ZBH1 and ZBV. The runs alternate in rounds (every layout once per
round, `--rounds` rounds) so that a slow spell of the machine falls on all of them; a run's step time is the median
of its steady steps (the first two are dropped: shape inference and the optimizer's first step), a layout's the
median over its rounds' runs (a run slowed down throughout by other work on the machine is outvoted).

Bubble: the measured fraction is the share of a rank's step not covered by its share of the one-process work,
1 - T_1 / (P x T_P) (send, receive and the processes' contention count as bubble); the theory is the schedule's
idle share with forward, input-backward and weight-backward of equal time (the zero-bubble papers' assumption).

Writes pipeline.json (environment, every run's step times, the medians and ratios) and pipeline.png under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "internlm2_tiny_pp2.py"
SHAPE = ["model.num_layers=8", "data.seq_len=128", "data.micro_bsz=2"]
# (name, mode, num_chunks): the schedules compared at each pipeline size
SCHEDULES = (("1F1B", "1F1B", 1), ("interleaved", "1F1B", 2), ("ZBH1", "ZBH1", 1), ("ZBV", "ZBV", 1))
WARMUP = 2  # steps of a run left out of its times


def theory_bubble(schedule: str, size: int, micro_num: int) -> float:
    """The schedule's idle share of a rank's step with equal forward (F), input-backward (B) and weight-backward
    (W) times: 1F1B (P-1)/(m+P-1); interleaved over v=2 chunks (P-1)/(v m+P-1); ZBH1 (P-1)(F+B-W) over
    m(F+B+W) + that, (P-1)/(3m+P-1); ZBV's (P-1)(F+B-2W) per chunk is 0."""
    idle = size - 1
    if schedule == "1F1B":
        return idle / (micro_num + idle)
    if schedule == "interleaved":
        return idle / (2 * micro_num + idle)
    if schedule == "ZBH1":
        return idle / (3 * micro_num + idle)
    if schedule == "ZBV":
        return 0.0
    raise ValueError(f"no theory for schedule {schedule!r}")


def measured_bubble(one_process_s: float, size: int, step_s: float) -> float:
    """1 - T_1 / (P x T_P): what a rank's step holds beyond its 1/P share of the one-process step."""
    return 1.0 - one_process_s / (size * step_s)


def run_options(size: int, mode: str, num_chunks: int, micro_num: int, steps: int) -> list[str]:
    return [
        *SHAPE,
        f"data.micro_num={micro_num}",
        f"data.global_bsz={2 * micro_num}",
        f"data.total_steps={steps}",
        f"parallel.pipeline.size={size}",
        f"parallel.pipeline.mode={mode}",
        f"model.num_chunks={num_chunks}",
        "ckpt.enable_save_ckpt=False",
        "monitor.progress_bar=off",
        "preflight=False",
    ]


def step_times(size: int, options: list[str]) -> list[float]:
    """The steady steps' times (rank 0's record) of one `train.py` run on `size` processes."""
    launcher = [sys.executable]
    if size > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={size}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as work_dir:
        cmd = [*launcher, str(REPO / "train.py"), "--config", str(CONFIG), "--work-dir", work_dir, "--cfg-options"]
        proc = subprocess.run([*cmd, *options], capture_output=True, text=True, env=env, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"train.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
        records = [json.loads(line) for line in (Path(work_dir) / "metrics.jsonl").read_text().splitlines()]
    return [record["step_time_s"] for record in records[WARMUP:]]


def layouts(sizes: list[int]) -> list[tuple[str, int, str, int]]:
    """(schedule name, P, mode, num_chunks): one process first, then every schedule at every size."""
    return [("one process", 1, "1F1B", 1)] + [(name, p, mode, c) for p in sizes for name, mode, c in SCHEDULES]


def run_rounds(sizes: list[int], micro_num: int, steps: int, rounds: int) -> dict[tuple[str, int], list[list[float]]]:
    """Every layout's runs' steady step times, by (schedule name, P), a list per round."""
    times: dict[tuple[str, int], list[list[float]]] = {}
    for round_index in range(rounds):
        for name, size, mode, chunks in layouts(sizes):
            measured = step_times(size, run_options(size, mode, chunks, micro_num, steps))
            times.setdefault((name, size), []).append(measured)
            print(f"round {round_index + 1}: P={size} {name}: {statistics.median(measured):.3f} s", flush=True)
    return times


def layout_time(runs: list[list[float]]) -> float:
    """The median over the runs of each run's median step time."""
    return statistics.median(statistics.median(run) for run in runs)


def summarize(times: dict[tuple[str, int], list[list[float]]], micro_num: int) -> list[dict[str, Any]]:
    """Median step time per layout, its ratio to one process, and the measured and theoretical bubble."""
    one = layout_time(times[("one process", 1)])
    rows = []
    for (name, size), runs in times.items():
        median = layout_time(runs)
        row: dict[str, Any] = {
            "schedule": name,
            "size": size,
            "median_step_s": median,
            "run_medians_s": [statistics.median(run) for run in runs],
            "x_one_process": median / one,
        }
        if size > 1:
            row["speedup"] = one / median
            row["bubble_measured"] = measured_bubble(one, size, median)
            row["bubble_theory"] = theory_bubble(name, size, micro_num)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| P | schedule | median step s | x one process | speed-up | bubble measured | bubble theory |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row["size"] == 1:
            lines.append(f"| 1 | one process | {row['median_step_s']:.3f} | 1.00 | 1.00 | - | - |")
            continue
        lines.append(
            f"| {row['size']} | {row['schedule']} | {row['median_step_s']:.3f} | {row['x_one_process']:.2f} | "
            f"{row['speedup']:.2f} | {row['bubble_measured']:.2f} | {row['bubble_theory']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({row["size"] for row in rows if row["size"] > 1})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(SCHEDULES)
    for index, (name, _, _) in enumerate(SCHEDULES):
        points = [next(r for r in rows if r["schedule"] == name and r["size"] == p) for p in sizes]
        xs = [i + index * width for i in range(len(sizes))]
        axes[0].bar(xs, [r["median_step_s"] for r in points], width, label=name)
        axes[1].bar(xs, [r["bubble_measured"] for r in points], width, label=f"{name} measured")
        axes[1].scatter(xs, [r["bubble_theory"] for r in points], color="black", marker="_", s=200)
    one = next(r for r in rows if r["size"] == 1)["median_step_s"]
    axes[0].axhline(one, color="gray", linestyle="--", label="one process")
    for ax, label in zip(axes, ("median step time (s)", "bubble fraction (bars measured, dashes theory)"), strict=True):
        ax.set_xticks([i + width * (len(SCHEDULES) - 1) / 2 for i in range(len(sizes))], [f"P={p}" for p in sizes])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-num", type=int, default=8, help="micro-batches per step (the same at every P)")
    parser.add_argument("--steps", type=int, default=8, help=f"steps per run ({WARMUP} left out)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench_results")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than {WARMUP}")
    times = run_rounds(args.sizes, args.micro_num, args.steps, args.rounds)
    rows = summarize(times, args.micro_num)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "environment": {"torch": torch.__version__, "cpus": os.cpu_count(), "platform": platform.platform()},
        "shape": SHAPE,
        "micro_num": args.micro_num,
        "steps": args.steps,
        "rounds": args.rounds,
        "times": {f"P={size} {name}": values for (name, size), values in times.items()},
        "rows": rows,
    }
    (args.out / "pipeline.json").write_text(json.dumps(report, indent=2))
    plot(rows, args.out / "pipeline.png")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

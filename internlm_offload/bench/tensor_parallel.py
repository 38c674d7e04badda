"""Per-rank memory of the tensor modes: planned at 7B, measured on cpu.

    python -m internlm_offload.bench.tensor_parallel [--config configs/internlm2_7b.py] [--world-size 8]
        [--seq-lens 4096 32768] [--sizes 1 2 4 8] [--hardware h100] [--measure] [--out bench_results/tensor_parallel]

Plan: the planner traces `--config` on `--world-size` ranks under FSDP2 (data parallel = world / T) at each
sequence length, once with T = 1 and once per mode and tensor size, and reads off rank 0's device peak, what one
micro-batch's forward leaves alive (activations), the model state, the bytes each rank sends in the tensor-parallel
collectives and the cost model's step time with `--hardware`'s row. The activation ratio is against T = 1 at the
same sequence length and micro-batch.

`--measure`: on cpu (torchrun, gloo, 2 processes), `train.py` runs the planner's validation model
(configs/planner_validation.py) at T = 2 in each mode and in one process, each at micro_bsz 4 and 2. A
micro-batch's activations grow with its size and nothing else does, so the difference of the two measured device
peaks (RssAnon) is what half a micro-batch's activations take; the ratio of those differences is the measured
activation ratio at T = 2, with no figure from the planner in it.

Writes tensor_parallel.json, tensor_parallel.md (the tables) and tensor_parallel.png under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from internlm_offload.bench.planner import CONFIG as VALIDATION_CONFIG
from internlm_offload.bench.planner import measure
from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner.cost import HARDWARE, step_time

REPO = Path(__file__).resolve().parents[2]
MODES = ("mtp", "msp", "fsp", "isp")
MIB, GIB = 2**20, 2**30
MODEL_STATE = ("model_params", "master_weights", "optimizer_states")


def layouts(sizes: list[int]) -> list[tuple[str, int]]:
    """(mode, T): T = 1 once (no tensor parallel), then every mode at every other size."""
    return [("none", 1)] + [(mode, size) for size in sizes if size > 1 for mode in MODES]


def tensor_options(mode: str, size: int, seq_len: int, global_bsz: int) -> dict[str, Any]:
    options: dict[str, Any] = {"data.seq_len": seq_len, "data.global_bsz": global_bsz, "parallel.mode": "fsdp2"}
    if size > 1:
        options |= {"parallel.tensor.size": size, "parallel.tensor.mode": mode}
    return options


def plan_row(config: Path, mode: str, size: int, seq_len: int, world_size: int, hardware: str) -> dict[str, Any]:
    """One traced layout: rank 0's figures."""
    from internlm_offload.planner.trace import trace_step

    # one micro-batch of one sequence per data-parallel rank: the same micro-batch in every layout
    options = tensor_options(mode, size, seq_len, global_bsz=world_size // size)
    memory = trace_step(resolve_config(load_config_file(config, options), world_size=world_size), world_size)
    timing = step_time(memory.micro_batch_work, memory.optimizer_work, memory.micro_num, HARDWARE[hardware])
    return {
        "mode": mode,
        "tensor_size": size,
        "seq_len": seq_len,
        "device_peak_bytes": memory.device_peak_bytes,
        "activation_bytes": memory.components["activations"],
        "model_state_bytes": sum(memory.components[name] for name in MODEL_STATE),
        "collective_bytes": memory.micro_batch_work.collective_bytes,
        "step_s": timing.step_s,
    }


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's activations over the T = 1 row of its sequence length."""
    base = {row["seq_len"]: row["activation_bytes"] for row in rows if row["tensor_size"] == 1}
    return [{**row, "activation_ratio": row["activation_bytes"] / base[row["seq_len"]]} for row in rows]


def measure_rows(steps: int) -> list[dict[str, Any]]:
    """The cpu measurement of the module docstring: (mode, peak at micro_bsz 4 and 2, their difference)."""
    rows = []
    for mode in ("none", *MODES):
        options: dict[str, Any] = {}
        if mode != "none":
            options = {"parallel.tensor.size": 2, "parallel.tensor.mode": mode}
            options |= {"parallel.mode": "ddp"} if mode == "isp" else {}
        world_size = 1 if mode == "none" else 2
        peaks = {}
        for micro_bsz in (4, 2):
            records = measure(VALIDATION_CONFIG, {**options, "data.micro_bsz": micro_bsz}, steps, world_size)
            peaks[micro_bsz] = max(record["device_peak_mem_bytes"] for record in records[1:])
        rows.append({"mode": mode, "peak_bytes": peaks, "half_micro_batch_bytes": peaks[4] - peaks[2]})
    base = rows[0]["half_micro_batch_bytes"]
    return [{**row, "activation_ratio": row["half_micro_batch_bytes"] / base} for row in rows]


def markdown(planned: list[dict[str, Any]], measured: list[dict[str, Any]], hardware: str) -> str:
    lines = [
        f"| seq_len | mode | T | device peak GiB | activations GiB | x T=1 | model state GiB | sent per "
        f"micro-batch GiB | step s ({hardware}) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in planned:
        lines.append(
            f"| {row['seq_len']} | {row['mode'] if row['tensor_size'] > 1 else '-'} | {row['tensor_size']} | "
            f"{row['device_peak_bytes'] / GIB:.1f} | {row['activation_bytes'] / GIB:.1f} | "
            f"{row['activation_ratio']:.3f} | {row['model_state_bytes'] / GIB:.1f} | "
            f"{row['collective_bytes'] / GIB:.2f} | {row['step_s']:.3g} |"
        )
    if measured:
        lines += [
            "",
            "| mode (T=2, cpu) | peak MiB, micro_bsz 4 | peak MiB, micro_bsz 2 | difference MiB | x one process |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in measured:
            peaks = row["peak_bytes"]
            lines.append(
                f"| {row['mode'] if row['mode'] != 'none' else 'one process'} | {peaks[4] / MIB:.1f} | "
                f"{peaks[2] / MIB:.1f} | {row['half_micro_batch_bytes'] / MIB:.1f} | {row['activation_ratio']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq_lens = sorted({row["seq_len"] for row in rows})
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(5 * len(seq_lens), 4), squeeze=False)
    for ax, seq_len in zip(axes[0], seq_lens, strict=True):
        base = next(r for r in rows if r["seq_len"] == seq_len and r["tensor_size"] == 1)
        for mode in MODES:
            points = [base] + [r for r in rows if r["seq_len"] == seq_len and r["mode"] == mode]
            ax.plot(
                [r["tensor_size"] for r in points], [r["device_peak_bytes"] / GIB for r in points], "o-", label=mode
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor size T")
        ax.set_ylabel("planned device peak per rank (GiB)")
        ax.set_title(f"seq_len {seq_len}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "internlm2_7b.py")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="h100")
    parser.add_argument("--measure", action="store_true", help="also measure the activation ratios at T=2 on cpu")
    parser.add_argument("--steps", type=int, default=2, help="steps per measured run (>= 2)")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "tensor_parallel")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    planned = []
    for seq_len in args.seq_lens:
        for mode, size in layouts(args.sizes):
            planned.append(plan_row(args.config, mode, size, seq_len, args.world_size, args.hardware))
            print(f"seq_len {seq_len} {mode} T={size}: {planned[-1]['device_peak_bytes'] / GIB:.1f} GiB", flush=True)
    planned = with_ratios(planned)
    measured = measure_rows(args.steps) if args.measure else []
    report = {"config": str(args.config), "world_size": args.world_size, "planned": planned, "measured": measured}
    (args.out / "tensor_parallel.json").write_text(json.dumps(report, indent=2))
    (args.out / "tensor_parallel.md").write_text(markdown(planned, measured, args.hardware))
    plot(planned, args.out / "tensor_parallel.png")
    print(markdown(planned, measured, args.hardware))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Loss curves of the precision modes on one config: fp32, bf16 with fp32 masters, pure bf16, fp16.

    python -m internlm_offload.bench.precision --out docs/results/precision [--steps 60] [--lr 2e-4]

Each mode trains `train.py` in its own process (one after the other, same seed and data); the script
writes `precision.json` (per-mode loss curves, the mean of the last 10 losses and its distance to
fp32, median step time) and `precision.png` (the curves).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODES = {
    "fp32": ["model.dtype=torch.float32"],
    "bf16+masters": ["model.dtype=torch.bfloat16"],
    "pure bf16": ["model.dtype=torch.bfloat16", "mixed_precision.master_weights=False"],
    "fp16+masters": ["model.dtype=torch.float16"],
}


def train(work_dir: Path, config: Path, options: list[str]) -> list[dict]:
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "--config",
        str(config),
        "--work-dir",
        str(work_dir),
        "--cfg-options",
        "monitor.progress_bar=off",
        "ckpt.enable_save_ckpt=False",
        *options,
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(records: list[dict], tail: int) -> dict:
    losses = [r["loss"] for r in records]
    return {
        "loss": losses,
        "tail_mean": sum(losses[-tail:]) / tail,
        "median_step_time_s": statistics.median(r["step_time_s"] for r in records),
        "skipped_steps": records[-1].get("skipped_steps", 0),
    }


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, result in results.items():
        ax.plot(range(1, len(result["loss"]) + 1), result["loss"], label=f"{name} (tail {result['tail_mean']:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "configs" / "internlm2_tiny.py")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--tail", type=int, default=10, help="the last N losses are averaged")
    p.add_argument("--out", type=Path, default=Path("precision_results"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    common = [f"data.total_steps={args.steps}", f"adam.lr={args.lr}"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in MODES.items():
            records = train(Path(tmp) / name.replace(" ", "_"), args.config, [*common, *options])
            results[name] = summarize(records, args.tail)
    base = results["fp32"]["tail_mean"]
    for result in results.values():
        result["tail_mean_minus_fp32"] = result["tail_mean"] - base
    report = {"config": str(args.config), "steps": args.steps, "lr": args.lr, "tail": args.tail, "modes": results}
    (args.out / "precision.json").write_text(json.dumps(report, indent=1))
    plot(results, args.out / "precision.png", f"{args.config.name}, lr {args.lr}, {args.steps} steps")
    for name, result in results.items():
        line = f"{name:>14}: tail mean {result['tail_mean']:.4f} ({result['tail_mean_minus_fp32']:+.4f} vs fp32)"
        sys.stdout.write(f"{line}, median step {result['median_step_time_s']:.3f} s\n")


if __name__ == "__main__":
    main()

"""The planner's choice against the device budget: predicted peak and step time as the budget shrinks.

    python -m internlm_offload.bench.planner_sweep [--config configs/planner_validation.py]
        [--fractions 1.0 0.9 ... 0.3] [--hardware h100|a100|910b | --calibrate] [--out bench_results/planner]

For each budget (a fraction of the config's baseline device peak) the search of `planner/search.py`
runs over every knob, as `tools/plan --device-memory` does, and the chosen setting's traced peak and
predicted step time are recorded. Writes `planner_sweep.json` and `planner_sweep.png`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from internlm_offload.config import load_config_file
from internlm_offload.planner.cost import HARDWARE, Hardware, calibrate
from internlm_offload.planner.knobs import activation_settings, optimizer_settings
from internlm_offload.planner.search import candidate_configs, search
from internlm_offload.planner.trace import trace_step

REPO = Path(__file__).resolve().parents[2]
FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)


def sweep(config: Path, fractions: list[float], hardware: Hardware) -> list[dict[str, Any]]:
    config_for = candidate_configs(load_config_file(config))  # the file is read once
    baseline = trace_step(config_for({})).device_peak_bytes
    cfg = config_for({})
    rows = []
    for fraction in fractions:
        budget = int(baseline * fraction)
        chosen, _ = search(
            config_for, activation_settings(cfg.model.num_layers), optimizer_settings(), hardware, budget, None
        )
        rows.append(
            {
                "fraction": fraction,
                "budget_bytes": budget,
                "chosen": chosen and chosen.name,
                "device_peak_bytes": chosen and chosen.memory.device_peak_bytes,
                "step_time_s": chosen and chosen.step_s,
            }
        )
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = [r for r in rows if r["chosen"]]
    budgets = [r["budget_bytes"] / 2**20 for r in fits]
    fig, (peak_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    peak_ax.plot(budgets, [r["device_peak_bytes"] / 2**20 for r in fits], "o-", label="chosen setting's peak")
    peak_ax.plot(budgets, budgets, "--", color="grey", label="budget")
    peak_ax.set_xlabel("device budget (MiB)")
    peak_ax.set_ylabel("predicted device peak (MiB)")
    peak_ax.legend()
    time_ax.plot(budgets, [r["step_time_s"] for r in fits], "o-")
    for r, budget in zip(fits, budgets):
        time_ax.annotate(r["chosen"], (budget, r["step_time_s"]), fontsize=7, rotation=20)
    time_ax.set_xlabel("device budget (MiB)")
    time_ax.set_ylabel("predicted step time (s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "planner_validation.py")
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="h100")
    parser.add_argument("--calibrate", action="store_true", help="this machine's throughputs instead of --hardware")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "planner")
    args = parser.parse_args(argv)
    hardware = calibrate() if args.calibrate else HARDWARE[args.hardware]
    rows = sweep(args.config, args.fractions, hardware)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner_sweep.json").write_text(
        json.dumps({"config": str(args.config), "hardware": hardware.name, "rows": rows}, indent=2)
    )
    plot(rows, args.out / "planner_sweep.png", f"{args.config.name} on {hardware.name}")
    for r in rows:
        peak = "" if r["device_peak_bytes"] is None else f"{r['device_peak_bytes'] / 2**20:.1f} MiB"
        step = "" if r["step_time_s"] is None else f"{r['step_time_s']:.4g} s"
        print(
            f"{r['fraction']:.2f} x baseline = {r['budget_bytes'] / 2**20:.1f} MiB: {r['chosen'] or 'nothing fits'} "
            f"{peak} {step}"
        )
    steps = [r["step_time_s"] for r in rows if r["step_time_s"] is not None]
    return 0 if steps == sorted(steps) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Muon on cpu: step time against torch.optim.Muon and fused AdamW, the swap tier's Muon against its copy floor.

    python -m internlm_offload.bench.muon [--quick] [--out bench_results/muon.json]

One process, one seeded set of matrices shaped as one decoder block's (q, k, v, o, gate, up, down) at `hidden`;
every configuration owns a copy and gets the same grads before every step, round-robin. `step()` is timed up to
`Accelerator.synchronize()`. `bitwise` compares the params after the last step with torch.optim.Muon's (Muon
configurations) or AdamW's. The copy floor is what the swap tier cannot go below: its states copied in and out
once each (two memcpys of the state bytes on cpu), timed alone. Not imported by the library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from internlm_offload.device import Accelerator
from internlm_offload.optim import Muon, SwapAdamW
from internlm_offload.optim.adamw import AdamW
from internlm_offload.optim.adamw_rule import ADAMW
from internlm_offload.optim.muon_rule import MUON

MUON_HYPER = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
ADAMW_HYPER = {"lr": 1e-3, "weight_decay": 0.1}
FULL = {"hidden": 256, "steps": 10, "warmup": 2}
QUICK = {"hidden": 32, "steps": 2, "warmup": 1}
Factory = Callable[[list[torch.Tensor], Accelerator], torch.optim.Optimizer]


def block_shapes(hidden: int) -> list[tuple[int, int]]:
    """One block's matrices [out, in]: q, k, v, o (GQA 2:1), gate, up, down (intermediate 8/3 hidden, rounded)."""
    inter = (8 * hidden // 3 + 15) // 16 * 16
    return [(hidden, hidden), (hidden // 2, hidden), (hidden // 2, hidden), (hidden, hidden)] + [
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ]


CONFIGS: dict[str, tuple[str, Factory]] = {  # name -> (the reference it must equal, factory)
    "torch_muon": ("torch_muon", lambda p, acc: torch.optim.Muon(p, **MUON_HYPER)),
    "muon": ("torch_muon", lambda p, acc: Muon(p, **MUON_HYPER)),
    "swap_muon_t4": (
        "torch_muon",
        lambda p, acc: SwapAdamW([{"params": p, **MUON_HYPER}], swap_optimizer_times=4, accelerator=acc, rule=MUON),
    ),
    "adamw_fused": ("adamw_fused", lambda p, acc: AdamW(p, fused=True, **ADAMW_HYPER)),
    "swap_adamw_t4": (
        "adamw_fused",
        lambda p, acc: SwapAdamW(p, fused=True, swap_optimizer_times=4, accelerator=acc, rule=ADAMW, **ADAMW_HYPER),
    ),
}


def copy_floor_ms(state_bytes: int, repeats: int) -> float:
    """Median ms of copying `state_bytes` in and out once each (the swap tier's least traffic per step)."""
    host, device = torch.empty(state_bytes, dtype=torch.uint8), torch.empty(state_bytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        device.copy_(host)
        host.copy_(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(settings: dict[str, int]) -> dict[str, Any]:
    shapes = block_shapes(settings["hidden"])
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    acc = Accelerator("cpu")
    params = {name: [torch.nn.Parameter(t.clone()) for t in initial] for name in CONFIGS}
    optimizers = {name: factory(params[name], acc) for name, (_, factory) in CONFIGS.items()}
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    order = list(CONFIGS)
    for step in range(settings["warmup"] + settings["steps"]):
        grads = [torch.randn(shape, generator=torch.Generator().manual_seed(100 + step)) for shape in shapes]
        for name in order[step % len(order) :] + order[: step % len(order)]:  # rotate who goes first
            for param, grad in zip(params[name], grads):
                param.grad = grad.clone()
            start = time.perf_counter()
            optimizers[name].step()
            acc.synchronize()
            if step >= settings["warmup"]:
                times[name].append((time.perf_counter() - start) * 1e3)
    elements = sum(t.numel() for t in initial)
    rows = {}
    for name, (reference, _) in CONFIGS.items():
        state_bytes = sum(
            t.numel() * t.element_size()
            for state in optimizers[name].state.values()
            for t in state.values()
            if t.dim() > 0
        )
        rows[name] = {
            "median_ms": statistics.median(times[name]),
            "state_bytes": state_bytes,
            "bitwise": all(torch.equal(a, b) for a, b in zip(params[name], params[reference])),
        }
        if name.startswith("swap"):
            rows[name]["copy_floor_ms"] = copy_floor_ms(state_bytes, settings["steps"])
    for optimizer in optimizers.values():
        if hasattr(optimizer, "close"):
            optimizer.close()
    acc.close_streams()
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shapes": shapes,
        "elements": elements,
        "settings": settings,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| config | median ms | state MiB | copy floor ms | bitwise |", "|---|---:|---:|---:|:-:|"]
    for name, row in result["rows"].items():
        floor = f"{row['copy_floor_ms']:.2f}" if "copy_floor_ms" in row else ""
        state = row["state_bytes"] / 2**20
        lines.append(
            f"| {name} | {row['median_ms']:.1f} | {state:.2f} | {floor} | {'yes' if row['bitwise'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny matrices, two steps: a smoke run")
    parser.add_argument("--out", default="bench_results/muon.json")
    args = parser.parse_args(argv)
    result = run(QUICK if args.quick else FULL)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))  # a tool's report, not library logging
    return 0 if all(row["bitwise"] for row in result["rows"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

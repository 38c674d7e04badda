"""Muon's communication per optimizer step against AdamW's, under FSDP2 and tensor parallel, on two gloo processes.

    python -m internlm_offload.bench.muon_comm [--quick] [--steps 10] [--out bench_results/muon_comm.json]

Launches itself under torchrun (2 processes, gloo, one thread each unless OMP_NUM_THREADS says otherwise). Each
process holds one decoder block's matrices (bench/muon.py `block_shapes`: q, k, v, o, gate, up, down) as DTensor
parameters in two layouts:

- `fsdp2`: every matrix `Shard(0)` over the two ranks (FSDP2's `fully_shard` placement);
- `tensor`: q, k, v, gate, up column-parallel (`Shard(0)`), o and down row-parallel (`Shard(1)`).

Three optimizers step each layout's copy, alternating step by step in the same processes, the first rotating:
`adamw` (this trainer's AdamW, foreach), `muon_bf16` (Muon, Newton-Schulz in bf16 as torch's) and `muon_fp32`
(`ns_dtype=torch.float32`). Every copy gets the same seeded gradients before every step. A dispatch mode counts the
functional collectives `step()` issues, the bytes each rank receives (an all-gather's output less its own
shard) and the time from each collective's call to the end of its wait (a gather waits for the slower rank too). The layout's own traffic (FSDP2's parameter all-gathers and gradient reduce-scatter, tensor parallel's
activations) is the same under every optimizer and is not counted; for scale, `fsdp2_own_bytes` gives FSDP2's per
step for these matrices in fp32 (all-gather in forward and again in backward, reduce-scatter of the gradients:
3 x 4 bytes x N (W - 1) / W per rank). Medians over the timed steps, rank 0's (a step ends in a rendezvous for
Muon). Writes JSON; no timing is asserted anywhere (the machine is shared). Not imported by the library.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from internlm_offload.bench.muon import ADAMW_HYPER, MUON_HYPER, block_shapes
from internlm_offload.bench.timing import machine, parse_worker_arguments, run_distributed
from internlm_offload.optim import Muon
from internlm_offload.optim.adamw import AdamW

REPO = Path(__file__).resolve().parents[2]
RANKS = 2
FULL = {"hidden": 512, "steps": 10, "warmup": 2}
QUICK = {"hidden": 32, "steps": 1, "warmup": 0}
ROW_PARALLEL = (3, 6)  # o and down: `block_shapes`' order
OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda p: AdamW(p, foreach=True, **ADAMW_HYPER),
    "muon_bf16": lambda p: Muon(p, **MUON_HYPER),
    "muon_fp32": lambda p: Muon(p, **MUON_HYPER, ns_dtype=torch.float32),
}
GATHER = "_c10d_functional.all_gather_into_tensor.default"
WAIT = "_c10d_functional.wait_tensor.default"
COLLECTIVES = ("all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "all_to_all_single", "broadcast")


class Collectives(TorchDispatchMode):
    """Counts each functional collective, the bytes this rank receives by all-gathers, and the seconds from each
    collective's call to the end of its wait."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.calls: Counter[str] = Counter()
        self.received = 0
        self.seconds = 0.0
        self._started: dict[int, float] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = str(func)
        namespace, op = (name.split(".") + [""])[:2]
        if namespace == "_c10d_functional" and op in COLLECTIVES:
            self.calls[op] += 1
            self._started[id(out)] = start
            if name == GATHER:
                self.received += out.numel() * out.element_size() * (self.world - 1) // self.world
        elif name == WAIT and id(args[0]) in self._started:
            self.seconds += time.perf_counter() - self._started.pop(id(args[0]))
        return out

    def take(self) -> tuple[dict[str, int], int]:
        """(calls per collective, bytes received) since the last take; `seconds` restarts too."""
        taken = dict(self.calls), self.received
        self.calls, self.received, self.seconds = Counter(), 0, 0.0
        self._started.clear()  # a collective whose wait this mode did not see: its id may come back later
        return taken


def placements(layout: str, index: int) -> list[Placement]:
    if layout == "tensor" and index in ROW_PARALLEL:
        return [Shard(1)]
    return [Shard(0)]


def sharded(tensors: list[torch.Tensor], layout: str, mesh: DeviceMesh) -> list[torch.nn.Parameter]:
    return [
        torch.nn.Parameter(distribute_tensor(t.clone(), mesh, placements(layout, i))) for i, t in enumerate(tensors)
    ]


def worker(settings: dict[str, int], out: Path) -> None:
    """One rank's part: every (layout, optimizer) alternating, rank 0 writes the JSON."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    shapes = block_shapes(settings["hidden"])
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    variants = [(layout, name) for layout in ("fsdp2", "tensor") for name in OPTIMIZERS]
    params = {v: sharded(initial, v[0], mesh) for v in variants}
    optimizers = {v: OPTIMIZERS[v[1]](params[v]) for v in variants}
    records: dict[tuple[str, str], dict[str, Any]] = {v: {"step_s": [], "collective_s": []} for v in variants}
    counter = Collectives(world)
    for index in range(settings["warmup"] + settings["steps"]):
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(100 + index)) for s in shapes]
        turn = index % len(variants)
        for variant in variants[turn:] + variants[:turn]:
            for i, (param, grad) in enumerate(zip(params[variant], grads)):
                param.grad = distribute_tensor(grad, mesh, placements(variant[0], i))
            dist.barrier()  # both ranks start each step together
            start = time.perf_counter()
            with counter:
                optimizers[variant].step()
            elapsed = time.perf_counter() - start
            gathers = counter.seconds
            calls, received = counter.take()
            if index >= settings["warmup"]:
                records[variant]["step_s"].append(elapsed)
                records[variant]["collective_s"].append(gathers)
                records[variant].update(collectives=calls, received_bytes=received)  # the same every step
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report(settings, shapes, records), indent=2) + "\n")
    dist.destroy_process_group()


def report(settings: dict[str, int], shapes: list[tuple[int, int]], records: dict) -> dict[str, Any]:
    """Environment, each variant's steps, medians, bytes, and the ratios to AdamW's step time in its layout."""
    elements = sum(a * b for a, b in shapes)
    rows = {}
    for (layout, name), record in records.items():
        medians = {f"{key}_median": statistics.median(record[key]) for key in ("step_s", "collective_s")}
        rows[f"{layout}/{name}"] = {**record, **medians}
    for key, row in rows.items():
        row["vs_adamw"] = row["step_s_median"] / rows[key.split("/")[0] + "/adamw"]["step_s_median"]
    return {
        "env": {
            **machine(),
            "ranks": RANKS,
            "backend": "gloo",
            "settings": settings,
        },
        "shapes": shapes,
        "elements": elements,
        "fsdp2_own_bytes": 3 * 4 * elements * (RANKS - 1) // RANKS,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| layout / optimizer | step ms | x AdamW | collectives | of which ms | MiB received per rank |"]
    lines.append("|---|---:|---:|---|---:|---:|")
    for key, row in result["rows"].items():
        calls = ", ".join(f"{n} {op}" for op, n in sorted(row["collectives"].items())) or "none"
        lines.append(
            f"| {key} | {row['step_s_median'] * 1e3:.1f} | {row['vs_adamw']:.2f} | {calls} | "
            f"{row['collective_s_median'] * 1e3:.1f} | {row['received_bytes'] / 2**20:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    out = REPO / "bench_results" / "muon_comm.json"
    args = parse_worker_arguments(argv, description=__doc__.split("\n")[0], out=out, full_steps=FULL["steps"])
    result = run_distributed(args, "internlm_offload.bench.muon_comm", RANKS, (QUICK, FULL), worker, REPO)
    if args.worker:
        return result
    print(table(result))  # a tool's report, not library logging
    return result


if __name__ == "__main__":
    main()

"""Expert parallel's all-to-all on gloo against the MoE block's compute, at EP=2 on two cpu processes.

    python -m internlm_offload.bench.expert_parallel [--quick] [--steps 20] [--out bench_results/expert_parallel.json]

Launches itself under torchrun (2 processes, gloo, one thread each unless OMP_NUM_THREADS says otherwise). Each
process builds the same Dropless MoE block (model/moe.py) from one seed and takes its own tokens; two variants
alternate step by step in the same processes, the first of each pair rotating:

- `ep2`: the block's experts split over the two ranks (engine/expert_parallel.py: E/2 each), rows sent to their
  expert's rank and back by torch's all_to_all_single with autograd, forward and backward;
- `ep1`: the same block with every expert on the rank, no communication: the block's compute without expert
  parallel, over the same tokens.

A step is forward, an MSE loss against a fixed target and backward. In `ep2` a dispatch mode times each
functional all-to-all from its call to the end of its wait (the four exchanges per step: dispatch, combine and
their backwards) and counts its bytes (what this rank sends to the other: the input less its own split), and the
count exchange (the (E,) token counts and the host sync that reads them) is timed apart. Medians over the steps,
rank 0's figures (both ranks' steps end together: the all-to-all is a rendezvous). `ep2`'s compute is its step
less the exchanges. Writes JSON; no timing is asserted anywhere (the machine is shared). Not imported by the
library.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from internlm_offload.bench.timing import machine, parse_worker_arguments, run_distributed
from internlm_offload.engine.expert_parallel import ExpertDispatch, apply_expert_parallel
from internlm_offload.engine.runtime import expert_mesh
from internlm_offload.model.moe import MoE

REPO = Path(__file__).resolve().parents[2]
RANKS = 2
# 8 experts top-2 of width 256 over hidden 512, 2048 tokens per rank: a Qwen3-MoE-like block at a size two shared
# cores step in well under a second.
FULL = {"tokens": 2048, "hidden": 512, "intermediate": 256, "experts": 8, "top_k": 2, "steps": 20, "warmup": 3}
QUICK = {"tokens": 64, "hidden": 32, "intermediate": 16, "experts": 4, "top_k": 2, "steps": 1, "warmup": 0}
A2A_OP = "_c10d_functional.all_to_all_single.default"
WAIT_OP = "_c10d_functional.wait_tensor.default"


@dataclass
class Exchanges(TorchDispatchMode):
    """Times each functional all-to-all from its call to the end of its wait, and counts the bytes this rank sends
    to the others (its input less the rows it keeps)."""

    rank: int
    seconds: float = 0.0
    sent_bytes: int = 0
    calls: int = 0
    _started: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func)
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if name == A2A_OP:
            x, input_splits = args[0], args[2]
            row = x[0].numel() * x.element_size() if x.shape[0] else 0
            self.sent_bytes += (x.shape[0] - input_splits[self.rank]) * row
            self.calls += 1
            self._started[id(out)] = start
        elif name == WAIT_OP and id(args[0]) in self._started:
            self.seconds += time.perf_counter() - self._started.pop(id(args[0]))
        return out

    def take(self) -> tuple[float, int, int]:
        taken = self.seconds, self.sent_bytes, self.calls
        self.seconds, self.sent_bytes, self.calls = 0.0, 0, 0
        return taken


class Block(nn.Module):
    """One MoE block as a model (`apply_expert_parallel` takes its sparse block, `moe`, as it is)."""

    def __init__(self, shape: dict[str, int]) -> None:
        super().__init__()
        self.moe = MoE(shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"], moe_type="Dropless")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def build(shape: dict[str, int], seed: int = 0) -> Block:
    """The block with seeded weights: the same on every rank (each keeps its experts' slice under EP)."""
    torch.manual_seed(seed)
    block = Block(shape)
    for p in block.parameters():
        nn.init.normal_(p, std=0.02)
    return block


def step(block: Block, x: torch.Tensor, target: torch.Tensor) -> None:
    block.zero_grad(set_to_none=True)
    F.mse_loss(block(x), target).backward()


def timed_count_exchange(variant: dict[str, Any]) -> Callable[[], None]:
    """Time `ExpertDispatch.split_sizes` (the counts' all-to-all and the host sync) into `variant`; returns the undo."""
    original = ExpertDispatch.split_sizes

    def split_sizes(self: ExpertDispatch, counts: torch.Tensor) -> tuple[list[int], list[int]]:
        start = time.perf_counter()
        try:
            return original(self, counts)
        finally:
            variant["_count_s"] += time.perf_counter() - start

    ExpertDispatch.split_sizes = split_sizes
    return lambda: setattr(ExpertDispatch, "split_sizes", original)


def worker(shape: dict[str, int], out: Path) -> None:
    """One rank's part: both variants alternating, rank 0 writes the JSON."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = expert_mesh("cpu", RANKS, RANKS)
    ep2, ep1 = build(shape), build(shape)
    apply_expert_parallel(ep2.moe, mesh)  # a sparse block alone: no tensor plan to find it through
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens
    x = torch.randn(shape["tokens"], shape["hidden"], generator=generator).requires_grad_()  # an activation
    target = torch.randn(shape["tokens"], shape["hidden"], generator=generator)
    records = {
        name: {"step_s": [], "all_to_all_s": [], "count_exchange_s": [], "_count_s": 0.0} for name in ("ep2", "ep1")
    }
    exchanges = Exchanges(rank)
    undo = timed_count_exchange(records["ep2"])
    try:
        for index in range(shape["warmup"] + shape["steps"]):
            order = [("ep2", ep2), ("ep1", ep1)]
            for name, block in order if index % 2 == 0 else order[::-1]:
                dist.barrier()  # both ranks start each step together
                record = records[name]
                record["_count_s"] = 0.0
                start = time.perf_counter()
                with exchanges:
                    step(block, x, target)
                elapsed = time.perf_counter() - start
                seconds, sent, calls = exchanges.take()
                if index >= shape["warmup"]:
                    record["step_s"].append(elapsed)
                    record["all_to_all_s"].append(seconds)
                    record["count_exchange_s"].append(record["_count_s"])
                    record.setdefault("all_to_all_bytes_sent", sent)  # the same tokens every step
                    record.setdefault("all_to_all_calls", calls)
    finally:
        undo()
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report(shape, records), indent=2))
    dist.destroy_process_group()


def report(shape: dict[str, int], records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Environment, every step's times and the medians; `ep2`'s compute is its step less the exchanges."""
    variants = {}
    for name, record in records.items():
        del record["_count_s"]
        medians = {
            f"{key}_median": statistics.median(record[key]) for key in ("step_s", "all_to_all_s", "count_exchange_s")
        }
        variants[name] = {**record, **medians}
    ep2 = variants["ep2"]
    compute = ep2["step_s_median"] - ep2["all_to_all_s_median"] - ep2["count_exchange_s_median"]
    return {
        "env": {
            **machine(),
            "ranks": RANKS,
            "backend": "gloo",
            "shape": {k: shape[k] for k in ("tokens", "hidden", "intermediate", "experts", "top_k")},
            "steps": shape["steps"],
            "warmup": shape["warmup"],
        },
        "variants": variants,
        "summary": {
            "all_to_all_bytes_per_step": ep2["all_to_all_bytes_sent"],
            "all_to_all_calls_per_step": ep2["all_to_all_calls"],
            "all_to_all_s": ep2["all_to_all_s_median"],
            "count_exchange_s": ep2["count_exchange_s_median"],
            "ep2_compute_s": compute,
            "ep2_step_s": ep2["step_s_median"],
            "ep1_step_s": variants["ep1"]["step_s_median"],
            "all_to_all_share_of_ep2_step": ep2["all_to_all_s_median"] / ep2["step_s_median"],
            "all_to_all_gb_per_s": ep2["all_to_all_bytes_sent"] / max(ep2["all_to_all_s_median"], 1e-12) / 1e9,
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    out = REPO / "bench_results" / "expert_parallel.json"
    args = parse_worker_arguments(argv, description=__doc__.split("\n")[0], out=out, full_steps=FULL["steps"])
    result = run_distributed(args, "internlm_offload.bench.expert_parallel", RANKS, (QUICK, FULL), worker, REPO)
    if args.worker:
        return result
    summary = result["summary"]
    print(
        f"EP=2 on gloo: all-to-all {summary['all_to_all_bytes_per_step'] / 2**20:.2f} MiB sent per step in "
        f"{summary['all_to_all_s'] * 1e3:.1f} ms, count exchange {summary['count_exchange_s'] * 1e3:.1f} ms, "
        f"compute {summary['ep2_compute_s'] * 1e3:.1f} ms (step {summary['ep2_step_s'] * 1e3:.1f} ms; "
        f"EP=1 step {summary['ep1_step_s'] * 1e3:.1f} ms)"
    )
    return result


if __name__ == "__main__":
    main()

"""The native MoE block against transformers' Qwen3-MoE sparse block on cpu: forward + backward time, and where
the native block spends it.

    python -m internlm_offload.bench.moe [--quick] [--out bench_results/moe.json]

Both blocks hold the same weights (transformers' fused `gate_up_proj` split into the native w1 and w3) and take
the same tokens; each step is forward, an MSE loss against a fixed target (a dense incoming gradient) and
backward. The two alternate in one process, the first of each pair rotating, and the medians are compared:
wall time, and the process's CPU time (less disturbed when other processes share the cores; with one thread
it is the step's own compute). The native block is `moe_type="Dropless"` with renormalised top-k, which is
Qwen3-MoE's computation; outputs and gradients are checked against transformers' (relative error reported).

The split of the native block's time comes from torch.profiler over extra steps: the expert matmuls are
`aten::_grouped_mm` (forward and backward, with the per-expert `mm` calls inside it); everything else in the
step (routing, permutation, combine, the SwiGLU's elementwise ops, the loss) is the rest. Not imported by the
library.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from internlm_offload.bench.timing import (
    Variant,
    add_timing_arguments,
    alternate,
    machine,
    parse_timing_arguments,
    rel_err,
    summarize,
)
from internlm_offload.model.moe import MoE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUICK = {"tokens": 64, "hidden": 32, "intermediate": 16, "experts": 8, "top_k": 2, "repeats": 2, "warmup": 1}
EXPERT_MATMUL_OP = "aten::_grouped_mm"
HF_IMPLEMENTATIONS = ("grouped_mm", "eager")  # config._experts_implementation; the first is the ratios' base


def hf_block(args: argparse.Namespace, experts_implementation: str) -> Qwen3MoeSparseMoeBlock:
    """transformers' block with seeded random weights and the given experts implementation."""
    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=64,
    )
    config._experts_implementation = experts_implementation
    hf = Qwen3MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return hf.to(DTYPES[args.dtype]).train()


def native_block(args: argparse.Namespace, hf: Qwen3MoeSparseMoeBlock) -> MoE:
    """The native block holding transformers' weights."""
    native = MoE(args.hidden, args.intermediate, args.experts, args.top_k, moe_type="Dropless")
    with torch.no_grad():
        native.router.weight.copy_(hf.gate.weight)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)
        native.experts.w1.copy_(gate)
        native.experts.w3.copy_(up)
        native.experts.w2.copy_(hf.experts.down_proj)
    return native.to(DTYPES[args.dtype]).train()


def step(block: nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward, MSE loss, backward; returns the output and the input's gradient (the params keep theirs)."""
    x = x.detach().requires_grad_(True)
    out = block(x)
    F.mse_loss(out.float(), target.float()).backward()
    return out.detach(), x.grad


def agreement(hf: Qwen3MoeSparseMoeBlock, native: MoE, x: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """Relative errors of the native block's output and gradients against transformers' (one step each)."""
    for block in (hf, native):
        block.zero_grad(set_to_none=True)
    out, x_grad = step(native, x, target)
    hf_out, hf_x_grad = step(hf, x, target)
    gate_up = torch.cat([native.experts.w1.grad, native.experts.w3.grad], dim=1)
    errors = {
        "output": rel_err(out, hf_out),
        "input_grad": rel_err(x_grad, hf_x_grad),
        "router_grad": rel_err(native.router.weight.grad, hf.gate.weight.grad),
        "gate_up_grad": rel_err(gate_up, hf.experts.gate_up_proj.grad),
        "down_grad": rel_err(native.experts.w2.grad, hf.experts.down_proj.grad),
    }
    for block in (hf, native):
        block.zero_grad(set_to_none=True)
    return errors


def profile_native(native: MoE, x: torch.Tensor, target: torch.Tensor, steps: int) -> dict[str, Any]:
    """The native block's CPU time by op over `steps` steps: the expert matmuls' share and the top ops."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(native, x, target)
            native.zero_grad(set_to_none=True)
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    matmul_us = sum(e.cpu_time_total for e in events if e.key == EXPERT_MATMUL_OP)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "steps": steps,
        "block_cpu_s_per_step": total_us / 1e6 / steps,
        "expert_matmul_share": matmul_us / total_us,
        "dispatch_and_rest_share": 1 - matmul_us / total_us,
        "top_ops_self_s_per_step": {e.key: e.self_cpu_time_total / 1e6 / steps for e in top},
    }


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """What the numbers depend on: versions, threads, cores, load, sizes."""
    return {
        **machine(transformers=True),
        "shape": {k: getattr(args, k) for k in ("tokens", "hidden", "intermediate", "experts", "top_k")},
        "dtype": args.dtype,
        "repeats": args.repeats,
        "warmup": args.warmup,
    }


def plot(records: list[dict[str, Any]], prof: dict[str, Any], path: Path) -> None:
    """Left: median step time per block (wall and CPU); right: the native block's time by op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [r["name"] for r in records]
    pos = range(len(names))
    left.bar([p - 0.2 for p in pos], [r["wall_s_median"] * 1e3 for r in records], width=0.4, label="wall")
    left.bar([p + 0.2 for p in pos], [r["cpu_s_median"] * 1e3 for r in records], width=0.4, label="process CPU")
    left.set_xticks(list(pos), names)
    left.set(ylabel="median forward + backward (ms)", title="MoE block, forward + backward")
    left.legend()
    ops = prof["top_ops_self_s_per_step"]
    right.barh(list(ops)[::-1], [s * 1e3 for s in list(ops.values())[::-1]])
    right.set(
        xlabel="self CPU ms per step", title=f"native block by op (expert matmuls {prof['expert_matmul_share']:.0%})"
    )
    right.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; `--quick` gives tiny defaults (for tests), explicit flags still win."""
    p = argparse.ArgumentParser(prog="python -m internlm_offload.bench.moe", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=192, help="expert width (Qwen3-30B-A3B: 768 at hidden 2048)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled native steps (>= 1)")
    add_timing_arguments(p, out="bench_results/moe.json", repeats=9, unit="block")
    return parse_timing_arguments(p, argv, QUICK, at_least_one=("profile_steps",))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Check agreement, time both blocks alternated, profile the native one, write JSON + PNG, print a table."""
    args = parse_args(argv)
    # transformers' models pick "grouped_mm" where torch has it (so on cpu here); a standalone block built
    # without a model runs its "eager" loop over experts. Both are timed; ratios are against the first.
    hf = {impl: hf_block(args, impl) for impl in HF_IMPLEMENTATIONS}
    native = native_block(args, hf["grouped_mm"])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=gen).to(DTYPES[args.dtype])
    target = torch.randn(1, args.tokens, args.hidden, generator=gen)
    errors = {impl: agreement(block, native, x, target) for impl, block in hf.items()}
    blocks = {f"transformers_{impl}": block for impl, block in hf.items()} | {"native": native}
    variants = [Variant(name, lambda b=block: step(b, x, target), block) for name, block in blocks.items()]
    alternate(variants, args.warmup, args.repeats)
    prof = profile_native(native, x, target, args.profile_steps)
    records = [summarize(v, variants[0]) for v in variants]
    result = {"env": environment(args), "results": records, "relative_error": errors, "native_profile": prof}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(records, prof, args.out.with_suffix(".png"))
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    """The summary on stdout."""
    print(f"{'block':<26}{'wall ms':>9}{'ratio':>7}{'cpu ms':>9}{'ratio':>7}")
    for r in result["results"]:
        print(
            f"{r['name']:<26}{r['wall_s_median'] * 1e3:>9.1f}{r['ratio_wall']:>7.2f}"
            f"{r['cpu_s_median'] * 1e3:>9.1f}{r['ratio_cpu']:>7.2f}"
        )
    prof = result["native_profile"]
    print(f"native: expert matmuls {prof['expert_matmul_share']:.1%} of its profiled CPU time, the rest (routing,")
    print(f"permutation, combine, SwiGLU elementwise, loss) {prof['dispatch_and_rest_share']:.1%}")
    worst = max(e for errors in result["relative_error"].values() for e in errors.values())
    print(f"max relative error vs transformers: {worst:.2e}")


if __name__ == "__main__":
    main()

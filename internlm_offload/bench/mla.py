"""The native DeepSeek-V3 decoder block (multi-head latent attention, then a dense-first SwiGLU or the bias-routed
mixture of experts) against transformers' `DeepseekV3DecoderLayer` on cpu: forward + backward time, and where
each spends it.

    python -m internlm_offload.bench.mla [--quick] [--blocks dense sparse] [--out bench_results/mla.json]

Both blocks hold the same weights: transformers' layer is drawn from a seed and its state dict is read into the
native block through the family's own name table (`deepseek_v3/hf_names.py` `HF_MLA_MOE`; transformers' in-memory
stacked `gate_up_proj` split into the native w1 and w3, as its folders store them apart). They take the same
hidden states and the same (cos, sin), computed once outside the step as a decoder computes them once for all its
blocks, and attend causally over one document per row (transformers' sdpa with no mask, the native `attend` with
no documents: `is_causal` in both). A step is forward and backward of a fixed random output gradient. Before any
timing the output, the input's gradient and every parameter's gradient are compared and the run stops when one's
relative error (|native - transformers| / |transformers|) is over `--tolerance` (1e-5; bf16: 0.1).

The variants alternate in one process, the first of each round rotating; medians of wall time and of the
process's CPU time (with one thread, the step's own compute; less disturbed by other jobs than the wall time) and
their ratios to transformers' are recorded. torch.profiler then splits a few alternated steps of each by op (self
CPU time): `aten::mm` / `aten::bmm` / `aten::_grouped_mm` are the matrix products, the rest is everything around
them. Not imported by the library.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from internlm_offload.bench.timing import (
    Variant,
    add_timing_arguments,
    alternate,
    machine,
    parse_timing_arguments,
    rel_err,
    summarize,
)
from internlm_offload.model.decoder import DecoderLayer
from internlm_offload.model.families.deepseek_v3.args import args_from_config
from internlm_offload.model.families.deepseek_v3.hf_names import HF_MLA_MOE
from internlm_offload.model.families.deepseek_v3.model import build_attention, build_feed_forward
from internlm_offload.model.rope import rope_cos_sin, rope_from_parameters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCKS = ("dense", "sparse")  # block 0 (first_k_dense_replace = 1) and block 1
SHAPE_KEYS = (
    "seq", "batch", "hidden", "heads", "q_lora", "kv_lora", "nope", "rope", "v", "intermediate", "experts", "top_k",
    "moe_intermediate", "shared",
)  # fmt: skip
QUICK = {
    "seq": 32, "batch": 1, "hidden": 64, "heads": 4, "q_lora": 24, "kv_lora": 16, "nope": 8, "rope": 8, "v": 8,
    "intermediate": 96, "experts": 8, "top_k": 2, "moe_intermediate": 16, "shared": 1, "repeats": 2, "warmup": 1,
    "profile_steps": 1,
}  # fmt: skip
MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::_grouped_mm", "aten::addmm")
LAYER = "model.layers.{}."  # transformers' prefix of block i's names in its folders


def hf_config(args: argparse.Namespace) -> Any:
    """transformers' DeepseekV3Config of the bench's shape: block 0 dense, block 1 sparse, one group of experts."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=2,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        n_shared_experts=args.shared,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=args.q_lora,
        kv_lora_rank=args.kv_lora,
        qk_nope_head_dim=args.nope,
        qk_rope_head_dim=args.rope,
        v_head_dim=args.v,
        max_position_embeddings=max(4096, args.seq),
        attn_implementation="sdpa",
    )
    config._experts_implementation = "grouped_mm"  # what its models pick where torch has the grouped GEMM
    return config


def hf_layer(config: Any, index: int, dtype: torch.dtype) -> nn.Module:
    """transformers' block `index` with seeded random weights (norms around 1) and a random router bias."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    layer = DeepseekV3DecoderLayer(config, index)
    gen = torch.Generator().manual_seed(index)
    with torch.no_grad():
        for name, tensor in layer.state_dict().items():
            noise = torch.randn(tensor.shape, generator=gen)
            if "norm" in name:
                tensor.copy_(1 + 0.1 * noise)
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.01 * noise)
            else:
                tensor.copy_(noise * tensor.shape[-1] ** -0.5)
    return layer.to(dtype).train()


def native_names(tensors: Mapping[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """transformers' tensors of block `index` (its state dict, or its gradients) under the native names: the
    family's table, the stacked experts split."""
    out = {}
    prefix = f"layers.{index}."
    for name, tensor in tensors.items():
        if name == "mlp.experts.gate_up_proj":  # (E, 2 I, H): gate rows first, then up
            out["feed_forward.experts.w1"], out["feed_forward.experts.w3"] = tensor.chunk(2, dim=1)
            continue
        if name == "mlp.experts.down_proj":
            out["feed_forward.experts.w2"] = tensor
            continue
        native = HF_MLA_MOE.to_native(LAYER.format(index) + name)
        if native is None or not native.startswith(prefix):
            raise KeyError(f"{name}: not in the family's name table")
        out[native.removeprefix(prefix)] = tensor
    return out


def native_layer(config: Any, hf: nn.Module, index: int, dtype: torch.dtype) -> DecoderLayer:
    """The native block `index` as the family builds it, holding transformers' weights (strict load)."""
    args = args_from_config(config)
    layer = DecoderLayer(
        args.hidden_size, args.rms_norm_eps, build_attention(args, "sdpa", index), build_feed_forward(args, index)
    )
    layer.load_state_dict(native_names(hf.state_dict(), index), strict=True)
    return layer.to(dtype).train()


def ropes(config: Any, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(transformers' cos, sin) and (the native decoder's) for positions 0..T-1 in x's dtype."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    T = x.shape[1]
    theirs = DeepseekV3RotaryEmbedding(config)(x, torch.arange(T)[None])
    make, attention_factor = rope_from_parameters(config.rope_parameters, config.max_position_embeddings)
    inv_freq = make(config.qk_rope_head_dim, config.rope_parameters["rope_theta"], None)
    ours = rope_cos_sin(inv_freq, T, x.dtype, None, attention_factor)
    return theirs, ours


def step_fn(block: nn.Module, call: Callable, x: torch.Tensor, grad_out: torch.Tensor) -> Callable:
    """A step: forward of `call(block, x)`, backward of `grad_out`; returns the output and the input's gradient."""

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        xx = x.detach().requires_grad_(True)
        out = call(block, xx)
        out.backward(grad_out)
        return out.detach(), xx.grad

    return step


def pair(args: argparse.Namespace, kind: str) -> tuple[Variant, Variant]:
    """(transformers', native) variants of block kind `kind` on the same weights, tokens and output gradient."""
    dtype = DTYPES[args.dtype]
    config = hf_config(args)
    index = BLOCKS.index(kind)
    hf = hf_layer(config, index, dtype)
    native = native_layer(config, hf, index, dtype)
    gen = torch.Generator().manual_seed(100 + index)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(dtype)
    grad_out = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(dtype)
    hf_rope, rope = ropes(config, x)
    theirs = step_fn(hf, lambda b, h: b(h, attention_mask=None, position_embeddings=hf_rope), x, grad_out)
    ours = step_fn(native, lambda b, h: b(h, rope, None), x, grad_out)
    return Variant(f"transformers_{kind}", theirs, hf), Variant(f"native_{kind}", ours, native)


def agreement(hf: Variant, native: Variant, kind: str) -> dict[str, float]:
    """Relative errors of output, input gradient and parameter gradients (the worst) after one step each."""
    out_hf, dx_hf = hf.step()
    out_n, dx_n = native.step()
    grads = native_names({name: p.grad for name, p in hf.block.named_parameters()}, BLOCKS.index(kind))
    params = dict(native.block.named_parameters())
    worst = max(rel_err(params[name].grad, grad) for name, grad in grads.items())
    for v in (hf, native):
        v.block.zero_grad(set_to_none=True)
    return {"output": rel_err(out_n, out_hf), "input_grad": rel_err(dx_n, dx_hf), "param_grads": worst}


def profile_variants(variants: list[Variant], steps: int) -> dict[str, dict[str, Any]]:
    """Self CPU time per step by op of each variant: `steps` profiled steps each, alternating as the timed ones do
    (a profile of one step swings with the other jobs on the machine); the matrix products' share and the top ops."""
    totals: dict[str, dict[str, float]] = {v.name: {} for v in variants}
    for rep in range(steps):
        k = rep % len(variants)
        for v in variants[k:] + variants[:k]:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                v.step()
                v.block.zero_grad(set_to_none=True)
            for event in prof.key_averages():
                totals[v.name][event.key] = totals[v.name].get(event.key, 0.0) + event.self_cpu_time_total
    return {name: op_split(ops, steps) for name, ops in totals.items()}


def op_split(self_us: dict[str, float], steps: int) -> dict[str, Any]:
    """The record of one variant's profile: self CPU microseconds by op over `steps` steps."""
    total_us = sum(self_us.values())
    matmul_us = sum(us for op, us in self_us.items() if op in MATMUL_OPS)
    top = sorted(self_us, key=lambda op: -self_us[op])[:12]
    return {
        "steps": steps,
        "cpu_s_per_step": total_us / 1e6 / steps,
        "matmul_share": matmul_us / total_us,
        "top_ops_self_s_per_step": {op: self_us[op] / 1e6 / steps for op in top},
    }


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """What the numbers depend on: versions, threads, cores, load, sizes."""
    return {
        **machine(transformers=True),
        "shape": {k: getattr(args, k) for k in SHAPE_KEYS},
        "blocks": args.blocks,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "warmup": args.warmup,
    }


def plot(records: list[dict[str, Any]], profiles: dict[str, dict[str, Any]], path: Path) -> None:
    """Left: median process CPU time per block, its timed steps' range as a bar; right: the profiler's self time by
    op of the first kind's two blocks (the profiler times an op on its thread's clock: it swings with the load, so
    read the proportions)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    names = [r["name"] for r in records]
    pos = list(range(len(names)))
    medians = [r["cpu_s_median"] * 1e3 for r in records]
    spread = [[m - min(r["cpu_s"]) * 1e3 for m, r in zip(medians, records, strict=True)],
              [max(r["cpu_s"]) * 1e3 - m for m, r in zip(medians, records, strict=True)]]  # fmt: skip
    colors = ["tab:blue" if n.startswith("transformers") else "tab:orange" for n in names]
    left.bar(pos, medians, yerr=spread, capsize=4, color=colors)
    for p, r in zip(pos, records, strict=True):
        left.annotate(f"{r['ratio_cpu']:.2f}x", (p, r["cpu_s_median"] * 1e3), ha="center", va="bottom",
                      xytext=(12, 2), textcoords="offset points")  # fmt: skip
    left.set_xticks(pos, [n.replace("_", "\n") for n in names])
    left.set(ylabel="process CPU ms, forward + backward", title="DeepSeek-V3 block: median (range), x transformers'")
    hf_name, native_name = names[0], names[1]
    tops = [profiles[n]["top_ops_self_s_per_step"] for n in (hf_name, native_name)]
    ops = sorted(dict.fromkeys([*tops[0], *tops[1]]), key=lambda op: -max(t.get(op, 0) for t in tops))[:10]
    ys = range(len(ops))
    for offset, name, top in ((-0.2, hf_name, tops[0]), (0.2, native_name, tops[1])):
        right.barh([y + offset for y in ys], [top.get(op, 0) * 1e3 for op in ops], height=0.4, label=name)
    right.set_yticks(list(ys), ops)
    right.invert_yaxis()
    right.set_xscale("log")
    right.set(xlabel="profiler self time per step, ms (log)", title=f"{hf_name.split('_')[-1]} block by op")
    right.tick_params(axis="y", labelsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; `--quick` gives tiny defaults (for tests), explicit flags still win."""
    p = argparse.ArgumentParser(prog="python -m internlm_offload.bench.mla", description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--q-lora", type=int, default=384, help="q_lora_rank (DeepSeek-V3: 1536 at hidden 7168)")
    p.add_argument("--kv-lora", type=int, default=256, help="kv_lora_rank (DeepSeek-V3: 512)")
    p.add_argument("--nope", type=int, default=64, help="qk_nope_head_dim")
    p.add_argument("--rope", type=int, default=32, help="qk_rope_head_dim")
    p.add_argument("--v", type=int, default=64, help="v_head_dim")
    p.add_argument("--intermediate", type=int, default=2816, help="the dense block's SwiGLU width")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=256, help="each expert's width (and the shared one's)")
    p.add_argument("--shared", type=int, default=1, help="n_shared_experts")
    p.add_argument("--blocks", nargs="+", choices=BLOCKS, default=list(BLOCKS))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "--tolerance", type=float, default=1e-5, help="largest relative error (output, gradients) allowed before timing"
    )
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per block (>= 1)")
    p.add_argument("--plot", type=Path, default=None, help="the PNG (default: --out with .png)")
    add_timing_arguments(p, out="bench_results/mla.json", repeats=9, unit="block")
    return parse_timing_arguments(p, argv, QUICK, at_least_one=("profile_steps",))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Check agreement, time each kind's two blocks alternated, profile them, write JSON + PNG, print a table."""
    args = parse_args(argv)
    pairs = {kind: pair(args, kind) for kind in args.blocks}
    errors = {kind: agreement(hf, native, kind) for kind, (hf, native) in pairs.items()}
    tolerance = args.tolerance if args.dtype == "float32" else 1e-1
    bad = {kind: e for kind, e in errors.items() if max(e.values()) > tolerance}
    if bad:
        raise SystemExit(f"the native block disagrees with transformers' (relative error over {tolerance:g}): {bad}")
    variants = [v for hf_native in pairs.values() for v in hf_native]
    alternate(variants, args.warmup, args.repeats)
    records = [summarize(v, pairs[kind][0]) for kind in pairs for v in pairs[kind]]
    profiles = profile_variants(variants, args.profile_steps)
    result = {"env": environment(args), "results": records, "relative_error": errors, "profiles": profiles}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(records, profiles, args.plot or args.out.with_suffix(".png"))
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    """The summary on stdout."""
    print(f"{'block':<24}{'cpu ms':>9}{'ratio':>7}{'wall ms':>9}{'ratio':>7}{'matmuls':>9}")
    for r in result["results"]:
        share = result["profiles"][r["name"]]["matmul_share"]
        print(
            f"{r['name']:<24}{r['cpu_s_median'] * 1e3:>9.1f}{r['ratio_cpu']:>7.3f}"
            f"{r['wall_s_median'] * 1e3:>9.1f}{r['ratio_wall']:>7.3f}{share:>9.1%}"
        )
    worst = max(e for errors in result["relative_error"].values() for e in errors.values())
    print(f"max relative error against transformers (output, gradients): {worst:.2e}")


if __name__ == "__main__":
    main()

"""The native Gated DeltaNet layer (`model/gated_deltanet.py`) against transformers' `Qwen3NextGatedDeltaNet` (its
torch fallback: the chunked rule in torch, as on cpu without flash-linear-attention) on cpu: forward + backward time.

    python -m internlm_offload.bench.gated_deltanet [--quick] [--seqs 1024 4096] [--out bench_results/gated_deltanet.json]

Both layers hold the same weights (transformers' layer drawn from a seed, its gated norm's weight perturbed off 1;
the native layer reads its state dict, `conv1d.weight` as `conv_weight`) and take the same tokens, one document a
row (transformers' torch path cannot keep packed documents apart). The default shape is Qwen3.5-35B-A3B's linear
attention (hidden 2048, 16 key heads and 32 value heads of 128). A step is forward and backward of a fixed random
output gradient. Before any timing the output, the input's gradient and every parameter's gradient are compared
and the run stops when one's relative error (|native - transformers| / |transformers|) is over `--tolerance`.

Every variant (each layer at each length) alternates in one process, the first of each round rotating
(`bench/timing.py`); medians of wall time and of the process's CPU time and their ratios to transformers' at the
same length are recorded. Not imported by the library.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from internlm_offload.bench.timing import (
    Variant,
    add_timing_arguments,
    alternate,
    machine,
    parse_timing_arguments,
    rel_err,
    summarize,
)
from internlm_offload.model.gated_deltanet import GatedDeltaNet

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHAPE_KEYS = ("batch", "hidden", "key_heads", "value_heads", "key_dim", "value_dim")
QUICK = {
    "seqs": [70, 130], "batch": 1, "hidden": 32, "key_heads": 2, "value_heads": 4, "key_dim": 8, "value_dim": 6,
    "repeats": 2, "warmup": 1,
}  # fmt: skip
RENAMES = {"conv1d.weight": "conv_weight"}  # transformers' name -> the native one; the rest are the same


def hf_layer(args: argparse.Namespace, dtype: torch.dtype) -> nn.Module:
    """transformers' Qwen3-Next linear-attention layer with its own init from a fixed seed (A_log = log U(0.01, 16),
    dt_bias 1), the gated norm's weight drawn around 1."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(
        hidden_size=args.hidden,
        linear_num_key_heads=args.key_heads,
        linear_num_value_heads=args.value_heads,
        linear_key_head_dim=args.key_dim,
        linear_value_head_dim=args.value_dim,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(config, 0)
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
    return layer.to(dtype).train()


def native_layer(args: argparse.Namespace, hf: nn.Module, dtype: torch.dtype) -> GatedDeltaNet:
    """The native layer in Qwen3-Next's fused layout holding transformers' weights (strict load)."""
    layer = GatedDeltaNet(args.hidden, args.key_heads, args.value_heads, args.key_dim, args.value_dim, fused=True)
    layer.load_state_dict({RENAMES.get(k, k): t for k, t in hf.state_dict().items()}, strict=True)
    return layer.to(dtype).train()


def step_fn(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    """A step: forward of x, backward of `grad_out`; returns the output and the input's gradient."""

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        xx = x.detach().requires_grad_(True)
        out = layer(xx)
        out.backward(grad_out)
        return out.detach(), xx.grad

    return step


def pair(args: argparse.Namespace, seq: int) -> tuple[Variant, Variant]:
    """(transformers', native) variants at `seq` tokens a row on the same weights, tokens and output gradient."""
    dtype = DTYPES[args.dtype]
    hf = hf_layer(args, dtype)
    native = native_layer(args, hf, dtype)
    gen = torch.Generator().manual_seed(seq)
    x = torch.randn(args.batch, seq, args.hidden, generator=gen).to(dtype)
    grad_out = torch.randn(args.batch, seq, args.hidden, generator=gen).to(dtype)
    return (
        Variant(f"transformers_{seq}", step_fn(hf, x, grad_out), hf),
        Variant(f"native_{seq}", step_fn(native, x, grad_out), native),
    )


def agreement(hf: Variant, native: Variant) -> dict[str, float]:
    """Relative errors of output, input gradient and parameter gradients (the worst) after one step each."""
    out_hf, dx_hf = hf.step()
    out_n, dx_n = native.step()
    params = dict(native.block.named_parameters())
    worst = max(rel_err(params[RENAMES.get(k, k)].grad, p.grad) for k, p in hf.block.named_parameters())
    for v in (hf, native):
        v.block.zero_grad(set_to_none=True)
    return {"output": rel_err(out_n, out_hf), "input_grad": rel_err(dx_n, dx_hf), "param_grads": worst}


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """What the numbers depend on: versions, threads, cores, load, sizes."""
    return {
        **machine(transformers=True),
        "shape": {k: getattr(args, k) for k in SHAPE_KEYS},
        "seqs": args.seqs,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "warmup": args.warmup,
    }


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Median process CPU time per variant, the timed steps' range as a bar, the ratio to transformers' above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["name"] for r in records]
    pos = list(range(len(names)))
    medians = [r["cpu_s_median"] for r in records]
    spread = [[m - min(r["cpu_s"]) for m, r in zip(medians, records, strict=True)],
              [max(r["cpu_s"]) - m for m, r in zip(medians, records, strict=True)]]  # fmt: skip
    colors = ["tab:blue" if n.startswith("transformers") else "tab:orange" for n in names]
    ax.bar(pos, medians, yerr=spread, capsize=4, color=colors)
    for p, r in zip(pos, records, strict=True):
        ax.annotate(f"{r['ratio_cpu']:.2f}x", (p, r["cpu_s_median"]), ha="center", va="bottom",
                    xytext=(12, 2), textcoords="offset points")  # fmt: skip
    ax.set_xticks(pos, [n.replace("_", "\n") + " tokens" for n in names])
    ax.set(ylabel="process CPU s, forward + backward", title="Gated DeltaNet layer: median (range), x transformers'")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; `--quick` gives tiny defaults (for tests), explicit flags still win."""
    p = argparse.ArgumentParser(
        prog="python -m internlm_offload.bench.gated_deltanet", description=__doc__.split("\n")[0]
    )
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096], help="tokens a row, one pair each")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--key-dim", type=int, default=128)
    p.add_argument("--value-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest relative error allowed (fp32; bf16: 0.1)")
    p.add_argument("--plot", type=Path, default=None, help="the PNG (default: --out with .png)")
    add_timing_arguments(p, out="bench_results/gated_deltanet.json", repeats=5)
    return parse_timing_arguments(p, argv, QUICK)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Check agreement, time every length's two layers alternated, write JSON + PNG, print a table."""
    args = parse_args(argv)
    pairs = {seq: pair(args, seq) for seq in args.seqs}
    errors = {str(seq): agreement(hf, native) for seq, (hf, native) in pairs.items()}
    tolerance = args.tolerance if args.dtype == "float32" else 1e-1
    bad = {seq: e for seq, e in errors.items() if max(e.values()) > tolerance}
    if bad:
        raise SystemExit(f"the native layer disagrees with transformers' (relative error over {tolerance:g}): {bad}")
    alternate([v for hf_native in pairs.values() for v in hf_native], args.warmup, args.repeats)
    records = [summarize(v, hf) for hf, native in pairs.values() for v in (hf, native)]
    result = {"env": environment(args), "results": records, "relative_error": errors}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(records, args.plot or args.out.with_suffix(".png"))
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    """The summary on stdout."""
    print(f"{'layer_tokens':<22}{'cpu s':>9}{'ratio':>7}{'wall s':>9}{'ratio':>7}")
    for r in result["results"]:
        print(
            f"{r['name']:<22}{r['cpu_s_median']:>9.3f}{r['ratio_cpu']:>7.3f}"
            f"{r['wall_s_median']:>9.3f}{r['ratio_wall']:>7.3f}"
        )
    worst = max(e for errors in result["relative_error"].values() for e in errors.values())
    print(f"max relative error against transformers (output, gradients): {worst:.2e}")


if __name__ == "__main__":
    main()

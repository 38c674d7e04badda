"""The Gated DeltaNet layer with flash-linear-attention's kernels against the same layer on torch's ops (the
reference path), same weights, on cuda: relative error of the output and of every weight gradient, then forward +
backward alternated (medians, ratio to torch's). Packed rows (two documents a row) so `cu_seqlens` is exercised.
Writes JSON; exits 1 past `TOLERANCE`. Needs cuda and `flash-linear-attention` (scripts/gpu_check_fla.sh); elsewhere it stops in one line.

    python -m internlm_offload.bench.fla_kernels --seqs 4096 16384 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from internlm_offload.bench.timing import (
    Variant,
    add_timing_arguments,
    alternate,
    machine,
    parse_timing_arguments,
    rel_err,
    summarize,
)
from internlm_offload.device import Accelerator
from internlm_offload.model.attention import Documents
from internlm_offload.model.fla_kernels import fla_chunk_gated_delta_rule
from internlm_offload.model.gated_deltanet import GatedDeltaNet

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the largest relative error passed per dtype: fla's kernels run the rule in fp32 with tf32 dots
TOLERANCE = {"float32": 5e-3, "bfloat16": 5e-2}
QUICK = {"seqs": [256], "hidden": 256, "key_heads": 2, "value_heads": 4, "repeats": 1}


def layers(args: argparse.Namespace, device: torch.device) -> tuple[GatedDeltaNet, GatedDeltaNet]:
    """The torch-path layer and a copy of it that takes fla's kernels."""
    torch.manual_seed(0)
    dims = (args.hidden, args.key_heads, args.value_heads, args.key_dim, args.value_dim)
    reference = GatedDeltaNet(*dims, attn_impl="sdpa")
    for param, init in reference.param_inits(0.02, 0.02):
        init(param.data)
    reference = reference.to(device=device, dtype=DTYPES[args.dtype])
    kernel = GatedDeltaNet(*dims, attn_impl="auto").to(device=device, dtype=DTYPES[args.dtype])
    kernel.load_state_dict(reference.state_dict())
    return reference, kernel


def packed_documents(seq: int, device: torch.device) -> Documents:
    """One row of two documents, a third and two thirds of it."""
    first = seq // 3
    return Documents(torch.cat([torch.arange(first), torch.arange(seq - first)]).unsqueeze(0).to(device))


def agreement(reference: GatedDeltaNet, kernel: GatedDeltaNet, x: torch.Tensor, documents: Documents) -> dict:
    """Relative error of the kernel path's output and gradients against the torch path's."""
    results = []
    for layer in (reference, kernel):
        layer.zero_grad(set_to_none=True)
        out = layer(x, documents=documents)
        out.float().square().mean().backward()
        results.append((out, {n: p.grad for n, p in layer.named_parameters()}))
    (ref, ref_grads), (out, grads) = results
    errors = {"output": rel_err(out, ref)}
    errors |= {f"grad.{name}": rel_err(grads[name], grad) for name, grad in ref_grads.items()}
    return errors


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; `--quick` gives tiny defaults, explicit flags still win."""
    p = argparse.ArgumentParser(prog="python -m internlm_offload.bench.fla_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384], help="tokens a row")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--key-dim", type=int, default=128)
    p.add_argument("--value-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda")
    add_timing_arguments(p, out="bench_results/fla_kernels.json", repeats=9)
    return parse_timing_arguments(p, argv, QUICK)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Check agreement and time both paths at each length; write JSON, print a table."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or fla_chunk_gated_delta_rule() is None:
        raise SystemExit(f"--device={args.device}: this bench needs cuda and flash-linear-attention installed")
    acc = Accelerator(device.type)
    reference, kernel = layers(args, device)
    records, errors = [], {}
    for seq in args.seqs:
        x = torch.randn(1, seq, args.hidden, device=device, dtype=DTYPES[args.dtype])
        documents = packed_documents(seq, device)
        errors[str(seq)] = agreement(reference, kernel, x, documents)

        def step(layer: GatedDeltaNet, x: torch.Tensor = x, documents: Documents = documents) -> None:
            layer(x, documents=documents).float().square().mean().backward()
            acc.synchronize()

        pair = [
            Variant(f"{name}_{seq}", lambda lay=lay: step(lay), lay)
            for name, lay in (("torch", reference), ("fla", kernel))
        ]
        alternate(pair, args.warmup, args.repeats)
        records += [summarize(v, pair[0]) for v in pair]
    result = {
        "env": {**machine(), "device": args.device, "dtype": args.dtype},
        "results": records,
        "relative_error": errors,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for r in records:
        print(f"{r['name']:<14} wall {r['wall_s_median'] * 1e3:8.2f} ms  x{r['ratio_wall']:.3f}")
    worst = {seq: max(e.values()) for seq, e in errors.items()}
    print("largest relative error:", worst)
    if max(worst.values()) > TOLERANCE[args.dtype]:
        raise SystemExit(f"fla's kernels disagree with the torch path beyond {TOLERANCE[args.dtype]:g}: {worst}")
    return result


if __name__ == "__main__":
    main()

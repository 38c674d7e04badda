"""DeepSeek Sparse Attention's block (model/dsa.py) against dense MLA (model/mla.py) and transformers'
`GlmMoeDsaAttention` on the same weights, on cpu: forward + backward time and the bytes saved for backward, at
sequences `--ratios` times the top-k (default 4x and 16x).

    python -m internlm_offload.bench.dsa [--quick] [--out bench_results/dsa.json]

transformers' block is drawn from a seed (its indexer too) and its state dict read into the native ones (the same
names; dense MLA takes all but the indexer). All take the same hidden states and (cos, sin) over one document per
row; transformers attends through sdpa with its top-k scattered into a boolean mask (dense work, sparse result), the
native DSA block through the chunked sparse kernel, dense MLA over every key. Before any timing the DSA block's
output and input gradient are compared with transformers' and the run stops when the relative error is over 1e-5.
A step is forward and backward of a fixed random output gradient; the variants alternate in one process; medians of
wall and process CPU time, their ratios to dense MLA's. The saved bytes are every distinct storage the step's autograd
graph holds (torch.autograd.graph.saved_tensors_hooks). Not imported by the library.
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
from torch import nn

from internlm_offload.model.attention import Documents
from internlm_offload.model.dsa import SparseLatentAttention
from internlm_offload.model.indexer import LightningIndexer
from internlm_offload.model.mla import MultiLatentAttention
from internlm_offload.model.rope import rope_cos_sin, rope_inv_freq

FULL = {"hidden": 512, "heads": 8, "q_lora": 128, "kv_lora": 64, "nope": 32, "rope": 16, "v": 32, "index_heads": 8,
        "index_dim": 64, "topk": 128, "repeats": 3}  # fmt: skip
QUICK = {**FULL, "hidden": 64, "heads": 4, "q_lora": 24, "kv_lora": 16, "index_heads": 4, "index_dim": 16, "topk": 8,
         "repeats": 1}  # fmt: skip
ROPE_THETA = 10000.0


def hf_attention(shape: dict[str, int]) -> nn.Module:
    """transformers' GLM-5 attention block of `shape`, every weight drawn from seed 0 (norms around 1)."""
    import transformers
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa

    config = transformers.GlmMoeDsaConfig(
        hidden_size=shape["hidden"], num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
        q_lora_rank=shape["q_lora"], kv_lora_rank=shape["kv_lora"], qk_nope_head_dim=shape["nope"],
        qk_rope_head_dim=shape["rope"], v_head_dim=shape["v"], index_topk=shape["topk"],
        index_n_heads=shape["index_heads"], index_head_dim=shape["index_dim"], num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    block = modeling_glm_moe_dsa.GlmMoeDsaAttention(config, layer_idx=0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return block


def native_blocks(shape: dict[str, int], hf: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(DSA block, dense MLA) holding transformers' weights."""
    mla = {
        "hidden_size": shape["hidden"], "n_heads": shape["heads"], "q_lora_rank": shape["q_lora"],
        "kv_lora_rank": shape["kv_lora"], "qk_nope_head_dim": shape["nope"], "qk_rope_head_dim": shape["rope"],
        "v_head_dim": shape["v"], "attn_impl": "sdpa",
    }  # fmt: skip
    indexer = LightningIndexer(
        hidden_size=shape["hidden"],
        q_lora_rank=shape["q_lora"],
        n_heads=shape["index_heads"],
        head_dim=shape["index_dim"],
        rope_dim=shape["rope"],
        rope_interleave=True,
        topk=shape["topk"],
    )
    dsa = SparseLatentAttention(layer=0, source=0, indexer=indexer, topk=shape["topk"], **mla)
    dsa.load_state_dict(hf.state_dict())
    dense = MultiLatentAttention(**mla)
    dense.load_state_dict({k: v for k, v in hf.state_dict().items() if not k.startswith("indexer.")})
    return dsa, dense


def calls(shape: dict[str, int], seq: int, hf: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each variant's forward of (1, seq, hidden) hidden states over one causal document."""
    dsa, dense = native_blocks(shape, hf)
    positions = torch.arange(seq)[None]
    rope = rope_cos_sin(rope_inv_freq(shape["rope"], ROPE_THETA), seq, torch.float32, positions)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    return {
        "dense_mla": lambda x: dense(x, rope, Documents(positions)),
        "native_dsa": lambda x: dsa(x, rope, Documents(positions)),
        "transformers_dsa": lambda x: hf(x, position_embeddings=rope, attention_mask=mask)[0],
    }


def step(call: Callable, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward; the output and the input's gradient."""
    x = x.detach().requires_grad_()
    out = call(x)
    out.backward(grad)
    return out.detach(), x.grad


def saved_bytes(call: Callable, x: torch.Tensor) -> int:
    """The bytes of every distinct storage the forward saves for backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call(x.detach().requires_grad_())
    return sum(seen.values())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def run_sequence(shape: dict[str, int], seq: int) -> dict[str, Any]:
    """One sequence length: the agreement, then each variant's medians and saved bytes."""
    hf = hf_attention(shape)
    variants = calls(shape, seq, hf)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(1, seq, shape["hidden"], generator=gen), torch.randn(1, seq, shape["hidden"], generator=gen)
    (out, dx), (want, want_dx) = step(variants["native_dsa"], x, grad), step(variants["transformers_dsa"], x, grad)
    errors = {"output": rel_err(out, want), "input_grad": rel_err(dx, want_dx)}
    if max(errors.values()) > 1e-5:
        raise SystemExit(f"seq {seq}: the DSA block is not transformers' (relative errors {errors})")
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(shape["repeats"]):
        for name, call in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step(call, x, grad)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    record: dict[str, Any] = {"seq": seq, "ratio_to_topk": seq // shape["topk"], "relative_error": errors}
    for name, call in variants.items():
        record[name] = {
            "wall_s": statistics.median(t[0] for t in times[name]),
            "cpu_s": statistics.median(t[1] for t in times[name]),
            "saved_bytes": saved_bytes(call, x),
        }
    base = record["dense_mla"]
    for name in variants:
        record[name]["cpu_ratio_to_dense"] = record[name]["cpu_s"] / base["cpu_s"]
        record[name]["saved_ratio_to_dense"] = record[name]["saved_bytes"] / base["saved_bytes"]
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repeat (CI)")
    parser.add_argument("--ratios", type=int, nargs="+", default=[4, 16], help="sequences as multiples of the top-k")
    parser.add_argument("--out", type=Path, default=Path("bench_results/dsa.json"))
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    result = {
        "shape": shape,
        "threads": torch.get_num_threads(),
        "results": [run_sequence(shape, r * shape["topk"]) for r in args.ratios],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for rec in result["results"]:
        line = ", ".join(
            f"{name} cpu {rec[name]['cpu_s']:.3f} s (x{rec[name]['cpu_ratio_to_dense']:.2f}) saved "
            f"{rec[name]['saved_bytes'] / 2**20:.1f} MiB (x{rec[name]['saved_ratio_to_dense']:.2f})"
            for name in ("dense_mla", "native_dsa", "transformers_dsa")
        )
        print(f"seq {rec['seq']} ({rec['ratio_to_topk']}x top-k): {line}")
    return result


if __name__ == "__main__":
    main()

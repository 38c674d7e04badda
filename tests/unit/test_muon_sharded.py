"""Muon over DTensor params on two gloo processes: each logical matrix is orthogonalised whole, so every layout
steps bitwise as one process steps the whole tensors (rows or columns sharded, an uneven shard, row blocks that
cross the shard boundary, an expert stack sharded by experts (no gather) or inside its experts), with Newton-Schulz
in bf16 (torch's) and in fp32 (`ns_dtype`, the update gathered in fp32); the bytes each rank receives per step are
the documented cost (bench/muon_comm.py counts them the same way)."""

import os
import sys
from pathlib import Path

import pytest
from runner import run_python

SCRIPT = r"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from internlm_offload.bench.muon_comm import Collectives
from internlm_offload.device import Accelerator
from internlm_offload.optim import Muon, SwapAdamW
from internlm_offload.optim.muon_rule import MUON

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
# (shape, shard dim, row splits)
CASES = [((24, 16), 0, None), ((24, 16), 1, None), ((7, 5), 0, None), ((12, 8), 0, (5, 3, 4)),
         ((4, 8, 6), 0, None), ((3, 8, 6), 1, (3, 5)), ((3, 8, 6), 2, None)]


def groups(params):
    return [{"params": [p], **({"row_splits": splits} if splits else {})} for p, (_, _, splits) in zip(params, CASES)]


gen = torch.Generator().manual_seed(0)
initial = [torch.randn(shape, generator=gen) for shape, _, _ in CASES]
counter = Collectives(2)
acc = Accelerator("cpu")


def padded(shape, dim):
    return torch.Size([size + size % 2 if d == dim else size for d, size in enumerate(shape)]).numel()


# elements each rank receives per step (the other half of each gathered matrix; DTensor pads an uneven shard)
GATHERED = sum(padded(shape, dim) for shape, dim, _ in CASES if (len(shape), dim) != (3, 0)) // 2
for ns_dtype in (torch.bfloat16, torch.float32):  # Newton-Schulz's dtype, and the gathered update's
    whole = [torch.nn.Parameter(t.clone()) for t in initial]
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(dim)]))
               for t, (_, dim, _) in zip(initial, CASES)]
    swapped = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(dim)]))
               for t, (_, dim, _) in zip(initial, CASES)]
    ref = Muon(groups(whole), lr=0.02, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype)
    opt = Muon(groups(sharded), lr=0.02, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype)
    # the swap tier: chunks of whole local shards, cut at the same params on every rank (the uneven shard)
    hyper = {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.1, "ns_dtype": str(ns_dtype)}
    swap = SwapAdamW([{**g, **hyper} for g in groups(swapped)], swap_optimizer_times=3, accelerator=acc, rule=MUON)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        for p, q, r, (shape, dim, _) in zip(whole, sharded, swapped, CASES):
            grad = torch.randn(shape, generator=gen)
            p.grad, q.grad = grad, distribute_tensor(grad.clone(), mesh, [Shard(dim)])
            r.grad = distribute_tensor(grad.clone(), mesh, [Shard(dim)])
        ref.step()
        swap.step()
        with counter:
            opt.step()
        # one all-gather per matrix but the stack sharded by experts, in Newton-Schulz's dtype: N (W - 1) / W each
        got = counter.take()
        assert got == ({"all_gather_into_tensor": len(CASES) - 1}, GATHERED * ns_dtype.itemsize), (got, GATHERED)
    for index, (p, q) in enumerate(zip(whole, sharded)):
        assert torch.equal(p.detach(), q.full_tensor()), f"{ns_dtype}: case {CASES[index]} differs"
        assert torch.equal(ref.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"].full_tensor())
    swap.finish_copies()
    assert len(swap._chunks) > 1
    for index, (p, r) in enumerate(zip(whole, swapped)):
        assert torch.equal(p.detach(), r.full_tensor()), f"swap {ns_dtype}: case {CASES[index]} differs"
    swap.close()
print(f"MUON-SHARDED-OK rank={rank}", flush=True)
from internlm_offload.engine.runtime import shutdown_runtime

shutdown_runtime()
"""


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_sharded_matrices_step_bitwise_as_one_process(tmp_path: Path) -> None:
    script = tmp_path / "muon_sharded.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = run_python(cmd, env=env, timeout=300, expect_success=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "MUON-SHARDED-OK rank=0" in proc.stdout and "MUON-SHARDED-OK rank=1" in proc.stdout

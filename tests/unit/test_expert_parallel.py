"""Expert parallel dispatch (engine/expert_parallel.py): the EP=2 layer on two gloo ranks against the one-process
layer on the same weights and tokens."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys

import torch
import torch.distributed as dist

from internlm_offload.engine.expert_parallel import apply_expert_parallel, expert_mesh, expert_params
from internlm_offload.engine.runtime import shutdown_runtime
from internlm_offload.model.moe import MoE

H, I, E, TOKENS = 16, 8, 4, 24


def check(ok, what):
    if not ok:
        raise SystemExit(f"rank {dist.get_rank()}: {what}")


def close(a, b, what, tol):
    # bitwise where the same rows meet the same weights; sums over rows grouped differently within tol
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    check(err <= tol, f"{what}: relative difference {err:.3g} > {tol}")


def layer(moe_type, starve):
    torch.manual_seed(0)
    moe = MoE(H, I, E, 2, moe_type=moe_type, num_shared_experts=1, capacity_factor=0.5, min_capacity=1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        if starve:  # every token routed to experts 2 and 3: rank 0's experts receive nothing, split sizes 0
            moe.router.weight[:2] = 0
            moe.router.weight[2:] = 0
            moe.router.weight[2:, 0] = 5.0
    return moe


def tokens(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g)
    if rank == 1:
        x = torch.cat([x[:5], x[5:] * 3])  # different statistics per rank: uneven splits
    x[:, 0] = x[:, 0].abs() + 0.1
    return x


def run(moe, x):
    x = x.clone().requires_grad_(True)
    out = moe(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()  # a gradient unlike the output
    return out.detach(), x.grad


def main(moe_type, starve):
    rank = dist.get_rank()
    ref = layer(moe_type, starve)
    # the one-process reference: each rank's tokens through the whole layer on their own
    ref_outs, ref_grads = [], []
    for r in range(2):
        ref.zero_grad(set_to_none=True)
        ref_outs.append(run(ref, tokens(r)))
        ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
    moe = layer(moe_type, starve)
    apply_expert_parallel(moe, expert_mesh("cpu", 2, 2))
    check(moe.experts.w1.to_local().shape[0] == E // 2, "local experts")
    out, x_grad = run(moe, tokens(rank))
    ref_out, ref_x_grad = ref_outs[rank]
    check(torch.equal(out, ref_out), f"output differs: {(out - ref_out).abs().max()}")
    close(x_grad, ref_x_grad, "input gradient", 1e-6)
    local = slice(rank * E // 2, (rank + 1) * E // 2)
    experts = dict(expert_params(moe))
    for name, p in moe.named_parameters():
        if name in experts:  # this rank's experts served both ranks' rows
            close(p.grad.to_local(), (ref_grads[0][name] + ref_grads[1][name])[local], f"{name} gradient", 1e-6)
        else:  # router, shared experts: this rank's tokens only
            close(p.grad, ref_grads[rank][name], f"{name} gradient", 1e-6)
    check(len(experts) == 3, "three expert weights")
    if starve:
        check(rank == 1 or moe.experts.w1.grad.to_local().abs().sum() == 0, "starved experts have a zero gradient")
    print(f"EP-DISPATCH-OK rank={rank}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    main(sys.argv[1], sys.argv[2] == "starve")
    shutdown_runtime()
"""


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("moe_type, routing", [("Dropless", "uneven"), ("GShard", "uneven"), ("Dropless", "starve")])
def test_two_rank_dispatch_matches_one_process_layer(tmp_path, moe_type, routing):
    """Outputs bitwise (each row meets the same expert weights in the same kernel); input, expert and router
    gradients within 1e-6 (expert weight gradients sum rows from both ranks, grouped differently)."""
    script = tmp_path / "ep_dispatch.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*cmd, moe_type, routing], cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "EP-DISPATCH-OK rank=0" in proc.stdout and "EP-DISPATCH-OK rank=1" in proc.stdout

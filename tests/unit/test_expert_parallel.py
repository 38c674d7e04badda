"""Expert parallel dispatch (engine/expert_parallel.py): the EP=2 layer on two gloo ranks against the one-process
layer on the same weights and tokens."""

import os
import sys
from pathlib import Path

import pytest
from runner import run_python

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys

import torch
import torch.distributed as dist

from internlm_offload.engine.expert_parallel import apply_expert_parallel, expert_params
from internlm_offload.engine.runtime import expert_mesh, shutdown_runtime
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
    ref_outs, ref_grads, ref_counts = [], [], []
    for r in range(2):
        ref.zero_grad(set_to_none=True)
        ref_outs.append(run(ref, tokens(r)))
        ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        ref_counts.append(ref.tokens_per_expert)
    moe = layer(moe_type, starve)
    apply_expert_parallel(moe, expert_mesh("cpu", 2, 2))
    check(moe.experts.w1.to_local().shape[0] == E // 2, "local experts")
    out, x_grad = run(moe, tokens(rank))
    ref_out, ref_x_grad = ref_outs[rank]
    # not bitwise: an expert's matmul takes both ranks' rows at once, so its row count (and with it the kernel MKL
    # or ATen picks, and the summation order) differs from the one-process layer's (tests/README.md, "Bitwise")
    close(out, ref_out, "output", 1e-6)
    # GShard: the same choices kept per expert (capacity from this rank's tokens, as without expert parallel)
    check(torch.equal(moe.tokens_per_expert, ref_counts[rank]), "tokens per expert after capacity differ")
    if moe_type == "GShard":
        check(ref_counts[rank].sum() < TOKENS * 2, "GShard dropped nothing: capacity_factor too large for the test")
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
    """Outputs, input, expert and router gradients within 1e-6 relative (an expert's matmul sees both ranks' rows at
    once; its weight gradients sum rows from both ranks, grouped differently); routing choices exactly."""
    script = tmp_path / "ep_dispatch.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    proc = run_python([*cmd, moe_type, routing], env=env, timeout=170, expect_success=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "EP-DISPATCH-OK rank=0" in proc.stdout and "EP-DISPATCH-OK rank=1" in proc.stdout


# ---- the schema: sizes resolved and refused (config/resolve.py) ------------------------------------------------

MOE = REPO / "configs" / "internlm2_tiny_moe.py"
FP32_DDP = ["model.dtype=torch.float32", "parallel.mode=ddp"]


def resolved(options: list[str], world_size: int):
    from internlm_offload.config import load_config_file, resolve_config

    overrides = {}
    for option in options:
        key, value = option.split("=", 1)
        overrides[key] = int(value) if value.lstrip("-").isdigit() else {"True": True}.get(value, value)
    return resolve_config(load_config_file(MOE, overrides), world_size=world_size)


def refused(options: list[str], world_size: int) -> str:
    from internlm_offload.config import ConfigError

    with pytest.raises(ConfigError) as info:
        resolved(options, world_size)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_expert_sizes_as_internevo_writes_them_resolve_and_are_logged():
    """size and no_tp, expert_weight's size and overlap taken; -1 and 0 are min(data-parallel ranks, experts)."""
    cfg = resolved([*FP32_DDP, "parallel.expert.size=2", "parallel.expert.no_tp=True"], world_size=4)
    assert (cfg.parallel.expert.size, cfg.parallel.expert.no_tp, cfg.parallel.expert_weight.size) == (2, True, 1)
    for size, world, expected in ((-1, 2, 2), (-1, 8, 4), (0, 4, 4), (-1, 1, 1)):
        cfg = resolved([*FP32_DDP, f"parallel.expert.size={size}"], world_size=world)
        assert cfg.parallel.expert.size == expected
        line = next(n for n in cfg.migration_notes()[0] if n.startswith(f"parallel.expert.size={size} -> "))
        assert f"-> {expected}: min(data-parallel ranks {world}, model.num_experts 4)" in line
    cfg = resolved(["model.dtype=torch.float32", "parallel.mode=fsdp2", "parallel.expert.size=-1"], world_size=4)
    assert cfg.parallel.expert.size == 4
    # FSDP2's CPU offload policy takes the expert shards too
    options = ["model.dtype=torch.float32", "parallel.mode=fsdp2", "parallel.fsdp_cpu_offload=True"]
    assert resolved([*options, "parallel.expert.size=-1"], world_size=2).parallel.expert.size == 2


@pytest.mark.parametrize(
    "options, world, part",
    [
        (["parallel.expert.size=3"], 3, "parallel.expert.size=3 must divide model.num_experts (4)"),
        (["parallel.expert.size=4"], 2, "parallel.expert.size=4 must divide the data-parallel size (2)"),
        (["parallel.expert.size=4", "model.num_experts=6"], 4, "must divide model.num_experts (6)"),
        (
            ["parallel.expert.size=2", "parallel.expert_weight.size=3"],
            4,
            "parallel.expert_weight.size=3 must divide the expert-data ranks left, data-parallel 4 / expert 2 = 2",
        ),
        (
            ["parallel.expert.size=2", "parallel.expert_weight.size=2"],
            4,
            (
                "parallel.expert_weight.size=2 shards the experts with FSDP2 over groups of their expert-data ranks: "
                "set parallel.mode='fsdp2', got 'ddp'"
            ),
        ),
        (["parallel.expert_weight.size=2"], 2, "parallel.expert_weight.size=2 needs parallel.expert.size > 1"),
        (  # before the planner chooses a size: the mode no size can take is said at once
            ["parallel.expert.size=auto", "parallel.expert_weight.size=2", "memory_budget.device=1GiB"],
            4,
            "parallel.expert_weight.size=2 shards the experts with FSDP2 over groups of their expert-data ranks",
        ),
        (["parallel.expert.size=2", "model.num_experts=0"], 2, "needs a mixture-of-experts model"),
        (
            [
                "parallel.expert.size=2",
                "parallel.expert_weight.size=2",
                "parallel.tensor.size=2",
                "parallel.mode=fsdp2",
            ],
            8,
            "parallel.expert_weight.size=2 with parallel.expert.no_tp=False under parallel.tensor (size 2, mode 'mtp'): "
            "expert weight groups over experts split on the tensor group are not built",
        ),
    ],
)
def test_what_expert_parallel_cannot_take_is_one_line(options, world, part):
    options = ["model.dtype=torch.float32", "parallel.mode=ddp", *options]
    assert part in refused(options, world)


def test_expert_weight_parallel_and_isp_weight_groups_resolve_with_expert_parallel():
    """InternEvo's qwen3 layout, natively: isp over a tensor group of one with weight groups (FSDP2 HSDP of the
    non-expert weights) beside expert parallel with its experts sharded over groups of expert-data ranks."""
    layout = ["parallel.mode=fsdp2", "parallel.tensor.mode=isp", "parallel.weight.size=2", "parallel.expert.size=2"]
    cfg = resolved(["model.dtype=torch.float32", *layout, "parallel.expert_weight.size=2"], world_size=8)
    assert (cfg.parallel.weight.size, cfg.parallel.expert.size, cfg.parallel.expert_weight.size) == (2, 2, 2)
    # isp with sequence chunks (tensor size 2): its tensor ranks route their own chunks, so the expert dims are
    # carved from all 8 ranks (expert 4 x expert-data 2), not from the 4 data-parallel ones; -1 is min(8, experts)
    isp = ["model.dtype=torch.float32", *layout[:2], "parallel.tensor.size=2", "model.num_experts=8"]
    assert resolved([*isp, "parallel.expert.size=4", "parallel.expert_weight.size=2"], 8).parallel.expert.size == 4
    cfg = resolved([*isp, "parallel.expert.size=-1"], 8)
    assert cfg.parallel.expert.size == 8
    assert "-> 8: min(world ranks 8, model.num_experts 8)" in next(
        n for n in cfg.migration_notes()[0] if n.startswith("parallel.expert.size=-1")
    )
    assert "must divide the world size (8)" in refused([*isp, "parallel.expert.size=16", "model.num_experts=16"], 8)


def test_the_expert_mesh_under_expert_weight_parallel_seen_from_rank_5():
    """8 ranks, EP 2, expert weight 2: expert groups of consecutive ranks, expert-data ranks at stride 2, split into
    shard pairs at stride 2 (ep innermost) and replicas at stride 4; "edp" is the whole expert-data group; W = 1
    and W = the expert-data size keep the ("edp", "ep") mesh."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from internlm_offload.engine.runtime import all_expert_data, expert_data_mesh, expert_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        mesh = expert_mesh("cpu", 8, 2, 2)
        assert mesh.mesh_dim_names == ("edp_replicate", "edp_shard", "ep")
        groups = {name: mesh[name].mesh.tolist() for name in ("ep", "edp_shard", "edp_replicate")}
        assert groups == {"ep": [4, 5], "edp_shard": [5, 7], "edp_replicate": [1, 5]}
        assert all_expert_data(mesh).mesh.tolist() == [1, 3, 5, 7]
        assert expert_data_mesh(mesh).mesh.tolist() == [[1, 3], [5, 7]]  # HSDP: rows replicas, columns shards
        for weight in (1, 4):
            flat = expert_mesh("cpu", 8, 2, weight)
            assert flat.mesh_dim_names == ("edp", "ep") and expert_data_mesh(flat).mesh.tolist() == [1, 3, 5, 7]
            assert all_expert_data(flat).mesh.tolist() == [1, 3, 5, 7]
    finally:
        dist.destroy_process_group()


def test_pipeline_with_expert_parallel_is_refused_in_one_line():
    """InternEvo's pipeline section beside its expert section: pipeline with expert parallel is not built yet."""
    from internlm_offload.config import ConfigError, resolve_config

    raw = dict(model=dict(num_experts=4), parallel=dict(pipeline=dict(size=2), expert=dict(size=2, no_tp=False)))
    with pytest.raises(ConfigError) as info:
        resolve_config(raw, world_size=4)
    assert "parallel.pipeline.size=2 with parallel.expert.size=2: pipeline with expert parallel is not built" in str(
        info.value
    )


def test_preflight_under_expert_parallel_predicts_this_rank_s_step(monkeypatch, caplog):
    """The trace runs expert parallel (rank 0's experts, the all-to-all at the assumed imbalance:
    tests/unit/test_planner_expert_parallel.py): train.py's preflight predicts its peaks instead of skipping."""
    from internlm_offload.device import get_accelerator
    from internlm_offload.launch import run_preflight

    cfg = resolved([*FP32_DDP, "parallel.expert.size=2"], world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level("WARNING"):
        predicted = run_preflight(cfg, str(MOE), get_accelerator("cpu"), 0)
    assert predicted is not None and predicted[0] > 0, caplog.text
    assert "Preflight skipped" not in caplog.text

"""HybridDeviceOptimizer vs torch.optim.AdamW(fused=True): bitwise parity, checkpoints, memory, races (cpu)."""

import functools
import os
import sys
from pathlib import Path

import pytest
import torch
from runner import run_python
from stream_gates import held_back
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR

from internlm_offload.device import StreamError, storage_key
from internlm_offload.optim.hybrid import HybridDeviceOptimizer, offload_mask
from internlm_offload.optim.records import ParamRecord

REPO = Path(__file__).resolve().parents[2]

# Two groups with different lr and weight decay; odd sizes hit the kernels' vector tails.
GROUPS = [
    {"lr": 1e-2, "weight_decay": 0.1, "shapes": [(3, 341), (7,), (1,)]},
    {"lr": 3e-3, "weight_decay": 0.05, "shapes": [(7,), (4097,), (32, 64), (1,)]},
]
FROZEN = {1}  # flat param indices with requires_grad=False
SOMETIMES_NO_GRAD = {2, 6}  # grad is None on every third step; index 2 is CPU-, 6 device-stepped at 0.5
HYPER = {"betas": (0.9, 0.95), "eps": 1e-8}
CPU_AT_HALF = [True, False, True, True, False, False, False]  # 1031 of 7177 trainable elements fit in 0.5


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [shape for group in GROUPS for shape in group["shapes"]]
    return [
        torch.randn(shape, generator=gen).to(dtype).requires_grad_(i not in FROZEN) for i, shape in enumerate(shapes)
    ]


def clone_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_(p.requires_grad) for p in params]


def groups_of(params: list[torch.Tensor]) -> list[dict]:
    groups, start = [], 0
    for spec in GROUPS:
        end = start + len(spec["shapes"])
        groups.append({"params": params[start:end], "lr": spec["lr"], "weight_decay": spec["weight_decay"]})
        start = end
    return groups


def grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        skipped = i in FROZEN or (i in SOMETIMES_NO_GRAD and step % 3 == 1)
        out.append(None if skipped else g)
    return out


def train(optimizer, params, steps: int, start: int = 0, scheduler=None) -> None:
    for step in range(start, start + steps):
        for p, g in zip(params, grads(step, params)):
            p.grad = g
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def hybrid(params, **kwargs) -> HybridDeviceOptimizer:
    return HybridDeviceOptimizer(groups_of(params), **{**HYPER, **kwargs})


def reference(params, **kwargs) -> AdamW:
    return AdamW(groups_of(params), fused=True, **{**HYPER, **kwargs})


def assert_bitwise(opt_a, params_a, opt_b, params_b) -> None:
    for i, (a, b) in enumerate(zip(params_a, params_b, strict=True)):
        assert torch.equal(a, b), f"param {i} differs"
    sd_a, sd_b = opt_a.state_dict(), opt_b.state_dict()
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys() and sd_b["state"], "state keys differ (or are empty)"
    for i, state_b in sd_b["state"].items():
        assert sd_a["state"][i].keys() == state_b.keys()
        for name, value in state_b.items():
            assert torch.equal(sd_a["state"][i][name], value), f"state {i}.{name} differs"


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.3 * step) if step % 2 else 0.5


# ---- parity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"amsgrad": True}, {"maximize": True}], ids=["wd", "amsgrad", "maximize"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "bulk"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_bitwise_parity_with_fused_adamw(fraction, overlap, options):
    params, ref_params = make_params(), make_params()
    opt = hybrid(params, offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=overlap, **options)
    ref = reference(ref_params, **options)
    sched, ref_sched = LambdaLR(opt, lr_lambda), LambdaLR(ref, lr_lambda)

    train(opt, params, 50, scheduler=sched)
    train(ref, ref_params, 50, scheduler=ref_sched)

    assert_bitwise(opt, params, ref, ref_params)
    assert len(opt.state) == len(ref.state) == 6  # every trainable param, never the frozen one
    assert params[1] not in opt.state and torch.equal(params[1], make_params()[1])


def test_placement_walks_params_in_order_within_the_budget():
    params = make_params()
    assert offload_mask(params, 0.0) == [False] * 7
    assert offload_mask(params, 0.5) == CPU_AT_HALF  # the 4097-element param would exceed 3588.5
    assert offload_mask(params, 1.0) == [i not in FROZEN for i in range(7)]

    opt = hybrid(params, offload_fraction=0.5)
    cpu_masters = [q for sub in opt.sub_optimizers[:-1] for g in sub.param_groups for q in g["params"]]
    expected = [p for p, cpu in zip(params, CPU_AT_HALF) if cpu]
    assert [q.shape for q in cpu_masters] == [p.shape for p in expected]
    assert all(q is not p for q, p in zip(cpu_masters, expected))  # host copies, not the model's params
    device_params = [q for g in opt.sub_optimizers[-1].param_groups for q in g["params"]]
    assert {id(q) for q in device_params} == {id(p) for p, cpu in zip(params, CPU_AT_HALF) if not cpu}


def test_a_given_cpu_mask_is_the_placement():
    """The builder places the CPU share once (its masters live in host memory) and hands it over."""
    params, ref_params = make_params(), make_params()
    mask = [False, False, False, False, True, False, True]  # not what any fraction would place
    opt = hybrid(params, offload_fraction=0.5, cpu_mask=mask)
    device_params = [q for g in opt.sub_optimizers[-1].param_groups for q in g["params"]]
    assert {id(q) for q in device_params} == {id(p) for p, cpu in zip(params, mask) if not cpu}
    ref = reference(ref_params)
    train(opt, params, 3)
    train(ref, ref_params, 3)
    assert_bitwise(opt, params, ref, ref_params)
    with pytest.raises(ValueError, match="entries"):
        hybrid(make_params(), cpu_mask=mask[:-1])
    with pytest.raises(ValueError, match="frozen"):
        hybrid(make_params(), cpu_mask=[i == 1 for i in range(7)])  # param 1 is frozen


def test_lr_scheduler_changes_reach_every_sub_optimizer():
    params = make_params()
    opt = hybrid(params, offload_fraction=0.5)
    sched = LambdaLR(opt, lambda step: 0.1 * (step + 1))
    train(opt, params, 3, scheduler=sched)
    opt.step()  # propagates the lr the scheduler set after the third step
    expected = [0.4 * spec["lr"] for spec in GROUPS]
    assert [g["lr"] for g in opt.param_groups] == pytest.approx(expected)
    # One CPU optimizer per CPU param (params 0, 2 of group 0 and 3 of group 1), then the device one.
    cpu_lrs = [sub.param_groups[0]["lr"] for sub in opt.sub_optimizers[:-1]]
    assert cpu_lrs == pytest.approx([expected[0], expected[0], expected[1]])
    assert [g["lr"] for g in opt.sub_optimizers[-1].param_groups] == pytest.approx(expected)


def test_bf16_with_fp32_masters_matches_an_fp32_master_reference():
    params = make_params(torch.bfloat16)
    opt = hybrid(params, offload_fraction=0.5, param_update_in_fp32=True)
    masters = [p.detach().to(torch.float32, copy=True) for p in params]  # the reference: AdamW over fp32 masters
    ref = reference(masters)
    plain_bf16 = clone_params(params)
    plain = reference(plain_bf16)  # AdamW updating the bf16 params directly
    for step in range(50):
        for p, m, q, g in zip(params, masters, plain_bf16, grads(step, params)):
            p.grad, q.grad, m.grad = g, g, None if g is None else g.float()
        opt.step(), ref.step(), plain.step()

    # Same kernels on both sides here, so bitwise (the documented cuda bound is in the next tests).
    assert_bitwise(opt, params, ref, [m.to(torch.bfloat16) for m in masters])
    assert any(not torch.equal(p, q) for p, q in zip(params, plain_bf16))  # the fp32 masters were used


def bf16_ulp(reference_values: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values around each reference value (8 significant bits)."""
    _, exponent = torch.frexp(reference_values.float())
    return torch.ldexp(torch.ones_like(reference_values, dtype=torch.float32), exponent - 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_documented_tolerance_when_the_device_kernel_differs(dtype):
    """Device side uses the for-loop AdamW (a different kernel), standing in for cuda vs cpu fused."""
    params = make_params(dtype)
    for_loop_adamw = functools.partial(AdamW, foreach=False)
    opt = hybrid(params, offload_fraction=0.5, param_update_in_fp32=True, gpu_optimizer_cls=for_loop_adamw)
    masters = [p.detach().to(torch.float32, copy=True) for p in params]
    ref = reference(masters)
    for step in range(50):
        for p, m, g in zip(params, masters, grads(step, params)):
            p.grad, m.grad = g, None if g is None else g.float()
        opt.step(), ref.step()

    device_side = [i for i, cpu in enumerate(CPU_AT_HALF) if not cpu and i not in FROZEN]
    for i, (p, m) in enumerate(zip(params, masters)):
        if CPU_AT_HALF[i]:
            assert torch.equal(p, m.to(dtype)), f"CPU-stepped param {i} must stay bitwise"
        elif dtype == torch.float32:
            torch.testing.assert_close(p, m, rtol=1e-5, atol=1e-6)  # the documented fp32 bound
        else:
            assert ((p.float() - m.to(dtype).float()).abs() <= bf16_ulp(m)).all(), f"param {i} beyond 1 bf16 ulp"
    for i in device_side:
        for name, value in ref.state[masters[i]].items():
            torch.testing.assert_close(opt.state[params[i]][name], value, rtol=1e-5, atol=1e-6)
    if dtype == torch.float32:  # the kernels really differ, or this test would prove nothing
        assert any(not torch.equal(params[i], masters[i]) for i in device_side)


# ---- checkpoints ----------------------------------------------------------------------------------


def save_load(state_dict: dict, path) -> dict:
    torch.save(state_dict, path)
    return torch.load(path, weights_only=True)


def test_state_dict_round_trip_into_a_different_fraction(tmp_path):
    params = make_params()
    first = hybrid(params, offload_fraction=0.5)
    train(first, params, 10)
    loaded = save_load(first.state_dict(), tmp_path / "optim.pt")

    resumed_params = clone_params(params)
    second = hybrid(resumed_params, offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=False)
    second.load_state_dict(loaded)
    train(second, resumed_params, 10, start=10)
    train(first, params, 10, start=10)  # the uninterrupted run

    assert_bitwise(second, resumed_params, first, params)


@pytest.mark.parametrize("index", [0, 4], ids=["cpu_param", "device_param"])
def test_loaded_state_is_really_used(tmp_path, index):
    params = make_params()
    first = hybrid(params, offload_fraction=0.5)
    train(first, params, 10)
    loaded = save_load(first.state_dict(), tmp_path / "optim.pt")
    perturbed = save_load(first.state_dict(), tmp_path / "perturbed.pt")
    perturbed["state"][index]["exp_avg"].add_(1e-2)

    results = []
    for state_dict in (loaded, perturbed):
        resumed = clone_params(params)
        opt = hybrid(resumed, offload_fraction=0.5)
        opt.load_state_dict(state_dict)
        train(opt, resumed, 1, start=10)
        results.append(resumed)
    assert not torch.equal(results[0][index], results[1][index])
    assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(*results)) if i != index)


def test_plain_adamw_state_dict_loads_into_hybrid(tmp_path):
    ref_params = make_params()
    ref = reference(ref_params)
    train(ref, ref_params, 10)
    loaded = save_load(ref.state_dict(), tmp_path / "optim.pt")

    params = clone_params(ref_params)
    opt = hybrid(params, offload_fraction=0.5)
    opt.load_state_dict(loaded)
    train(opt, params, 10, start=10)
    train(ref, ref_params, 10, start=10)
    assert_bitwise(opt, params, ref, ref_params)


def test_hybrid_state_dict_loads_into_plain_adamw(tmp_path):
    params = make_params()
    opt = hybrid(params, offload_fraction=0.5)
    train(opt, params, 10)
    loaded = save_load(opt.state_dict(), tmp_path / "optim.pt")

    ref_params = clone_params(params)
    ref = AdamW(groups_of(ref_params), lr=0.5, fused=True)  # hyper-parameters come from the checkpoint
    ref.load_state_dict(loaded)
    train(ref, ref_params, 10, start=10)
    train(opt, params, 10, start=10)
    assert_bitwise(ref, ref_params, opt, params)


def test_load_state_dict_copies_into_the_live_buffers(tmp_path):
    params = make_params()
    opt = hybrid(params, offload_fraction=0.5)
    train(opt, params, 3)
    buffers = {id(v) for sub in opt.sub_optimizers for s in sub.state.values() for v in s.values()}
    ref_params = make_params(seed=1)
    ref = reference(ref_params)
    train(ref, ref_params, 5)
    loaded = save_load(ref.state_dict(), tmp_path / "optim.pt")

    opt.load_state_dict(loaded)

    after = {id(v) for sub in opt.sub_optimizers for s in sub.state.values() for v in s.values()}
    assert after == buffers  # same tensor objects: written in place
    for index, p in enumerate(params):
        for name, value in loaded["state"].get(index, {}).items():
            assert torch.equal(opt.state[p][name], value)
    loaded["state"][0]["exp_avg"].add_(1.0)  # the checkpoint is not aliased
    assert not torch.equal(opt.state[params[0]]["exp_avg"], loaded["state"][0]["exp_avg"])
    master = opt.sub_optimizers[0].param_groups[0]["params"][0]
    assert opt.state[params[0]] is opt.sub_optimizers[0].state[master]  # one state, no second copy


def cpu_state_storages(opt: HybridDeviceOptimizer) -> list[set[int]]:
    """Per CPU sub-optimizer, the storages of its (non-scalar) state tensors."""
    return [
        {storage_key(v) for s in unit.optimizer.state.values() for v in s.values() if v.dim() > 0}
        for unit in opt._cpu_units
    ]


def test_cpu_step_states_live_in_one_host_slab_per_unit(tmp_path):
    """Lazily created (or loaded) CPU states move into one host buffer per CPU sub-optimizer after its step:
    host-tier memory (on cpu not counted as device memory), stepped in place and bitwise unchanged."""
    params, ref_params = make_params(), make_params()
    opt, ref = hybrid(params, offload_fraction=1.0), reference(ref_params)
    for optimizer, ps in ((opt, params), (ref, ref_params)):  # param 0 gets its first grad (and states) later
        for p, g in zip(ps[1:], grads(0, ps)[1:]):
            p.grad = g
        optimizer.step()
        train(optimizer, ps, 2, start=1)
    assert len(opt._cpu_units) > 1 and all(len(keys) == 1 for keys in cpu_state_storages(opt))
    assert_bitwise(opt, params, ref, ref_params)
    loaded = save_load(opt.state_dict(), tmp_path / "optim.pt")

    resumed = clone_params(params)
    second = hybrid(resumed, offload_fraction=1.0)
    second.load_state_dict(loaded)  # no states yet: the load places new tensors
    assert any(len(keys) > 1 for keys in cpu_state_storages(second))
    train(second, resumed, 3, start=3)
    train(opt, params, 3, start=3)
    assert all(len(keys) == 1 for keys in cpu_state_storages(second))
    assert_bitwise(second, resumed, opt, params)


@pytest.mark.parametrize(
    "dtype,fraction", [(torch.float32, 1.0), (torch.bfloat16, 0.5)], ids=["fp32_all_cpu", "bf16_fp32_masters"]
)
def test_sync_from_model_restarts_from_the_new_weights(dtype, fraction):
    kwargs = {"offload_fraction": fraction, "param_update_in_fp32": True}
    runs = []
    for sync in (True, False):
        params = make_params(dtype)
        opt = hybrid(params, **kwargs)
        train(opt, params, 3)
        with torch.no_grad():  # a model-only load
            for p, new in zip(params, make_params(dtype, seed=7)):
                p.copy_(new)
        if sync:
            opt.sync_from_model()
        train(opt, params, 1, start=3)
        runs.append(params)

    # Reference: an optimizer rebuilt on the loaded weights, with the old optimizer state.
    params = make_params(dtype)
    old = hybrid(params, **kwargs)
    train(old, params, 3)
    fresh_params = make_params(dtype, seed=7)
    fresh = hybrid(fresh_params, **kwargs)
    fresh.load_state_dict(old.state_dict())
    train(fresh, fresh_params, 1, start=3)

    assert all(torch.equal(a, b) for a, b in zip(runs[0], fresh_params))
    assert not all(torch.equal(a, b) for a, b in zip(runs[1], fresh_params))  # stale masters without it


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_resume_loads_the_optimizer_before_the_weights(tmp_path, fraction):
    """`set_state_dict`'s order: a fresh optimizer, its state loaded, then the model's weights; masters follow."""
    params = make_params()
    first = hybrid(params, offload_fraction=0.5)
    train(first, params, 10)
    loaded = save_load(first.state_dict(), tmp_path / "optim.pt")

    resumed_params = make_params(seed=3)  # the fresh model, built before its weights are loaded
    second = hybrid(resumed_params, offload_fraction=fraction)
    second.load_state_dict(loaded)
    with torch.no_grad():
        for p, saved in zip(resumed_params, params):
            p.copy_(saved)
    train(second, resumed_params, 10, start=10)
    train(first, params, 10, start=10)
    assert_bitwise(second, resumed_params, first, params)


def test_reloading_its_own_state_keeps_the_fp32_masters():
    runs = []
    for reload in (True, False):
        params = make_params(torch.bfloat16)
        opt = hybrid(params, offload_fraction=0.5, param_update_in_fp32=True)
        train(opt, params, 5)
        if reload:
            opt.load_state_dict(opt.state_dict())
        train(opt, params, 5, start=5)
        runs.append((opt, params))
    assert_bitwise(*runs[0], *runs[1])  # the masters' extra bits survived the reload


def test_state_init_of_set_state_dict_leaves_the_params_unchanged():
    """`get_state_dict`/`set_state_dict` create missing states with a zero-grad, lr-0 step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    module = torch.nn.ParameterList([torch.nn.Parameter(p, requires_grad=p.requires_grad) for p in make_params()])
    params = list(module)
    opt = hybrid(params, offload_fraction=0.5)
    _, optim_state = get_state_dict(module, opt)
    assert all(torch.equal(p, q) for p, q in zip(params, make_params()))
    assert len(optim_state["state"]) == 6 and all(p.grad is None for p in params)
    assert [g["lr"] for g in opt.param_groups] == [spec["lr"] for spec in GROUPS]


# ---- memory ---------------------------------------------------------------------------------------


def adam_state_bytes(params: list[torch.Tensor]) -> int:
    # exp_avg + exp_avg_sq in fp32, plus a 4-byte fp32 step tensor per param.
    return sum(8 * p.numel() + 4 for p in params if p.requires_grad)


def test_memory_stats_all_on_the_cpu():
    params = make_params()
    opt = hybrid(params, offload_fraction=1.0)
    train(opt, params, 2)
    stats = opt.memory_stats()
    assert all(type(v) is int for v in stats.values())
    assert stats["device_state_bytes"] == stats["peak_device_state_bytes"] == 0
    trainable = [p for p in params if p.requires_grad]
    assert stats["host_state_bytes"] == adam_state_bytes(params) + sum(8 * p.numel() for p in trainable)  # master+grad


def test_memory_stats_all_on_the_device():
    params = make_params(torch.bfloat16)
    opt = hybrid(params, offload_fraction=0.0, param_update_in_fp32=True)
    assert opt.memory_stats()["peak_device_state_bytes"] == 0  # no step yet
    train(opt, params, 2)
    stats = opt.memory_stats()
    assert all(type(v) is int for v in stats.values())
    assert stats["host_state_bytes"] == 0
    masters = sum(4 * p.numel() for p in params if p.requires_grad)
    assert stats["device_state_bytes"] == adam_state_bytes(params) + masters
    # The transient fp32 grads of the last step (step 1: params 2 and 6 had none) count in the peak.
    with_grad = [p for i, p in enumerate(params) if p.requires_grad and i not in SOMETIMES_NO_GRAD]
    assert stats["peak_device_state_bytes"] == stats["device_state_bytes"] + sum(4 * p.numel() for p in with_grad)


def test_offload_and_reload_keep_training_bitwise():
    params, ref_params = make_params(), make_params()
    opt, ref = hybrid(params, offload_fraction=0.5), reference(ref_params)
    train(opt, params, 5)
    train(ref, ref_params, 5)
    before = opt.memory_stats()
    assert before["device_state_bytes"] > 0

    opt.offload_optimizer_states()
    offloaded = opt.memory_stats()
    assert offloaded["device_state_bytes"] == 0
    assert offloaded["host_state_bytes"] == before["host_state_bytes"] + before["device_state_bytes"]
    with pytest.raises(RuntimeError, match="reload_optimizer_states"):
        opt.step()
    assert_bitwise(opt, params, ref, ref_params)  # state_dict still reads the offloaded states

    opt.reload_optimizer_states()
    assert opt.memory_stats() == before
    train(opt, params, 5, start=5)
    train(ref, ref_params, 5, start=5)
    assert_bitwise(opt, params, ref, ref_params)


def test_offloaded_states_share_one_slab_reused_by_the_next_offload(monkeypatch):
    params = make_params()
    opt = hybrid(params, offload_fraction=0.5)
    train(opt, params, 2)
    opt.offload_optimizer_states()
    device_states = [v for s in opt.sub_optimizers[-1].state.values() for v in s.values()]
    assert len(device_states) > 2 and len({storage_key(v) for v in device_states}) == 1
    opt.reload_optimizer_states()
    train(opt, params, 1, start=2)
    allocations = []
    real_host_empty = type(opt._acc).host_empty
    monkeypatch.setattr(type(opt._acc), "host_empty", lambda *a, **k: allocations.append(a) or real_host_empty(*a, **k))
    opt.offload_optimizer_states()
    assert allocations == []


# ---- races (cpu side streams are worker threads; delays widen every window) ----------------------


def slow_copy_streams(opt: HybridDeviceOptimizer, delay_s: float = 0.02) -> None:
    opt._d2h.stream = opt._acc.stream(delay_s=delay_s)
    opt._h2d.stream = opt._acc.stream(delay_s=delay_s)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "bulk"])
def test_slow_copy_streams_stay_bitwise(overlap):
    params, ref_params = make_params(), make_params()
    opt = hybrid(params, offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=overlap)
    slow_copy_streams(opt)
    ref = reference(ref_params)
    train(opt, params, 5)
    train(ref, ref_params, 5)
    assert_bitwise(opt, params, ref, ref_params)


def test_without_the_grad_wait_the_cpu_step_reads_stale_grads(monkeypatch):
    """With the wait in place the CPU step would block until the gate's timeout and then read the right grads."""
    monkeypatch.setattr(HybridDeviceOptimizer, "_wait_for_grads", lambda self, unit: None)
    params, ref_params = make_params(), make_params()
    opt, ref = hybrid(params, offload_fraction=0.5), reference(ref_params)
    gate = held_back(opt._d2h.stream)
    train(opt, params, 1)
    stepped = [p.detach().clone() for p in params]
    gate.set()
    opt._d2h.stream.synchronize()
    train(ref, ref_params, 1)
    assert not all(torch.equal(a, b) for a, b in zip(stepped, ref_params))


def test_without_the_param_wait_the_next_forward_reads_stale_params(monkeypatch):
    params, ref_params = make_params(), make_params()
    opt, ref = hybrid(params, offload_fraction=1.0), reference(ref_params)
    train(opt, params, 1)  # the first step refreshes the masters, which waits for the H2D stream itself
    train(ref, ref_params, 2)
    monkeypatch.setattr(HybridDeviceOptimizer, "_wait_for_params", lambda self, compute: None)
    gate = held_back(opt._h2d.stream)
    train(opt, params, 1, start=1)
    # What a forward right after step() would see: the H2D copies have not landed.
    assert not all(torch.equal(a, b) for a, b in zip(params, ref_params))
    gate.set()
    opt._h2d.stream.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))  # the copies were only late


def test_the_master_refresh_waits_for_the_last_steps_param_copies(monkeypatch):
    """On a device the host does not wait for a step's H2D param copies (`_wait_for_params` orders the compute
    stream only), so `sync_from_model()` may follow a step whose copies are in flight: without its wait the refresh
    reads the old params into the masters, and the late copies then write those old values back."""
    params, ref_params = make_params(), make_params()
    opt, ref = hybrid(params, offload_fraction=1.0), reference(ref_params)
    train(opt, params, 1)
    train(ref, ref_params, 2)
    monkeypatch.setattr(HybridDeviceOptimizer, "_wait_for_params", lambda self, compute: None)  # the device's host
    gate = held_back(opt._h2d.stream)
    train(opt, params, 1, start=1)  # its H2D copies are held behind the gate
    # Waiting for the H2D stream lets the copies go: no timing involved either way.
    synchronize = opt._h2d.stream.synchronize
    monkeypatch.setattr(opt._h2d.stream, "synchronize", lambda: gate.set() or synchronize())
    opt.sync_from_model()
    gate.set()
    synchronize()
    assert_bitwise(opt, params, ref, ref_params)


def _fail(message: str) -> None:
    raise RuntimeError(message)


def test_close_waits_for_the_copies_and_reports_a_failed_one():
    """close() waits for the copies in flight before it stops the streams and frees the host slabs (on a device an
    H2D copy may still read them): that wait is where a failed copy surfaces, which stopping the streams would lose."""
    params = make_params()
    opt = hybrid(params, offload_fraction=0.5)
    train(opt, params, 1)
    opt._h2d.stream.submit(_fail, "an H2D copy failed")
    with pytest.raises(StreamError) as failure:
        opt.close()
    assert str(failure.value.__cause__) == "an H2D copy failed"
    assert opt._d2h.stream.closed and opt._h2d.stream.closed


# ---- validation ---------------------------------------------------------------------------------


def test_rejects_bad_arguments():
    params = make_params()
    with pytest.raises(ValueError, match="offload_fraction"):
        hybrid(params, offload_fraction=1.5)
    with pytest.raises(ValueError, match="plain values"):
        hybrid(params, some_class=AdamW)
    opt = hybrid(params)
    with pytest.raises(NotImplementedError):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    assert all(not callable(v) for g in opt.state_dict()["param_groups"] for v in g.values())


# ---- FSDP2 (DTensor params), two ranks --------------------------------------------------------------

FSDP2_SCRIPT = """
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from internlm_offload.engine.runtime import shutdown_runtime
from internlm_offload.optim.hybrid import HybridDeviceOptimizer

# Uneven out-features: 1 row leaves rank 1 an empty shard, 7 rows split 4/3, 5 rows 3/2. At 0.5 the
# first two blocks (23 of 63 elements) are CPU-stepped, the last (40) on the device.
SIZES = [(8, 1), (1, 7), (7, 5)]
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def make_model(mesh, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(i, o), nn.Tanh()) for i, o in SIZES])
    for block in model:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def batch(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)  # different data per rank: grads get reduced
    return torch.randn(4, SIZES[0][0], generator=gen), torch.randn(4, SIZES[-1][1], generator=gen)


def train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        x, y = batch(step, dist.get_rank())
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def locals_of(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def check(cond, what):
    if not cond:
        print(f"rank {dist.get_rank()}: FAILED: {what}", flush=True)
        sys.exit(1)


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def main(ckpt_dir):
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, ref_model = make_model(mesh, 0), make_model(mesh, 0)
    check(all(isinstance(p, DTensor) for p in model.parameters()), "params are DTensors")
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, **HYPER)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True, **HYPER)
    cpu_masters = [m for sub in opt.sub_optimizers[:-1] for g in sub.param_groups for m in g["params"]]
    check([m.shape for m in cpu_masters] == [p.to_local().shape for p in list(model.parameters())[:4]], "placement")

    train(model, opt, 5)
    train(ref_model, ref, 5)
    check(same(locals_of(model), locals_of(ref_model)), "params after 5 steps")

    model_sd, optim_sd = get_state_dict(model, opt)
    ref_sd = get_state_dict(ref_model, ref)[1]
    check(optim_sd["state"].keys() == ref_sd["state"].keys(), "state keys")
    for fqn, state in ref_sd["state"].items():
        for name, value in state.items():
            ours = optim_sd["state"][fqn][name]
            kinds = f"ours a {type(ours).__name__}, AdamW's a {type(value).__name__}"
            check(type(ours) is type(value), f"{fqn}.{name}: {kinds}")
            if isinstance(value, DTensor):
                check(ours.placements == value.placements and ours.shape == value.shape, f"{fqn}.{name} layout")
                check(torch.equal(ours.to_local(), value.to_local()), f"{fqn}.{name} differs")
            else:
                check(torch.equal(ours, value), f"{fqn}.{name} differs")
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir)

    resumed = []
    for factory in (
        lambda params: HybridDeviceOptimizer(params, offload_fraction=0.5, **HYPER),
        lambda params: HybridDeviceOptimizer(
            params, offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=False, **HYPER
        ),
        lambda params: torch.optim.AdamW(params, fused=True, **{**HYPER, "lr": 0.5}),
    ):
        fresh_model = make_model(mesh, 1)
        fresh_opt = factory(fresh_model.parameters())
        before = locals_of(fresh_model)
        fresh_model_sd, fresh_optim_sd = get_state_dict(fresh_model, fresh_opt)  # steps with zero grads, lr 0
        check(same(locals_of(fresh_model), before), "set_state_dict's state init changed the params")
        state = {"model": fresh_model_sd, "optim": fresh_optim_sd}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_state_dict(fresh_model, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train(fresh_model, fresh_opt, 3, start=5)
        resumed.append(locals_of(fresh_model))
        if hasattr(fresh_opt, "close"):
            fresh_opt.close()

    train(model, opt, 3, start=5)
    train(ref_model, ref, 3, start=5)
    check(same(locals_of(model), locals_of(ref_model)), "params after 8 steps")
    for i, params in enumerate(resumed):
        check(same(params, locals_of(model)), f"resumed run {i} differs from the uninterrupted one")

    device_states = opt.sub_optimizers[-1].state.values()
    local_bytes = sum(v.to_local().nbytes for s in device_states for v in s.values() if isinstance(v, DTensor))
    check(local_bytes > 0 and opt.memory_stats()["device_state_bytes"] == local_bytes + 2 * 4, "local bytes")
    opt.offload_optimizer_states()  # DTensor states of the device side: their shards go to the host
    check(opt.memory_stats()["device_state_bytes"] == 0, "offloaded")
    opt.reload_optimizer_states()
    train(model, opt, 1, start=8)
    train(ref_model, ref, 1, start=8)
    check(same(locals_of(model), locals_of(ref_model)), "params after an offload and reload of the states")
    print(f"HYBRID-FSDP2-OK rank={dist.get_rank()}", flush=True)
    opt.close()  # no copy-stream worker left running at interpreter shutdown


if __name__ == "__main__":
    main(sys.argv[1])
    shutdown_runtime()  # collects what holds the group before destroying it, as train.py does
"""


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_fsdp2_two_ranks_bitwise_and_dcp_round_trip(tmp_path):
    """Params bitwise vs AdamW(fused=True) per rank; DCP save/load into 0.5, 1.0 and a plain AdamW resumes bitwise."""
    script = tmp_path / "fsdp2_hybrid.py"
    script.write_text(FSDP2_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = run_python([*cmd, str(tmp_path / "ckpt")], env=env, timeout=300, expect_success=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "HYBRID-FSDP2-OK rank=0" in proc.stdout and "HYBRID-FSDP2-OK rank=1" in proc.stdout


# ---- host-resident params (fp32 masters of a low-precision model) ----------------------------------


def host_record(master: torch.Tensor) -> ParamRecord:
    """The record MasterWeights makes for a host master: the bf16 model parameter its updates are rounded into."""
    model = torch.nn.Parameter(master.detach().to(torch.bfloat16))
    return ParamRecord(model, master, "host", model_param=model.detach())


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "bulk"])
def test_host_resident_cpu_share_steps_in_place_and_writes_the_model(overlap):
    """The CPU share is its own master (its record's `model_param` + `device_grad`): no second copy, bf16 model
    updated."""
    params, ref_params = make_params(), make_params()
    resident = [i for i, on_cpu in enumerate(CPU_AT_HALF) if on_cpu]
    records = {i: host_record(params[i]) for i in resident}
    opt = hybrid(params, offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=overlap, records=records.values())
    ref = reference(ref_params)
    for step in range(20):
        for i, (p, g) in enumerate(zip(params, grads(step, params))):
            if i in resident:
                records[i].device_grad, p.grad = g, None
            else:
                p.grad = g
        for p, g in zip(ref_params, grads(step, ref_params)):
            p.grad = g
        opt.step()
        ref.step()
    assert_bitwise(opt, params, ref, ref_params)
    for i in resident:
        assert torch.equal(records[i].model_param, ref_params[i].detach().to(torch.bfloat16))
        slot = next(s for u in opt._cpu_units for s in u.slots if s.param is params[i])
        assert slot.master.data_ptr() == params[i].data_ptr()  # stepped in place, no second master


def test_host_resident_param_outside_the_cpu_share_is_refused():
    params = make_params()
    record = host_record(params[4])  # device-stepped at 0.5
    with pytest.raises(ValueError, match="outside the CPU share"):
        hybrid(params, offload_fraction=0.5, records=[record])

"""Unit tests for `SwapAdamW`: AdamW with host-resident states swapped through the device inside `step()`.

Everything runs on the cpu backend, where "device" states are ordinary tensors allocated inside `step()`,
host states come from `Accelerator.host_empty` (shared-memory buffers) and the H2D / D2H copies run on
side-stream worker threads. The reference is always `torch.optim.AdamW` with the same arguments, and
equality is `torch.equal` (bitwise), never a tolerance.
"""

import copy
import io
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from runner import run_python
from stream_gates import held_back

from internlm_offload.device import Accelerator, StreamError
from internlm_offload.optim.records import ParamRecord
from internlm_offload.optim.adamw_rule import ADAMW_STATE_KEYS as SWAPPED_KEYS
from internlm_offload.optim.swap import SLOT_ALIGNMENT, SwapAdamW, _Chunk

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """Elementwise kernels give the same bits on any thread count; one thread keeps a loaded 2-core box fast
    (torch's fused cpu AdamW spins its OpenMP team and can take seconds per run under contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def acc() -> Iterator[Accelerator]:
    accelerator = Accelerator("cpu")
    yield accelerator
    accelerator.close_streams()


# ---------------------------------------------------------------- model and grads

# role: "train" (grad every step), "frozen" (requires_grad=False), "sometimes" (grad None on steps 1, 4, 7, ...),
# "late" (grad None on steps 0..4: its state is created lazily mid-run).
SHAPES = [((1,), "train"), ((7,), "train"), ((1023,), "train"), ((4097,), "train"), ((33, 17), "train"),
          ((5,), "frozen"), ((64,), "sometimes"), ((300,), "late")]  # fmt: skip


def make_params(shapes: list, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape, role in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen), requires_grad=role != "frozen")
        p.role = role
        params.append(p)
    return params


def clone_params(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        q.role = p.role
        out.append(q)
    return out


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """Deterministic grads for `step`, the same for every copy of the params."""
    for i, p in enumerate(params):
        none = p.role == "frozen" or (p.role == "sometimes" and step % 3 == 1) or (p.role == "late" and step < 5)
        if none:
            p.grad = None
        else:
            gen = torch.Generator().manual_seed(10_000 * step + i)
            p.grad = torch.randn(p.shape, generator=gen) * (1.0 + i)


def groups_for(params: list[torch.nn.Parameter], two_groups: bool) -> list:
    if not two_groups:
        return params
    half = len(params) // 2
    return [
        {"params": params[:half], "lr": 2e-2, "weight_decay": 0.2},
        {"params": params[half:], "lr": 3e-3, "weight_decay": 0.0},
    ]


def run_steps(opt: torch.optim.Optimizer, params: list, start: int, stop: int, sched: object = None) -> None:
    for step in range(start, stop):
        set_grads(params, step)
        opt.step()
        if sched is not None:
            sched.step()


def assert_same(ref_opt: torch.optim.Optimizer, ref_params: list, opt: torch.optim.Optimizer, params: list) -> None:
    """Params and every state tensor (step included) bitwise equal, with equal keys, dtypes and shapes."""
    for i, (rp, p) in enumerate(zip(ref_params, params, strict=True)):
        assert torch.equal(rp.detach(), p.detach()), f"param {i} ({tuple(p.shape)}, {p.role}) differs"
        ref_state, state = ref_opt.state.get(rp, {}), opt.state.get(p, {})
        assert set(state) == set(ref_state), f"param {i}: state keys {sorted(state)} != {sorted(ref_state)}"
        for key, ref in ref_state.items():
            got = state[key]
            assert got.dtype == ref.dtype and got.shape == ref.shape and got.device == ref.device, (i, key)
            assert torch.equal(got, ref), f"param {i} ({tuple(p.shape)}, {p.role}): state {key!r} differs"


def padded(nbytes: int) -> int:
    """Device bytes of one state tensor: every tensor of a chunk starts on a SLOT_ALIGNMENT boundary."""
    return -(-nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def adamw_keys(amsgrad: bool) -> set[str]:
    return {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())


def _foreach_on_cpu_works() -> bool:
    try:
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.ones(3)
        torch.optim.AdamW([p], foreach=True).step()
        return True
    except Exception:  # noqa: BLE001
        return False


FOREACH_OK = _foreach_on_cpu_works()

CASES = {
    "weight_decay": dict(lr=1e-2, weight_decay=0.1),
    "amsgrad": dict(lr=1e-2, weight_decay=0.05, amsgrad=True),
    "maximize": dict(lr=1e-2, weight_decay=0.05, maximize=True),
    "betas_eps": dict(lr=5e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
    "fused": dict(lr=1e-2, weight_decay=0.1, fused=True),
    "fused_amsgrad_maximize": dict(lr=1e-2, weight_decay=0.1, fused=True, amsgrad=True, maximize=True),
    "foreach": dict(lr=1e-2, weight_decay=0.1, foreach=True),
    "foreach_amsgrad": dict(lr=1e-2, weight_decay=0.1, foreach=True, amsgrad=True),
    "two_groups": dict(lr=1e-2, weight_decay=0.1),
    "two_groups_fused": dict(lr=1e-2, weight_decay=0.1, fused=True),
    "lambda_lr": dict(lr=1e-2, weight_decay=0.1),
    "lambda_lr_fused_amsgrad": dict(lr=1e-2, weight_decay=0.1, fused=True, amsgrad=True),
}
if not FOREACH_OK:  # torch refused foreach=True on cpu: nothing to compare against
    CASES = {k: v for k, v in CASES.items() if "foreach" not in k}


def build_pair(
    acc: Accelerator,
    shapes: list,
    kwargs: dict,
    times: int,
    two_groups: bool = False,
    lambda_lr: bool = False,
    **swap_kwargs: object,
) -> tuple:
    ref_params = make_params(shapes)
    params = clone_params(ref_params)
    ref = torch.optim.AdamW(groups_for(ref_params, two_groups), **kwargs)
    opt = SwapAdamW(
        groups_for(params, two_groups), swap_optimizer_times=times, accelerator=acc, **kwargs, **swap_kwargs
    )
    ref_sched = sched = None
    if lambda_lr:
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 0.9**s + 0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s + 0.05)
    return ref, ref_params, ref_sched, opt, params, sched


# ---------------------------------------------------------------- parity with torch AdamW


def test_foreach_is_accepted_on_cpu() -> None:
    # Documents why the foreach cases run (or were dropped).
    assert FOREACH_OK, "torch refused foreach=True on cpu; the foreach parity cases are dropped"


@pytest.mark.parametrize("times", [1, 3, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_adamw_50_steps(acc: Accelerator, case: str, times: int) -> None:
    kwargs = CASES[case]
    ref, ref_params, ref_sched, opt, params, sched = build_pair(
        acc, SHAPES, kwargs, times, two_groups="two_groups" in case, lambda_lr="lambda_lr" in case
    )
    for step in range(50):
        set_grads(ref_params, step)
        set_grads(params, step)
        ref.step()
        opt.step()
        if sched is not None:
            ref_sched.step()
            sched.step()
        if step in (0, 5, 24):  # early divergence is easier to read than a final one
            assert_same(ref, ref_params, opt, params)
    assert_same(ref, ref_params, opt, params)
    # Every trainable param that ever had a grad has AdamW's exact keys; the frozen one has no state.
    for p in params:
        if p.role == "frozen":
            assert not opt.state.get(p)
        else:
            assert set(opt.state[p]) == adamw_keys(kwargs.get("amsgrad", False))
    if sched is not None:
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
        assert opt.param_groups[0]["lr"] != kwargs["lr"]  # the scheduler really changed it


def test_parity_large_odd_param(acc: Accelerator) -> None:
    shapes = [((1_000_001,), "train"), ((7,), "train"), ((4097,), "sometimes")]
    kwargs = dict(lr=1e-2, weight_decay=0.1, amsgrad=True)
    ref, ref_params, _, opt, params, _ = build_pair(acc, shapes, kwargs, times=3)
    run_steps(ref, ref_params, 0, 50)
    run_steps(opt, params, 0, 50)
    assert_same(ref, ref_params, opt, params)
    # The big param is larger than the budget on its own, so it was swapped in alone.
    big = 3 * padded(4 * 1_000_001)
    assert opt.memory_stats()["peak_device_state_bytes"] == big


def test_closure_loss_is_returned_and_step_matches(acc: Accelerator) -> None:
    ref, ref_params, _, opt, params, _ = build_pair(acc, SHAPES, dict(lr=1e-2), times=2)
    for step in range(3):
        for o, ps in ((ref, ref_params), (opt, params)):

            def closure(ps: list = ps, step: int = step) -> torch.Tensor:
                set_grads(ps, step)
                return torch.tensor(float(step))

            assert o.step(closure).item() == float(step)
    assert_same(ref, ref_params, opt, params)


def test_two_instances_coexist(acc: Accelerator) -> None:
    """State is per instance: two optimizers stepped alternately in one process both match AdamW."""
    pairs = [build_pair(acc, SHAPES, dict(lr=1e-2, fused=f), times=t) for f, t in ((None, 4), (True, 2))]
    for step in range(6):
        for ref, ref_params, _, opt, params, _ in pairs:
            run_steps(ref, ref_params, step, step + 1)
            run_steps(opt, params, step, step + 1)
    for ref, ref_params, _, opt, params, _ in pairs:
        assert_same(ref, ref_params, opt, params)


# ---------------------------------------------------------------- state placement between steps


@pytest.mark.parametrize("fused", [None, True])
def test_states_are_separate_host_buffers_between_steps(
    acc: Accelerator, fused: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = make_params(SHAPES)
    opt = SwapAdamW(params, lr=1e-2, fused=fused, amsgrad=True, swap_optimizer_times=4, accelerator=acc)
    seen: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
    original = SwapAdamW._update

    def recording_update(self: SwapAdamW, chunk: _Chunk, active: dict) -> None:
        original(self, chunk, active)
        for p in chunk.stepped:
            dev = {s.key: chunk.view(s) for s in chunk.slots if s.param is p}
            for key, dev_t in dev.items():
                assert dev_t.untyped_storage().data_ptr() != self.state[p][key].untyped_storage().data_ptr(), key
            # Cloned now: the device buffer goes back to the cache and serves a later chunk.
            seen.append((p, {key: t.clone() for key, t in dev.items()}))

    monkeypatch.setattr(SwapAdamW, "_update", recording_update)
    host_ptrs = None
    for step in range(4):
        seen.clear()
        run_steps(opt, params, step, step + 1)
        assert opt.memory_stats()["device_state_bytes"] == 0
        # The device copies were cloned right after their update, before any copy-out.
        assert seen and all(set(dev) == set(SWAPPED_KEYS) | ({"step"} if fused else set()) for _, dev in seen)
        for p, dev in seen:
            for key, dev_t in dev.items():
                host_t = opt.state[p][key]
                assert host_t is not dev_t
                assert host_t.untyped_storage().data_ptr() != dev_t.untyped_storage().data_ptr()
                assert torch.equal(host_t, dev_t), "the copy-out landed in the host buffer"
        for p in params:
            if p.role != "frozen" and opt.state.get(p):
                assert set(opt.state[p]) == adamw_keys(True)
                assert all(t.device.type == "cpu" for t in opt.state[p].values())
                if p.numel() * 4 >= 4096:  # big enough for the cpu host tier: a shared-memory mapping
                    assert opt.state[p]["exp_avg"].untyped_storage().filename is not None
        # The host buffers are allocated once and reused in place.
        ptrs = {(id(p), k): t.data_ptr() for p in params for k, t in opt.state.get(p, {}).items() if p.role == "train"}
        if host_ptrs is not None:
            assert ptrs == host_ptrs
        host_ptrs = ptrs
    del seen


def test_memory_stats_between_steps(acc: Accelerator) -> None:
    params = make_params(SHAPES)
    opt = SwapAdamW(params, lr=1e-2, swap_optimizer_times=3, accelerator=acc)
    assert opt.memory_stats() == {"device_state_bytes": 0, "peak_device_state_bytes": 0, "host_state_bytes": 0}
    run_steps(opt, params, 0, 6)
    stats = opt.memory_stats()
    assert stats["device_state_bytes"] == 0
    assert stats["peak_device_state_bytes"] > 0
    with_state = [p for p in params if opt.state.get(p)]
    # exp_avg + exp_avg_sq (fp32) plus the 4-byte host `step` of each param that has state
    assert stats["host_state_bytes"] == sum(8 * p.numel() + 4 for p in with_state)


def test_memory_stats_do_not_wait_for_the_write_back(acc: Accelerator) -> None:
    """metrics.jsonl reads memory_stats() every step: it must not be a host sync on the copy stream."""
    params = make_params(SHAPES)
    opt = SwapAdamW(params, lr=1e-2, accelerator=acc)
    run_steps(opt, params, 0, 2)
    waits = []
    sync = opt._d2h.stream.synchronize
    opt._d2h.stream.synchronize = lambda: waits.append(1) or sync()
    stats = opt.memory_stats()
    assert waits == [] and stats["host_state_bytes"] > 0
    opt.state_dict()  # reading the values does wait
    assert waits == [1]


def test_offload_and_reload_are_noops(acc: Accelerator) -> None:
    params = make_params(SHAPES)
    opt = SwapAdamW(params, lr=1e-2, fused=True, swap_optimizer_times=3, accelerator=acc)
    run_steps(opt, params, 0, 3)
    before = {(id(p), k): (t, t.clone()) for p in params for k, t in opt.state.get(p, {}).items()}
    stats = opt.memory_stats()
    assert opt.offload_optimizer_states() is False
    assert opt.reload_optimizer_states() is False
    assert opt.memory_stats() == stats
    after = {(id(p), k): t for p in params for k, t in opt.state.get(p, {}).items()}
    assert after.keys() == before.keys()
    for key, (obj, value) in before.items():
        assert after[key] is obj and torch.equal(after[key], value)


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_swap_optimizer_times(acc: Accelerator, bad: int) -> None:
    with pytest.raises(ValueError, match="swap_optimizer_times"):
        SwapAdamW(make_params(SHAPES), swap_optimizer_times=bad, accelerator=acc)


# ---------------------------------------------------------------- device memory bound

BOUND_SHAPES = [((n,), "train") for n in (3, 5000, 17, 1, 120_000, 640, 33, 70_001, 2, 9000,
                                          4097, 250, 31_000, 8, 1023, 55_555, 12, 600, 2048, 15)]  # fmt: skip


class LiveDeviceBytes:
    """An independent ledger: bytes of the device buffers taken from the accelerator and not yet given back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.live = self.peak = 0
        take, give_back = Accelerator.device_buffer, Accelerator.free_device_buffer

        def counting_take(acc: Accelerator, nbytes: int) -> torch.Tensor:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            return take(acc, nbytes)

        def counting_give_back(acc: Accelerator, buffer: torch.Tensor) -> None:
            self.live -= buffer.numel()
            give_back(acc, buffer)

        monkeypatch.setattr(Accelerator, "device_buffer", counting_take)
        monkeypatch.setattr(Accelerator, "free_device_buffer", counting_give_back)


def test_chunks_and_pieces_are_consecutive_runs_of_one_group() -> None:
    """The rule the swap optimizer's chunks and the hybrid's CPU-step pieces share: in order, a new run at each
    group and before the target would be passed; an item over the target alone."""
    from internlm_offload.optim.adamw import consecutive_runs

    items = [("a", 3), ("a", 3), ("a", 5), ("b", 1), ("b", 9), ("b", 1), ("b", 1)]
    runs = consecutive_runs(items, group_of=lambda item: item[0], size_of=lambda item: item[1], target=6)
    assert runs == [[("a", 3), ("a", 3)], [("a", 5)], [("b", 1)], [("b", 9)], [("b", 1), ("b", 1)]]


@pytest.mark.parametrize("kwargs", [dict(), dict(fused=True, amsgrad=True)], ids=["plain", "fused_amsgrad"])
def test_peak_device_state_bytes_bounded(acc: Accelerator, kwargs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    n_states = 3 if kwargs.get("amsgrad") else 2
    step_bytes = padded(4) if kwargs.get("fused") else 0  # fused keeps `step` on the device: swapped too
    per_param = [n_states * padded(4 * math.prod(s)) + step_bytes for s, _ in BOUND_SHAPES]
    total, largest = sum(per_param), max(per_param)
    peaks = {}
    for times in (1, 2, 4, 16):
        ledger = LiveDeviceBytes(monkeypatch)
        params = make_params(BOUND_SHAPES)
        opt = SwapAdamW(params, lr=1e-2, swap_optimizer_times=times, accelerator=acc, **kwargs)
        for step in range(3):
            ledger.peak = 0
            run_steps(opt, params, step, step + 1)
            peak = opt.memory_stats()["peak_device_state_bytes"]
            assert peak <= math.ceil(total / times) + largest, (times, peak)
            # tighter, as documented: the budget, or one parameter's states when it alone is larger
            assert peak <= max(math.ceil(total / times), largest), (times, peak)
            assert ledger.peak == peak, "the optimizer's own ledger disagrees with the tensors alive"
            assert ledger.live == 0 and opt.memory_stats()["device_state_bytes"] == 0
        peaks[times] = peak
        monkeypatch.undo()
    assert peaks[1] == total
    assert peaks[1] >= peaks[2] >= peaks[4] >= peaks[16]
    assert peaks[16] < peaks[1] / 2  # it really chunks


# ---------------------------------------------------------------- state_dict layout


def _walk(obj: object, path: str = "") -> Iterator[tuple[str, object]]:
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(k, f"{path}.key")
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("kwargs", [dict(lr=1e-2), dict(lr=1e-2, fused=True, amsgrad=True)], ids=["plain", "fused"])
def test_state_dict_is_adamw_layout(acc: Accelerator, kwargs: dict) -> None:
    ref, ref_params, _, opt, params, _ = build_pair(acc, SHAPES, kwargs, times=3, two_groups=True)
    run_steps(ref, ref_params, 0, 7)
    run_steps(opt, params, 0, 7)
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    for path, value in _walk(sd):
        assert value is None or isinstance(value, (torch.Tensor, int, float, bool, str, dict, list, tuple)), path
        assert not callable(value) or isinstance(value, torch.Tensor), path
    assert sd.keys() == ref_sd.keys() == {"state", "param_groups"}
    assert sd["param_groups"] == ref_sd["param_groups"]  # same keys, same values
    assert sd["state"].keys() == ref_sd["state"].keys()
    loaded = _roundtrip(sd)
    for idx, state in ref_sd["state"].items():
        assert loaded["state"][idx].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(loaded["state"][idx][key], value), (idx, key)
            assert loaded["state"][idx][key].dtype == value.dtype


@pytest.mark.parametrize(
    "kwargs", [dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, fused=True, amsgrad=True)], ids=["plain", "fused_amsgrad"]
)
@pytest.mark.parametrize("direction", ["swap_to_adamw", "adamw_to_swap"])
def test_state_dict_interchangeable_with_adamw(acc: Accelerator, kwargs: dict, direction: str) -> None:
    """A plain AdamW continues from SwapAdamW's state_dict and vice versa, bitwise as if uninterrupted."""
    ref_params = make_params(SHAPES)
    ref = torch.optim.AdamW(ref_params, **kwargs)
    run_steps(ref, ref_params, 0, 20)

    first_params = make_params(SHAPES)
    first_cls, second_cls = (
        (SwapAdamW, torch.optim.AdamW) if direction == "swap_to_adamw" else (torch.optim.AdamW, SwapAdamW)
    )
    extra = lambda cls: dict(accelerator=acc, swap_optimizer_times=5) if cls is SwapAdamW else {}  # noqa: E731
    first = first_cls(first_params, **kwargs, **extra(first_cls))
    run_steps(first, first_params, 0, 10)
    params = clone_params(first_params)
    second = second_cls(params, **kwargs, **extra(second_cls))
    second.load_state_dict(first.state_dict())
    del first  # nothing of it may be needed any more
    run_steps(second, params, 10, 20)
    assert_same(ref, ref_params, second, params)


# ---------------------------------------------------------------- checkpoint round trip


@pytest.mark.parametrize("fused", [None, True])
@pytest.mark.parametrize("times_after,arena_after", [(3, False), (1, False), (7, True)])
def test_checkpoint_round_trip_with_other_chunking(
    acc: Accelerator, tmp_path: Path, fused: bool | None, times_after: int, arena_after: bool
) -> None:
    kwargs = dict(lr=1e-2, weight_decay=0.1, amsgrad=True, fused=fused)
    straight_params = make_params(SHAPES)
    straight = SwapAdamW(straight_params, swap_optimizer_times=16, accelerator=acc, **kwargs)
    run_steps(straight, straight_params, 0, 20)
    ref_params = make_params(SHAPES)
    ref = torch.optim.AdamW(ref_params, **kwargs)
    run_steps(ref, ref_params, 0, 20)
    assert_same(ref, ref_params, straight, straight_params)

    params = make_params(SHAPES)
    opt = SwapAdamW(params, swap_optimizer_times=16, accelerator=acc, **kwargs)
    run_steps(opt, params, 0, 10)
    torch.save({"optim": opt.state_dict(), "params": [p.detach() for p in params]}, tmp_path / "ckpt.pt")
    del opt
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed_params = make_params(SHAPES)
    with torch.no_grad():
        for p, saved in zip(resumed_params, ckpt["params"], strict=True):
            p.copy_(saved)
    resumed = SwapAdamW(
        resumed_params,
        swap_optimizer_times=times_after,
        use_pinned_optimizer_offload=arena_after,
        accelerator=acc,
        **kwargs,
    )
    resumed.load_state_dict(ckpt["optim"])
    assert resumed.memory_stats()["device_state_bytes"] == 0
    run_steps(resumed, resumed_params, 10, 20)
    assert_same(straight, straight_params, resumed, resumed_params)


@pytest.mark.parametrize("arena", [False, True])
def test_loaded_state_is_really_used(acc: Accelerator, arena: bool) -> None:
    params = make_params(SHAPES)
    opt = SwapAdamW(params, lr=1e-2, swap_optimizer_times=4, accelerator=acc)
    run_steps(opt, params, 0, 10)
    sd = _roundtrip(opt.state_dict())
    saved = [p.detach().clone() for p in params]

    def resume(state_dict: dict) -> tuple[SwapAdamW, list]:
        ps = clone_params(params)
        with torch.no_grad():
            for p, s in zip(ps, saved, strict=True):
                p.copy_(s)
        o = SwapAdamW(ps, lr=1e-2, swap_optimizer_times=2, use_pinned_optimizer_offload=arena, accelerator=acc)
        o.load_state_dict(state_dict)
        return o, ps

    base, base_params = resume(copy.deepcopy(sd))
    perturbed_sd = copy.deepcopy(sd)
    perturbed_sd["state"][2]["exp_avg"] += 0.5  # param 2: the 1023-element one
    perturbed, perturbed_params = resume(perturbed_sd)
    # After the load the optimizer owns its states: changing the dict it was given changes nothing.
    perturbed_sd["state"][3]["exp_avg"] += 0.5
    # ... while writing the optimizer's own state (in place) is seen by the next step.
    mutated, mutated_params = resume(copy.deepcopy(sd))
    mutated.state[mutated_params[4]]["exp_avg_sq"].mul_(4.0)
    for o, ps in ((base, base_params), (perturbed, perturbed_params), (mutated, mutated_params)):
        run_steps(o, ps, 10, 11)
    diff = [i for i, (a, b) in enumerate(zip(base_params, perturbed_params)) if not torch.equal(a, b)]
    assert diff == [2]
    diff = [i for i, (a, b) in enumerate(zip(base_params, mutated_params)) if not torch.equal(a, b)]
    assert diff == [4]


def test_reload_own_state_dict_with_arena_keeps_states(acc: Accelerator) -> None:
    """`opt.load_state_dict(opt.state_dict())` (DCP's in-place load path does the same) must be a no-op."""
    params = make_params(SHAPES)
    opt = SwapAdamW(params, lr=1e-2, swap_optimizer_times=4, use_pinned_optimizer_offload=True, accelerator=acc)
    run_steps(opt, params, 0, 3)
    before = {(id(p), k): t.clone() for p in params for k, t in opt.state.get(p, {}).items()}
    opt.load_state_dict(opt.state_dict())
    after = {(id(p), k): t for p in params for k, t in opt.state.get(p, {}).items()}
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_reload_own_state_dict_without_arena_keeps_states(acc: Accelerator) -> None:
    params = make_params(SHAPES)
    opt = SwapAdamW(params, lr=1e-2, fused=True, swap_optimizer_times=4, accelerator=acc)
    run_steps(opt, params, 0, 3)
    before = {(id(p), k): t.clone() for p in params for k, t in opt.state.get(p, {}).items()}
    opt.load_state_dict(opt.state_dict())
    after = {(id(p), k): t for p in params for k, t in opt.state.get(p, {}).items()}
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


# ---------------------------------------------------------------- host arena


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize(
    "kwargs", [dict(lr=1e-2), dict(lr=1e-2, fused=True, amsgrad=True, weight_decay=0.1)], ids=["plain", "fused_amsgrad"]
)
def test_host_arena_parity_one_buffer_no_new_allocations(
    acc: Accelerator, kwargs: dict, pinned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every state lives in one host slab (pinned or not, as the flag says), allocated by the first step only."""
    shapes = [s for s in SHAPES if s[1] != "late"]  # every trainable param gets its state at step 0
    ref, ref_params, _, opt, params, _ = build_pair(acc, shapes, kwargs, times=3, use_pinned_optimizer_offload=pinned)
    calls = []
    original = Accelerator.host_empty

    def counting_host_empty(self: Accelerator, *args: object, **kw: object) -> torch.Tensor:
        calls.append((args, kw))
        return original(self, *args, **kw)

    monkeypatch.setattr(Accelerator, "host_empty", counting_host_empty)
    for step in range(8):
        if step == 1:
            calls.clear()
        run_steps(ref, ref_params, step, step + 1)
        run_steps(opt, params, step, step + 1)
        if step == 0:
            assert [kw for _, kw in calls] == [{"pinned": pinned}], "the first step allocates the arena, only it"
    assert calls == [], "host memory allocated after the first step"
    assert_same(ref, ref_params, opt, params)
    swapped = [opt.state[p][k] for p in params if opt.state.get(p) for k in SWAPPED_KEYS if k in opt.state[p]]
    assert len(swapped) == (3 if kwargs.get("amsgrad") else 2) * sum(p.requires_grad for p in params)
    base = opt._arena.buffer.untyped_storage().data_ptr()
    assert {t.untyped_storage().data_ptr() for t in swapped} == {base}
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in swapped)
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:])), "arena views overlap"


def test_a_pageable_slab_on_a_device_says_its_copies_block(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    params = make_params(SHAPES)
    monkeypatch.setattr(Accelerator, "supports_pinned_memory", property(lambda self: True))  # as on cuda
    with caplog.at_level("WARNING"):
        SwapAdamW(params, swap_optimizer_times=2, accelerator=Accelerator("cpu"), use_pinned_optimizer_offload=True)
    assert "pageable" not in caplog.text
    with caplog.at_level("WARNING"):
        SwapAdamW(params, swap_optimizer_times=2, accelerator=Accelerator("cpu"))
    assert "use_pinned_optimizer_offload=False keeps the states in pageable memory" in caplog.text


def _fail(message: str) -> None:
    raise RuntimeError(message)


def test_close_waits_for_the_copies_and_reports_a_failed_one(acc: Accelerator) -> None:
    """close() waits for the copies in flight before it stops the streams (on a device a copy-out may still
    write the host slab): that wait is where a failed copy surfaces, which stopping the streams alone would lose."""
    params = make_params(SHAPES)
    opt = SwapAdamW(params, lr=1e-2, swap_optimizer_times=3, accelerator=acc)
    run_steps(opt, params, 0, 1)
    opt._d2h.stream.submit(_fail, "a copy-out failed")
    with pytest.raises(StreamError) as failure:
        opt.close()
    assert str(failure.value.__cause__) == "a copy-out failed"
    assert opt._h2d.stream.closed and opt._d2h.stream.closed


# ---------------------------------------------------------------- races


RACE_SHAPES = [((4096,), "train"), ((3000,), "train"), ((5000,), "train"), ((777,), "train")]


def _delay_streams(opt: SwapAdamW, acc: Accelerator, h2d_s: float, d2h_s: float) -> None:
    opt._h2d.stream.close()
    opt._d2h.stream.close()
    opt._h2d.stream = acc.stream(delay_s=h2d_s)
    opt._d2h.stream = acc.stream(delay_s=d2h_s)


@pytest.fixture
def poisoned_empty_like(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every device buffer handed out starts as NaN bytes (never lucky zeros or the right old values).

    Freed buffers still go back to the accelerator's cache and are handed out again at once, so a copy
    that runs late lands in memory another chunk uses, as with the caching allocator."""
    take = Accelerator.device_buffer
    monkeypatch.setattr(Accelerator, "device_buffer", lambda acc, nbytes: take(acc, nbytes).fill_(0xFF))


@pytest.mark.parametrize("fused", [None, True])
def test_delayed_streams_still_bitwise(acc: Accelerator, fused: bool | None, poisoned_empty_like: None) -> None:
    kwargs = dict(lr=1e-2, weight_decay=0.1, fused=fused, amsgrad=True)
    ref, ref_params, _, opt, params, _ = build_pair(acc, SHAPES, kwargs, times=3)
    _delay_streams(opt, acc, 0.002, 0.002)
    run_steps(ref, ref_params, 0, 5)
    run_steps(opt, params, 0, 5)
    assert_same(ref, ref_params, opt, params)


def test_skipping_copy_in_wait_is_caught(
    acc: Accelerator, poisoned_empty_like: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: without the wait before the update, the chunk's buffer is stepped (and freed) while its slow
    copy-in still writes it; the cpu backend refuses the free (a device would hand the memory on)."""
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    ref, ref_params, _, opt, params, _ = build_pair(acc, RACE_SHAPES, kwargs, times=2)
    run_steps(opt, params, 0, 1)  # the states exist: every later step copies them in
    original = SwapAdamW._copy_in

    def copy_in_without_wait(self: SwapAdamW, *args: object) -> _Chunk:
        chunk = original(self, *args)
        chunk.copied_in = self.accelerator.event()  # never recorded: already complete
        return chunk

    monkeypatch.setattr(SwapAdamW, "_copy_in", copy_in_without_wait)
    gate = held_back(opt._h2d.stream)  # the copy-ins certainly have not run when the buffers are freed
    with pytest.raises(RuntimeError, match="freed while cpu-stream-.* may still use it"):
        run_steps(opt, params, 1, 2)
    gate.set()


def test_skipping_copy_out_wait_is_caught(
    acc: Accelerator, poisoned_empty_like: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: without waiting for its D2H copy, a chunk's buffer is freed while the copy still reads it."""
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    ref, ref_params, _, opt, params, _ = build_pair(acc, RACE_SHAPES, kwargs, times=2)
    run_steps(opt, params, 0, 1)
    original = SwapAdamW._copy_out

    def copy_out_without_event(self: SwapAdamW, chunk: _Chunk) -> None:
        original(self, chunk)
        chunk.copied_out = self.accelerator.event()  # never recorded: already complete

    monkeypatch.setattr(SwapAdamW, "_copy_out", copy_out_without_event)
    gate = held_back(opt._d2h.stream)  # the copy-outs certainly have not run when the buffers are freed
    with pytest.raises(RuntimeError, match="freed while cpu-stream-.* may still use it"):
        run_steps(opt, params, 1, 2)
    gate.set()


# ---------------------------------------------------------------- FSDP2 (two gloo processes)

FSDP_SCRIPT = r"""
import os
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from internlm_offload.device import Accelerator
from internlm_offload.optim.swap import SwapAdamW

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


ref_model, model = build(), build()
initial = {id(p): p.to_local().clone() for p in model.parameters()}
ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
opt = SwapAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True, swap_optimizer_times=3,
                accelerator=Accelerator("cpu"))
for step in range(5):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 13, generator=gen), torch.randn(4, 5, generator=gen)
    for m, o in ((ref_model, ref), (model, opt)):
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        o.zero_grad()

pairs = list(zip(ref_model.parameters(), model.parameters(), strict=True))
assert len(pairs) == 4
for rp, p in pairs:
    assert isinstance(p, DTensor) and isinstance(rp, DTensor)
    assert torch.equal(rp.to_local(), p.to_local()), "param differs"
    assert not torch.equal(p.to_local(), initial[id(p)]), "param never updated"
    state, ref_state = opt.state[p], ref.state[rp]
    assert set(state) == set(ref_state) == {"step", "exp_avg", "exp_avg_sq"}, set(state)
    for key in ("exp_avg", "exp_avg_sq"):
        t = state[key]
        assert isinstance(t, DTensor), key
        assert t.placements == p.placements and t.device_mesh == p.device_mesh, (t.placements, p.placements)
        assert t.shape == p.shape and t.to_local().shape == p.to_local().shape
        assert torch.equal(t.to_local(), ref_state[key].to_local()), key
    assert torch.equal(state["step"], ref_state["step"]) and state["step"].item() == 5
assert opt.memory_stats()["device_state_bytes"] == 0
print(f"FSDP2-OK rank={rank}", flush=True)
from internlm_offload.engine.runtime import shutdown_runtime

shutdown_runtime()  # collects what holds the group before destroying it (a bare destroy aborted once in CI)
"""


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_fsdp2_two_ranks_bitwise_with_dtensor_states(tmp_path: Path) -> None:
    script = tmp_path / "fsdp2_swap.py"
    script.write_text(FSDP_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = run_python(cmd, env=env, timeout=300, expect_success=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "FSDP2-OK rank=0" in proc.stdout and "FSDP2-OK rank=1" in proc.stdout


def test_host_memory_preflight_refuses_what_does_not_fit() -> None:
    from internlm_offload.optim.memory import HostMemoryError, check_host_memory

    check_host_memory(10 * 2**30, "swap_optimizer", available=64 * 2**30, world_local=2)  # fits
    with pytest.raises(HostMemoryError, match=r"needs 20.00 GiB .*\(2 process\(es\) x 10.00 GiB\) but only 16.00 GiB"):
        check_host_memory(10 * 2**30, "swap_optimizer", available=16 * 2**30, world_local=2)


# ---------------------------------------------------------------- host-resident params (fp32 masters)


@pytest.mark.parametrize("times", [1, 3])
def test_swapped_masters_match_adamw_on_device_masters_and_write_the_model(acc, times):
    """`swap_params`: fp32 masters on the host, grads in their records' `device_grad`, updates rounded into the
    records' `model_param`."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(33, 17), (7,), (4097,)]
    reference = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    masters, records = [], []
    for ref in reference:
        host = torch.nn.Parameter(acc.host_empty(ref.shape, torch.float32).copy_(ref.detach()))
        model = torch.nn.Parameter(ref.detach().to(torch.bfloat16))
        masters.append(host)
        records.append(ParamRecord(model, host, "host", model_param=model.detach()))
    expected = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    swapped = SwapAdamW(
        masters,
        lr=1e-2,
        weight_decay=0.1,
        fused=True,
        swap_optimizer_times=times,
        swap_params=True,
        records=records,
        accelerator=acc,
    )
    for _ in range(5):
        for ref, record in zip(reference, records):
            grad = torch.randn(ref.shape, generator=gen)
            ref.grad, record.device_grad = grad, grad.clone()
        expected.step()
        swapped.step()
        swapped.finish_copies()
        for ref, master, record in zip(reference, masters, records):
            assert torch.equal(master, ref) and master.grad is None
            assert torch.equal(record.model_param, ref.detach().to(torch.bfloat16))
    stats = swapped.memory_stats()
    assert stats["device_state_bytes"] == 0 and stats["host_param_bytes"] == sum(m.numel() * 4 for m in masters)
    for ref, master in zip(reference, masters):
        assert torch.equal(swapped.state[master]["exp_avg_sq"], expected.state[ref]["exp_avg_sq"])


# ---------------------------------------------------------------- prefetch and device buffers


@pytest.mark.parametrize("arena", [False, True])
def test_prefetch_before_step_stays_bitwise(
    acc: Accelerator, poisoned_empty_like: None, arena: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prefetch()` (the trainer calls it before the last backward) copies the first chunk in early.

    The "late" param gets its first grad at step 5: its zeroed state must replace the stale prefetched
    copy (host buffers start as NaN bytes here, as uninitialised memory may)."""
    host_empty = Accelerator.host_empty

    def nan_host_empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = host_empty(*args, **kwargs)
        t.reshape(-1).view(torch.uint8).fill_(0xFF)
        return t

    monkeypatch.setattr(Accelerator, "host_empty", nan_host_empty)
    kwargs = dict(lr=1e-2, weight_decay=0.1, fused=True, amsgrad=True)
    shapes = [((300,), "late")] + [s for s in SHAPES if s[1] != "late"]  # the late param in the first chunk
    ref, ref_params, _, opt, params, _ = build_pair(acc, shapes, kwargs, times=2, use_pinned_optimizer_offload=arena)
    _delay_streams(opt, acc, 0.002, 0.002)
    prefetched = []
    for step in range(8):
        opt.prefetch()
        opt._h2d.stream.synchronize()  # the early copy has landed: a stale one cannot be fixed by luck
        prefetched.append(opt._prefetched is not None)
        run_steps(ref, ref_params, step, step + 1)
        run_steps(opt, params, step, step + 1)
    assert prefetched == [False] + [True] * 7  # nothing to prefetch before the states exist
    assert_same(ref, ref_params, opt, params)


def test_load_state_dict_drops_a_prefetched_chunk(acc: Accelerator) -> None:
    """A load after `prefetch()` changes the host states: the step must not use the stale device copy."""
    ref, ref_params, _, opt, params, _ = build_pair(acc, SHAPES, dict(lr=1e-2), times=2)
    run_steps(ref, ref_params, 0, 4)
    other = SwapAdamW(clone_params(params), lr=1e-2, swap_optimizer_times=2, accelerator=acc)
    run_steps(other, list(other.param_groups[0]["params"]), 0, 4)
    run_steps(opt, params, 0, 1)  # states exist: prefetch has something to copy
    with torch.no_grad():
        for p, q in zip(params, other.param_groups[0]["params"]):
            p.copy_(q)
    opt.prefetch()
    assert opt._prefetched is not None
    opt.load_state_dict(other.state_dict())
    assert opt._prefetched is None and opt.memory_stats()["device_state_bytes"] == 0
    run_steps(ref, ref_params, 4, 6)
    run_steps(opt, params, 4, 6)
    assert_same(ref, ref_params, opt, params)


def test_no_device_allocation_after_the_first_step(acc: Accelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk buffers come back from the accelerator's cache: steady-state steps map no fresh memory."""
    params = make_params([s for s in SHAPES if s[1] != "late"])
    opt = SwapAdamW(params, lr=1e-2, swap_optimizer_times=3, accelerator=acc)
    run_steps(opt, params, 0, 1)
    fresh = []
    real_empty = torch.empty
    # (giving a buffer back wraps its block in an empty tensor: no memory)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (a != (0,) and fresh.append(a)) or real_empty(*a, **k))
    run_steps(opt, params, 1, 4)
    monkeypatch.undo()
    assert fresh == []
    assert acc._memory.blocks.cached_bytes >= opt.memory_stats()["peak_device_state_bytes"]


def test_state_dict_waits_for_the_last_copy_outs(acc: Accelerator) -> None:
    """`step()` returns with its copy-outs still running on a device; `state_dict()` must wait for them."""
    ref, ref_params, _, opt, params, _ = build_pair(acc, RACE_SHAPES, dict(lr=1e-2), times=2)
    _delay_streams(opt, acc, 0.0, 0.05)
    run_steps(ref, ref_params, 0, 2)
    run_steps(opt, params, 0, 2)
    # the cpu step already waited for its copy-outs (it releases every chunk): queue a slow late write-back
    # as a device would still be running it, then read
    late = {id(p): {k: v.clone() for k, v in ref.state[rp].items()} for p, rp in zip(params, ref_params)}
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            acc.copy_async(opt.state[p][key], late[id(p)][key], opt._d2h.stream)
            opt.state[p][key].zero_()
    saved = opt.state_dict()
    for i, rp in enumerate(ref_params):
        assert torch.equal(saved["state"][i]["exp_avg"], ref.state[rp]["exp_avg"]), i


def test_dropping_a_prefetch_waits_for_its_copy(acc: Accelerator) -> None:
    """A load after `prefetch()` drops the prefetched chunk: its buffer may be freed only once its copy-in ran."""
    params = make_params([s for s in SHAPES if s[1] != "late"])
    opt = SwapAdamW(params, lr=1e-2, swap_optimizer_times=2, accelerator=acc)
    run_steps(opt, params, 0, 1)
    _delay_streams(opt, acc, 0.05, 0.0)
    saved = opt.state_dict()
    opt.prefetch()
    opt.load_state_dict(saved)  # waits for the prefetch's copy-in, then frees its buffer
    opt.prefetch()
    opt._prefetched.copied_in = acc.event()  # the bug: an event never recorded, complete at once
    with pytest.raises(RuntimeError, match="freed while cpu-stream-.* may still use it"):
        opt.load_state_dict(saved)

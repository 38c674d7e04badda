"""Unit tests for the learning-rate schedules (warmup, then cosine, linear or constant) and their state_dict round trip."""

import math
from pathlib import Path

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from internlm_offload.optim import WarmupDecay, build_lr_scheduler

BASE_LR = 1e-3
ETA_MIN = 1e-5


def make(
    total_steps: int = 50, warmup_ratio: float = 0.2, eta_min: float = ETA_MIN
) -> tuple[torch.optim.SGD, LambdaLR]:
    """An SGD optimizer on one parameter and the schedule under test."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=BASE_LR)
    kwargs = dict(base_lr=BASE_LR, warmup_ratio=warmup_ratio, total_steps=total_steps, eta_min=eta_min)
    return opt, build_lr_scheduler(opt, **kwargs)


def lrs(opt: torch.optim.Optimizer, sched: LambdaLR, steps: int) -> list[float]:
    """The learning rate now and after each of the next `steps` scheduler steps."""
    values = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        sched.step()
        values.append(opt.param_groups[0]["lr"])
    return values


def cosine_lr(progress: float) -> float:
    """The expected decay-phase lr at `progress` in [0, 1], written out independently of the code."""
    return ETA_MIN + (BASE_LR - ETA_MIN) * 0.5 * (1 + math.cos(math.pi * progress))


def test_warmup_then_cosine_at_fixed_steps() -> None:
    values = lrs(*make(total_steps=50, warmup_ratio=0.2), steps=60)  # 10 warmup steps, 40 decay steps
    assert values[0] == pytest.approx(BASE_LR / 10, rel=1e-12)
    assert values[4] == pytest.approx(BASE_LR * 5 / 10, rel=1e-12)
    assert values[9] == pytest.approx(BASE_LR, rel=1e-12)
    assert values[10] == pytest.approx(BASE_LR, rel=1e-12)  # end of warmup: the peak
    assert values[20] == pytest.approx(cosine_lr(0.25), rel=1e-12)
    assert values[30] == pytest.approx((BASE_LR + ETA_MIN) / 2, rel=1e-12)  # middle of the decay
    assert values[50] == pytest.approx(ETA_MIN, rel=1e-12)  # last step
    assert values[60] == pytest.approx(ETA_MIN, rel=1e-12)  # past the end it stays at eta_min


def test_warmup_increases_and_decay_decreases() -> None:
    values = lrs(*make(total_steps=50, warmup_ratio=0.2), steps=50)
    assert all(a < b for a, b in zip(values[:9], values[1:10]))  # steps 0..9 rise to the peak
    assert values[9] == values[10] == pytest.approx(BASE_LR, rel=1e-12)
    assert all(a > b for a, b in zip(values[10:50], values[11:51]))
    assert min(values) >= ETA_MIN * (1 - 1e-12)


@pytest.mark.parametrize("warmup_ratio", [0.0, 0.05])  # 0.05 * 10 steps floors to no warmup as well
def test_zero_warmup(warmup_ratio: float) -> None:
    values = lrs(*make(total_steps=10, warmup_ratio=warmup_ratio), steps=10)
    assert values[0] == pytest.approx(BASE_LR, rel=1e-12)
    assert values[5] == pytest.approx((BASE_LR + ETA_MIN) / 2, rel=1e-12)
    assert values[10] == pytest.approx(ETA_MIN, rel=1e-12)


def test_eta_min_zero_reaches_zero() -> None:
    assert lrs(*make(total_steps=8, warmup_ratio=0.25, eta_min=0.0), steps=8)[-1] == pytest.approx(0.0, abs=1e-18)


def test_schedule_is_a_saveable_object() -> None:
    schedule = WarmupDecay(base_lr=2.0, warmup_steps=4, total_steps=20, eta_min=0.5)
    assert (schedule.warmup_steps, schedule.total_steps, schedule.min_ratio) == (4, 20, 0.25)
    assert schedule(0) == 0.25 and schedule(4) == 1.0 and schedule(20) == pytest.approx(0.25)


def test_state_dict_round_trip_continues_identically(tmp_path: Path) -> None:
    opt, sched = make(total_steps=50, warmup_ratio=0.2)
    lrs(opt, sched, steps=7)
    path = tmp_path / "state.pt"
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, path)

    state = torch.load(path, weights_only=True)
    assert state["scheduler"]["last_epoch"] == 7
    assert state["scheduler"]["lr_lambdas"][0]["warmup_steps"] == 10  # the schedule itself is saved
    # A resumed run built with other settings must follow the saved schedule, not its own.
    opt2, sched2 = make(total_steps=5, warmup_ratio=0.0, eta_min=0.0)
    opt2.load_state_dict(state["optimizer"])
    sched2.load_state_dict(state["scheduler"])

    assert lrs(opt2, sched2, steps=50) == lrs(opt, sched, steps=50)


def test_linear_and_constant_decays_after_the_warmup() -> None:
    """XTuner's `lr_type`: after a 10-step warmup, linear falls on a straight line to eta_min; constant stays."""
    for decay, at_20, at_30, at_50 in (
        ("linear", BASE_LR - 0.25 * (BASE_LR - ETA_MIN), (BASE_LR + ETA_MIN) / 2, ETA_MIN),
        ("constant", BASE_LR, BASE_LR, BASE_LR),
    ):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=BASE_LR)
        sched = build_lr_scheduler(opt, base_lr=BASE_LR, warmup_ratio=0.2, total_steps=50, eta_min=ETA_MIN, decay=decay)
        values = lrs(opt, sched, steps=50)
        assert values[4] == pytest.approx(BASE_LR * 5 / 10, rel=1e-12)
        assert [values[20], values[30], values[50]] == pytest.approx([at_20, at_30, at_50], rel=1e-12), decay
    with pytest.raises(ValueError, match="lr_scheduler.type='step'"):
        WarmupDecay(base_lr=1.0, warmup_steps=0, total_steps=2, eta_min=0.0, decay="step")


def test_a_saved_schedule_loads_into_another_number_of_param_groups():
    """Expert parallel gives its shards groups of their own: a schedule saved with 3 groups loads into 2 and 4 (one
    schedule for all), and one whose groups differ is refused naming the key."""
    from internlm_offload.errors import CheckpointError
    from internlm_offload.optim.lr_scheduler import load_scheduler_state

    def scheduler(groups: int):
        params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
        optimizer = torch.optim.AdamW([{"params": [p]} for p in params], lr=1e-3)
        return optimizer, build_lr_scheduler(optimizer, base_lr=1e-3, warmup_ratio=0.5, total_steps=10, eta_min=0)

    optimizer, saved = scheduler(3)
    for _ in range(4):
        optimizer.step()
        saved.step()
    for groups in (2, 4):
        _, loaded = scheduler(groups)
        load_scheduler_state(loaded, saved.state_dict())
        assert loaded.last_epoch == 4 and loaded.get_last_lr() == [saved.get_last_lr()[0]] * groups
    state = saved.state_dict()
    state["base_lrs"] = [1e-3, 2e-3, 1e-3]
    with pytest.raises(CheckpointError, match="3 param groups with different base_lrs saved, 2 here"):
        load_scheduler_state(scheduler(2)[1], state)

"""The update-rule seam: a rule that is not AdamW (SGD with momentum, defined here) steps bitwise like its plain
on-device run under every optimizer tier (swap, NVMe, hybrid, gradient offload), so no tier assumes AdamW.

Tiny tensors, in process, on the cpu backend; equality is `torch.equal`.
"""

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

import internlm_offload.optim.rules as rules_mod
from internlm_offload.device import Accelerator
from internlm_offload.engine.precision import NoMasters
from internlm_offload.model import InternLM2
from internlm_offload.optim import HybridDeviceOptimizer, SwapAdamW, param_groups
from internlm_offload.optim.adamw_rule import ADAMW
from internlm_offload.optim.grad_offload import GradOffload
from internlm_offload.optim.rule_optimizer import RuleOptimizer
from internlm_offload.optim.rules import RULE_KEY, StateSpec, UpdateRule

LR, MOMENTUM, STEPS = 0.1, 0.9, 4
SHAPES = [(7,), (33, 17), (1,), (64,), (300,)]


class MomentumSGD(UpdateRule):
    """SGD with momentum: one state, `momentum_buffer`, that no tier knows by name."""

    name = "momentum_sgd"

    def state_keys(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",)

    def state_specs(self, param: torch.Tensor, group: Mapping[str, Any]) -> list[StateSpec]:
        return [StateSpec("momentum_buffer", param.shape, param.dtype)]

    def step(self, params, grads, states, group, **_: Any) -> None:
        for param, grad, buffer in zip(params, grads, states["momentum_buffer"], strict=True):
            buffer.mul_(group["momentum"]).add_(grad)
            param.add_(buffer, alpha=-group["lr"])

    def state_bytes(self, dtype: torch.dtype, group: Mapping[str, Any]) -> int:
        return dtype.itemsize

    def defaults(self) -> dict[str, Any]:
        return {"momentum": MOMENTUM}


class WholeMomentumSGD(MomentumSGD):
    """The same step, declared as needing whole parameters (as Muon's will)."""

    whole_params = True


SGD = MomentumSGD()


@pytest.fixture
def acc() -> Iterator[Accelerator]:
    accelerator = Accelerator("cpu")
    yield accelerator
    accelerator.close_streams()


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """The same grads for every copy; the 4th param has none on odd steps (its state must stay put then)."""
    generator = torch.Generator().manual_seed(100 + step)
    for index, param in enumerate(params):
        grad = torch.randn(param.shape, generator=generator)
        param.grad = None if index == 3 and step % 2 else grad


def plain_run() -> list[torch.nn.Parameter]:
    params = make_params()
    optimizer = RuleOptimizer(params, rule=SGD, lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        set_grads(params, step)
        optimizer.step()
    params.append(optimizer)  # its states are compared too
    return params


def assert_like_plain(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    *expected, plain = plain_run()
    for param, want in zip(params, expected, strict=True):
        assert torch.equal(param, want)
        assert set(optimizer.state[param]) == {"momentum_buffer"}  # no AdamW state crept in
        assert torch.equal(optimizer.state[param]["momentum_buffer"], plain.state[want]["momentum_buffer"])


def run(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    for step in range(STEPS):
        set_grads(params, step)
        optimizer.step()
    if hasattr(optimizer, "finish_copies"):
        optimizer.finish_copies()


@pytest.mark.parametrize("times", [1, 3])
def test_swap_tier_steps_the_rule_bitwise(acc: Accelerator, times: int) -> None:
    params = make_params()
    groups = [{"params": params, "momentum": MOMENTUM}]
    swap = SwapAdamW(groups, lr=LR, swap_optimizer_times=times, accelerator=acc, rule=SGD)
    run(params, swap)
    assert_like_plain(params, swap)
    assert swap.memory_stats()["host_state_bytes"] == sum(p.numel() * 4 for p in params)  # one fp32 state
    swap.close()


def test_nvme_tier_steps_the_rule_bitwise(acc: Accelerator, tmp_path) -> None:
    params = make_params()
    groups = [{"params": params, "momentum": MOMENTUM}]
    swap = SwapAdamW(groups, lr=LR, swap_optimizer_times=2, nvme_path=str(tmp_path), accelerator=acc, rule=SGD)
    run(params, swap)
    assert_like_plain(params, swap)
    swap.close()


@pytest.mark.parametrize("fraction, overlap", [(0.5, True), (1.0, False)])
def test_hybrid_tier_steps_the_rule_bitwise(acc: Accelerator, fraction: float, overlap: bool) -> None:
    params = make_params()
    hybrid = HybridDeviceOptimizer(
        [{"params": params, "momentum": MOMENTUM}],  # a group key: an AdamW in its place would run, and differ
        offload_fraction=fraction,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        accelerator=acc,
        rule=SGD,
        lr=LR,
    )
    run(params, hybrid)
    assert_like_plain(params, hybrid)
    hybrid.close()


def tiny_model() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(num_layers=1, hidden_size=32, num_attention_heads=2, num_kv_attention_heads=1, vocab_size=67)


def train_with_grad_offload(acc: Accelerator, build: Any) -> list[torch.Tensor]:
    """Two steps of the tiny model, gradients offloaded to the host as they are produced."""
    model = tiny_model()
    offload = GradOffload(NoMasters(model), acc, bucket_bytes=4096, from_zeros=False)
    optimizer = build(list(model.parameters()), offload.records())
    for step in range(2):
        tokens = torch.randint(0, 67, (2, 8), generator=torch.Generator().manual_seed(step))
        model(tokens).logits.float().square().mean().backward()
        offload.grads()
        optimizer.step()
        offload.release_grads()
    optimizer.finish_copies()
    optimizer.close()
    offload.close()
    return [p.detach().clone() for p in model.parameters()]


def train_plain() -> list[torch.Tensor]:
    model = tiny_model()
    optimizer = RuleOptimizer(model.parameters(), rule=SGD, lr=LR, momentum=MOMENTUM)
    for step in range(2):
        tokens = torch.randint(0, 67, (2, 8), generator=torch.Generator().manual_seed(step))
        model(tokens).logits.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def swap_on_host_grads(acc: Accelerator) -> Any:
    return lambda params, records: SwapAdamW(
        [{"params": params, "momentum": MOMENTUM}],
        lr=LR,
        swap_optimizer_times=2,
        host_grads=True,
        records=records,
        accelerator=acc,
        rule=SGD,
    )


def hybrid_on_host_grads(acc: Accelerator) -> Any:
    return lambda params, records: HybridDeviceOptimizer(
        [{"params": params, "momentum": MOMENTUM}],
        offload_fraction=1.0,
        grads_on_host=True,
        records=records,
        accelerator=acc,
        rule=SGD,
        lr=LR,
    )


@pytest.mark.parametrize("tier", [swap_on_host_grads, hybrid_on_host_grads])
def test_gradient_offload_steps_the_rule_bitwise(acc: Accelerator, tier: Any) -> None:
    got, want = train_with_grad_offload(acc, tier(acc)), train_plain()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_swap_chunks_hold_whole_params_for_a_whole_param_rule(acc: Accelerator) -> None:
    params = make_params()
    groups = [{"params": params, "momentum": MOMENTUM}]
    swap = SwapAdamW(groups, lr=LR, swap_optimizer_times=64, accelerator=acc, rule=WholeMomentumSGD())
    run(params, swap)
    assert_like_plain(params, swap)
    chunks_of = {id(p): [c for c in swap._chunks if any(q is p for q in c.params)] for p in params}
    assert all(len(chunks) == 1 for chunks in chunks_of.values())  # a tiny budget: still never split
    swap.close()


def test_sharded_params_are_refused_for_a_whole_param_rule_by_the_hybrid_tier(
    acc: Accelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hybrid tier steps bare local shards: refused. (The swap tier hands a whole-param rule each shard as its
    DTensor, as the plain optimizer does: tests/unit/test_muon_sharded.py.)"""
    monkeypatch.setattr(rules_mod, "is_dtensor", lambda tensor: True)  # as FSDP2's DTensor params would answer
    params, rule = make_params(), WholeMomentumSGD()
    with pytest.raises(ValueError, match="steps whole parameters.*DTensor"):
        HybridDeviceOptimizer(params, accelerator=acc, rule=rule, lr=LR)


# ---------------------------------------------------------------- param groups choose their rule

PATTERNS = [("*.bias", SGD.name), ("1.*", "adamw"), ("2.*", "adamw"), ("*", SGD.name)]  # first match wins


def mixed_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))


def test_param_groups_choose_a_rule_by_name_pattern_first_match_wins() -> None:
    model = mixed_model()
    names = {id(p): n for n, p in model.named_parameters()}
    rules = {names[id(p)]: g.get(RULE_KEY, "adamw") for g in param_groups(model, 0.1, PATTERNS) for p in g["params"]}
    assert rules == {"0.weight": SGD.name, "0.bias": SGD.name, "1.weight": "adamw", "1.bias": SGD.name,
                     "2.weight": "adamw", "2.bias": SGD.name}  # fmt: skip
    assert all(RULE_KEY not in g for g in param_groups(model, 0.1))  # no patterns: the groups as they were


def mixed_reference(fused: bool | None = None) -> list[torch.Tensor]:
    """AdamW over the AdamW groups and the test rule over the others, as two plain optimizers."""
    model = mixed_model()
    groups = param_groups(model, 0.1, PATTERNS)
    adamw = torch.optim.AdamW([g for g in groups if RULE_KEY not in g], lr=LR, fused=fused)
    sgd = RuleOptimizer([g for g in groups if RULE_KEY in g], rule=SGD, lr=LR)
    return train_mixed(model, lambda: (adamw.step(), sgd.step()))


def train_mixed(model: torch.nn.Module, step: Any) -> list[torch.Tensor]:
    for index in range(STEPS):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(index + param.numel()))
        step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("tier", ["plain", "swap", "hybrid", "hybrid_all_cpu"])
def test_groups_step_with_their_own_rule_bitwise(acc: Accelerator, tier: str) -> None:
    model = mixed_model()
    groups = param_groups(model, 0.1, PATTERNS)
    named = {SGD.name: SGD}
    if tier == "plain":
        optimizer = RuleOptimizer(groups, rule=ADAMW, rules=named, lr=LR)
    elif tier == "swap":
        optimizer = SwapAdamW(groups, lr=LR, swap_optimizer_times=2, accelerator=acc, rules=named)
    else:  # both sides fused AdamW on cpu; the CPU side in pieces of one group, or one optimizer over all groups
        overlap, fraction = tier == "hybrid", 1.0 if tier == "hybrid_all_cpu" else 0.9  # 0.weight, 1.weight, 0.bias
        optimizer = HybridDeviceOptimizer(
            groups,
            offload_fraction=fraction,
            overlap_cpu_optimizer_d2h_h2d=overlap,
            accelerator=acc,
            rules=named,
            lr=LR,
        )
    if tier == "hybrid":  # CPU pieces of either rule; the device side steps 1.bias, 2.bias (SGD) and 2.weight (AdamW)
        assert [type(u.optimizer).__name__ for u in optimizer._cpu_units] == ["RuleOptimizer", "AdamW", "RuleOptimizer"]
    got = train_mixed(model, optimizer.step)
    optimizer.finish_copies()
    want = mixed_reference(fused=True if tier.startswith("hybrid") else None)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    states = {k for p in model[1].parameters() for k in optimizer.state[p]}
    assert states == {"step", "exp_avg", "exp_avg_sq", "momentum_buffer"}  # 1.weight AdamW, 1.bias the test rule
    optimizer.close()


def test_a_group_naming_an_unknown_rule_is_refused_in_one_line(acc: Accelerator) -> None:
    groups = param_groups(mixed_model(), 0.1, PATTERNS)
    with pytest.raises(ValueError, match="names update rule 'momentum_sgd'; this optimizer has \\['adamw'\\]"):
        SwapAdamW(groups, lr=LR, accelerator=acc)

"""Muon under every optimizer tier (swap, NVMe, hybrid, gradient offload) bitwise its plain run, beside AdamW groups,
with matrices, an expert stack and a row-split matrix; a swap chunk never splits one; state dicts move between the
tiers and the plain optimizer. Tiny tensors, in process, cpu backend; equality is `torch.equal`."""

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from internlm_offload.builder.optimizer import RULES, run_param_groups
from internlm_offload.config import resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.precision import MasterWeights, NoMasters
from internlm_offload.engine.trainer import Trainer
from internlm_offload.model import InternLM2
from internlm_offload.optim import HybridDeviceOptimizer, SwapAdamW
from internlm_offload.optim.adamw_rule import ADAMW
from internlm_offload.optim.grad_offload import GradOffload
from internlm_offload.optim.muon_rule import MUON, NS_DTYPE_KEY, ROW_SPLITS_KEY
from internlm_offload.optim.rule_optimizer import RuleOptimizer
from internlm_offload.optim.rules import RULE_KEY

LR, STEPS = 0.02, 4
NAMED = {MUON.name: MUON}
MUON_KEYS = {RULE_KEY: "muon", "lr": LR, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw", "eps": 1e-7}
MUON_KEYS |= {"momentum": 0.95, "nesterov": True, "ns_coefficients": (3.4445, -4.775, 2.0315), "ns_steps": 5}
SHAPES = [(24, 16), (16, 40), (3, 8, 6), (12, 8), (40,)]  # two matrices, an expert stack, a split matrix, a vector


@pytest.fixture
def acc() -> Iterator[Accelerator]:
    accelerator = Accelerator("cpu")
    yield accelerator
    accelerator.close_streams()


def make_params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def groups_of(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """Muon over the matrices and the stack, Muon per row block (Newton-Schulz in fp32) over the split matrix, fused
    AdamW over the vector (fused: the hybrid optimizer's CPU side steps AdamW fused)."""
    return [
        {"params": params[:3], **MUON_KEYS},
        {"params": [params[3]], **MUON_KEYS, ROW_SPLITS_KEY: (4, 2, 4, 2), NS_DTYPE_KEY: "torch.float32"},
        {"params": [params[4]], "fused": True},
    ]


def set_grads(params: list[torch.Tensor], step: int) -> None:
    """The same grads for every copy; the stack has none on odd steps (no decay, its momentum stays)."""
    generator = torch.Generator().manual_seed(100 + step)
    for index, param in enumerate(params):
        grad = torch.randn(param.shape, generator=generator)
        param.grad = None if index == 2 and step % 2 else grad


def run(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, steps: range = range(STEPS)) -> None:
    for step in steps:
        set_grads(params, step)
        optimizer.step()
    optimizer.finish_copies()


def plain() -> tuple[list[torch.nn.Parameter], RuleOptimizer]:
    params = make_params()
    optimizer = RuleOptimizer(groups_of(params), rule=ADAMW, rules=NAMED, lr=LR)
    run(params, optimizer)
    return params, optimizer


def assert_like_plain(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    expected, reference = plain()
    for param, want in zip(params, expected, strict=True):
        assert torch.equal(param, want)
        got_state, want_state = optimizer.state[param], reference.state[want]
        assert set(got_state) == set(want_state)
        assert all(torch.equal(got_state[key], want_state[key]) for key in want_state)
    assert set(optimizer.state[params[0]]) == {"momentum_buffer"}


@pytest.mark.parametrize("times", [1, 3, 64])
def test_swap_tier_steps_muon_bitwise(acc: Accelerator, times: int) -> None:
    params = make_params()
    swap = SwapAdamW(groups_of(params), lr=LR, swap_optimizer_times=times, accelerator=acc, rules=NAMED)
    run(params, swap)
    assert_like_plain(params, swap)
    assert all(sum(p is q for c in swap._chunks for q in c.params) == 1 for p in params)  # never split
    muon_elements = sum(p.numel() for p in params[:4])
    assert swap.memory_stats()["host_state_bytes"] == 4 * muon_elements + 8 * 40 + 4  # AdamW: 2 states + step
    swap.close()


def test_nvme_tier_steps_muon_bitwise(acc: Accelerator, tmp_path) -> None:
    params = make_params()
    swap = SwapAdamW(groups_of(params), lr=LR, swap_optimizer_times=3, nvme_path=str(tmp_path), accelerator=acc,
                     rules=NAMED)  # fmt: skip
    run(params, swap)
    assert_like_plain(params, swap)
    swap.close()


@pytest.mark.parametrize("fraction, overlap", [(0.5, True), (1.0, False)])
def test_hybrid_tier_steps_muon_bitwise(acc: Accelerator, fraction: float, overlap: bool) -> None:
    params = make_params()
    hybrid = HybridDeviceOptimizer(
        groups_of(params), offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=overlap, accelerator=acc,
        rules=NAMED, lr=LR,
    )  # fmt: skip
    run(params, hybrid)
    assert_like_plain(params, hybrid)
    hybrid.close()


def test_state_dicts_move_between_the_swap_tier_and_the_plain_optimizer(acc: Accelerator) -> None:
    params = make_params()
    swap = SwapAdamW(groups_of(params), lr=LR, swap_optimizer_times=3, accelerator=acc, rules=NAMED)
    run(params, swap, range(2))
    resumed = RuleOptimizer(groups_of(params), rule=ADAMW, rules=NAMED, lr=LR)
    resumed.load_state_dict(swap.state_dict())
    swap.close()
    run(params, resumed, range(2, 3))
    back = SwapAdamW(groups_of(params), lr=LR, swap_optimizer_times=64, accelerator=acc, rules=NAMED)
    back.load_state_dict(resumed.state_dict())
    run(params, back, range(3, 4))
    assert_like_plain(params, back)
    back.close()


def test_state_dicts_move_between_the_hybrid_tier_and_the_plain_optimizer(acc: Accelerator) -> None:
    params = make_params()
    hybrid = HybridDeviceOptimizer(groups_of(params), offload_fraction=0.5, accelerator=acc, rules=NAMED, lr=LR)
    run(params, hybrid, range(2))
    resumed = RuleOptimizer(groups_of(params), rule=ADAMW, rules=NAMED, lr=LR)
    resumed.load_state_dict(hybrid.state_dict())
    hybrid.close()
    run(params, resumed, range(2, 3))
    back = HybridDeviceOptimizer(groups_of(params), offload_fraction=0.5, accelerator=acc, rules=NAMED, lr=LR)
    back.load_state_dict(resumed.state_dict())
    run(params, back, range(3, 4))
    assert_like_plain(params, back)
    back.close()


# ---------------------------------------------------------------- gradient offload, groups from the config


def tiny_model() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(num_layers=1, hidden_size=32, num_attention_heads=2, num_kv_attention_heads=1, vocab_size=67)


CFG = resolve_config({"optimizer": {"type": "muon"}, "adam": {"lr": LR}})


def train_tiny(build: Any, offload: bool, acc: Accelerator) -> list[torch.Tensor]:
    """Two steps of the tiny model, Muon over its matrices as the config splits them (AdamW the rest)."""
    model = tiny_model()
    grads = GradOffload(NoMasters(model), acc, bucket_bytes=4096, from_zeros=False) if offload else None
    optimizer = build(run_param_groups(CFG, model), grads.records() if grads else None)
    for step in range(2):
        tokens = torch.randint(0, 67, (2, 8), generator=torch.Generator().manual_seed(step))
        model(tokens).logits.float().square().mean().backward()
        if grads:
            grads.grads()
        optimizer.step()
        if grads:
            grads.release_grads()
        else:
            optimizer.zero_grad()
    optimizer.finish_copies()
    optimizer.close() if hasattr(optimizer, "close") else None
    if grads:
        grads.close()
    return [p.detach().clone() for p in model.parameters()]


def plain_tiny(groups: list[dict], records: Any) -> RuleOptimizer:
    return RuleOptimizer(groups, rule=ADAMW, rules=RULES, lr=LR, fused=True)


@pytest.mark.parametrize("tier", ["swap", "hybrid"])
def test_gradient_offload_steps_muon_bitwise(acc: Accelerator, tier: str) -> None:
    if tier == "swap":

        def build(groups: list[dict], records: Any) -> SwapAdamW:
            return SwapAdamW(groups, lr=LR, fused=True, swap_optimizer_times=2, host_grads=True, records=records,
                             accelerator=acc, rules=RULES)  # fmt: skip
    else:

        def build(groups: list[dict], records: Any) -> HybridDeviceOptimizer:
            return HybridDeviceOptimizer(groups, offload_fraction=1.0, grads_on_host=True, records=records,
                                         accelerator=acc, rules=RULES, lr=LR)  # fmt: skip

    got, want = train_tiny(build, True, acc), train_tiny(plain_tiny, False, acc)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


# ---------------------------------------------------------------- XTuner's clipping (`optimizer.muon.clip_grad=False`)


def clipped_grads(acc: Accelerator, kind: str, max_norm: float, unclipped: tuple[str, ...]) -> tuple:
    """The tiny model's backward under `kind` of masters (`masters`: bf16 with fp32 masters), clipped by the
    trainer's own `clip_gradients`: the norm and each gradient with its rule, in parameter order."""
    model = tiny_model()
    if kind == "masters":
        masters = MasterWeights(model, torch.bfloat16)  # casts the model
    else:
        masters = NoMasters(model)
        masters = GradOffload(masters, acc, bucket_bytes=4096, from_zeros=False) if kind == "grad_offload" else masters
    optimizer = RuleOptimizer(run_param_groups(CFG, masters.module), rule=ADAMW, rules=RULES, lr=LR)
    tokens = torch.randint(0, 67, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens).logits.float().square().mean().backward()
    masters.accumulate_grads()
    trainer = SimpleNamespace(
        settings=SimpleNamespace(clip_grad_norm=max_norm, unclipped_rules=unclipped),
        masters=masters,
        optimizer=optimizer,
        pipeline=None,
    )
    trainer._unclipped_grads = lambda: Trainer._unclipped_grads(trainer)
    norm = Trainer.clip_gradients(trainer)
    rules = {id(p): g.get(RULE_KEY, "adamw") for g in optimizer.param_groups for p in g["params"]}
    grads = [(rules[id(r.master)], r.grad().clone()) for r in masters.records()]
    if kind == "grad_offload":
        masters.close()
    return norm, grads


@pytest.mark.parametrize("kind", ["plain", "masters", "grad_offload"])
def test_xtuner_clipping_counts_muon_s_gradients_and_scales_only_adamw_s(acc: Accelerator, kind: str) -> None:
    """`unclipped_rules=("muon",)`: the norm is over all gradients (as torch's way), Muon's gradients stay as they
    were, AdamW's are scaled as under torch's way; whichever holds the gradients (the model, fp32 masters, host
    buffers of gradient offload)."""
    torch_way = clipped_grads(acc, kind, 0.01, ())
    unclipped = clipped_grads(acc, kind, 0.0, ())
    xtuner = clipped_grads(acc, kind, 0.01, ("muon",))
    assert torch.equal(torch_way[0], xtuner[0]) and torch.equal(unclipped[0], xtuner[0]) and xtuner[0] > 0.01
    assert {rule for rule, _ in xtuner[1]} == {"muon", "adamw"}
    for (rule, got), (_, scaled), (_, kept) in zip(xtuner[1], torch_way[1], unclipped[1], strict=True):
        assert torch.equal(got, kept if rule == "muon" else scaled), rule
        assert not torch.equal(scaled, kept) or not kept.any()  # the clipping is active

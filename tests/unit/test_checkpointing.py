"""Activation checkpointing (full and selective) changes memory, never the math."""

import pytest
import torch
import torch.nn.functional as F
from op_counter import OpCounter
from torch.utils._python_dispatch import TorchDispatchMode

from internlm_offload.model import InternLM2
from internlm_offload.offload import apply_activation_checkpointing

L = 4


def tiny_model() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(num_layers=L, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 259, (2, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def run(model: InternLM2) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, logits, grads, and the bytes autograd saved for backward."""
    saved_bytes = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved_bytes
        saved_bytes += t.numel() * t.element_size()
        return t

    inputs, labels = batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inputs)
        logits = out.logits
        aux = sum(out.aux_losses.values())  # an MoE model adds its load-balancing loss
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + aux
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), logits.detach(), grads, saved_bytes


@pytest.fixture(scope="module")
def baseline():
    return run(tiny_model())


@pytest.mark.parametrize("ratio", [0.5, 1.0])
@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
def test_checkpointing_is_bitwise(baseline, ratio, selective):
    model = tiny_model()
    apply_activation_checkpointing(model.layers, range(int(L * ratio)), selective=selective)
    loss, logits, grads, _ = run(model)
    base_loss, base_logits, base_grads, _ = baseline
    assert torch.equal(loss, base_loss)
    assert torch.equal(logits, base_logits)
    assert grads.keys() == base_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, base_grads[name]), name


def profile(model: InternLM2) -> tuple[OpCounter, int]:
    with OpCounter() as ops:
        *_, saved_bytes = run(model)
    return ops, saved_bytes


def test_checkpointing_recomputes_what_the_policy_says():
    """Full recomputes the matmuls too; selective keeps matmul/attention outputs, recomputes cheap ops."""
    none_ops, none_bytes = profile(tiny_model())
    full, selective = tiny_model(), tiny_model()
    apply_activation_checkpointing(full.layers, range(L), selective=False)
    apply_activation_checkpointing(selective.layers, range(L), selective=True)
    full_ops, full_bytes = profile(full)
    selective_ops, selective_bytes = profile(selective)
    assert full_ops.expensive > none_ops.expensive
    assert selective_ops.expensive == none_ops.expensive
    # both recompute the cheap ops (SAC also adds bookkeeping ops, so the two do not order)
    assert selective_ops.cheap > none_ops.cheap and full_ops.cheap > none_ops.cheap
    # the checkpointed blocks' tensors leave autograd's graph (held by checkpoint, or not at all)
    assert full_bytes < none_bytes and selective_bytes < none_bytes


class GroupedMmCounter(TorchDispatchMode):
    """Counts the experts' grouped GEMMs (forward, recompute and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten._grouped_mm.default
        return func(*args, **(kwargs or {}))


def tiny_moe_model() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(
        num_layers=L, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259,
        num_experts=4, top_k=2, num_shared_experts=1, mlp_ratio=1.0, multiple_of=32,
    )  # fmt: skip


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_grouped_mm"), reason="torch without grouped GEMM")
def test_selective_checkpoint_keeps_the_expert_grouped_gemms_and_is_bitwise():
    """Selective checkpointing of MoE blocks saves the experts' grouped GEMM outputs (recomputing the routing,
    whose permutation comes out the same): as many grouped GEMMs as without checkpointing, bitwise the same
    loss and gradients; full checkpointing recomputes them."""
    counts, results = {}, {}
    for kind in ("none", "selective", "full"):
        model = tiny_moe_model()
        if kind != "none":
            apply_activation_checkpointing(model.layers, range(L), selective=kind == "selective")
        with GroupedMmCounter() as counter:
            results[kind] = run(model)
        counts[kind] = counter.calls
    assert counts["none"] > 0 and counts["selective"] == counts["none"] < counts["full"]
    for kind in ("selective", "full"):
        loss, logits, grads, _ = results[kind]
        assert torch.equal(loss, results["none"][0]) and torch.equal(logits, results["none"][1])
        for name, grad in grads.items():
            assert torch.equal(grad, results["none"][2][name]), (kind, name)


def test_flash_attn_and_npu_attention_ops_are_kept_when_registered():
    """flash-attn and torch_npu register their attention as torch ops; the selective policy keeps them."""
    from torch.utils.checkpoint import CheckpointPolicy

    from internlm_offload.offload import checkpointing

    lib = torch.library.Library("flash_attn", "FRAGMENT")  # what importing flash-attn registers
    lib.define("_flash_attn_forward(Tensor q) -> Tensor")
    checkpointing.expensive_ops.cache_clear()
    try:
        op = torch.ops.flash_attn._flash_attn_forward.default
        assert checkpointing._selective_policy(None, op) == CheckpointPolicy.MUST_SAVE
        assert checkpointing._selective_policy(None, torch.ops.aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    finally:
        checkpointing.expensive_ops.cache_clear()

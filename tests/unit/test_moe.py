"""The native MoE feed-forward against transformers' own sparse blocks, GShard's capacity by hand, the expert
compute paths (tiny, CPU, float32)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from internlm_offload.model.experts import GroupedExperts, _grouped_linear
from internlm_offload.model.moe import MoE
from internlm_offload.model.router import capacity_keep, expert_counts, gshard_capacity, scatter_counts

H, I, E, K = 32, 24, 8, 2  # widths multiples of 4: fp32 rows on 16-byte strides, the grouped GEMM's rule


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def copy_hf_block(hf: torch.nn.Module, moe: MoE) -> None:
    """transformers 5.24 holds experts fused: gate_up_proj (E, 2I, H) = [gate; up] per expert, down (E, H, I)."""
    with torch.no_grad():
        moe.router.weight.copy_(hf.gate.weight)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)
        moe.experts.w1.copy_(gate)
        moe.experts.w3.copy_(up)
        moe.experts.w2.copy_(hf.experts.down_proj)
        if moe.shared_experts is not None:
            moe.shared_experts.w1.weight.copy_(hf.shared_expert.gate_proj.weight)
            moe.shared_experts.w3.weight.copy_(hf.shared_expert.up_proj.weight)
            moe.shared_experts.w2.weight.copy_(hf.shared_expert.down_proj.weight)
            moe.coefficient.weight.copy_(hf.shared_expert_gate.weight)


def grads_of(block: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient under a real loss (MSE against a target: a dense, non-expanded gradient)."""
    x = x.clone().requires_grad_(True)
    out = block(x)
    F.mse_loss(out, target).backward()
    return out.detach(), x.grad


def hf_blocks() -> list[tuple[str, torch.nn.Module, dict]]:
    common = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)
    qwen3 = Qwen3MoeConfig(**common, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I, norm_topk_prob=True)
    mixtral = MixtralConfig(**common, num_local_experts=E, num_experts_per_tok=K, intermediate_size=I)
    qwen2 = Qwen2MoeConfig(
        **common,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=I,
        shared_expert_intermediate_size=2 * I,
        norm_topk_prob=False,
    )
    return [
        ("qwen3", Qwen3MoeSparseMoeBlock(qwen3), dict(normalize_expert_weights=True)),
        ("mixtral", MixtralSparseMoeBlock(mixtral), dict(normalize_expert_weights=True)),
        (
            "qwen2",
            Qwen2MoeSparseMoeBlock(qwen2),
            dict(normalize_expert_weights=False, num_shared_experts=2, shared_expert_gate="sigmoid"),
        ),
    ]


@pytest.mark.parametrize("index", range(3), ids=["qwen3", "mixtral", "qwen2"])
def test_block_matches_transformers(index: int) -> None:
    """Same weights, same tokens: outputs and every gradient within 1e-5 relative of transformers' block."""
    name, hf, kwargs = hf_blocks()[index]
    hf.train()
    randomize(hf, seed=index)
    moe = MoE(H, I, E, K, moe_type="Dropless", **kwargs)
    copy_hf_block(hf, moe)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 12, H, generator=gen)
    target = torch.randn(2, 12, H, generator=gen)
    out, x_grad = grads_of(moe, x, target)
    hf_out, hf_x_grad = grads_of(hf, x, target)
    assert rel_err(out, hf_out) < 1e-5
    assert rel_err(x_grad, hf_x_grad) < 1e-5
    gate_up_grad = torch.cat([moe.experts.w1.grad, moe.experts.w3.grad], dim=1)
    assert rel_err(moe.router.weight.grad, hf.gate.weight.grad) < 1e-5
    assert rel_err(gate_up_grad, hf.experts.gate_up_proj.grad) < 1e-5
    assert rel_err(moe.experts.w2.grad, hf.experts.down_proj.grad) < 1e-5
    if name == "qwen2":
        assert rel_err(moe.coefficient.weight.grad, hf.shared_expert_gate.weight.grad) < 1e-5
        assert rel_err(moe.shared_experts.w2.weight.grad, hf.shared_expert.down_proj.weight.grad) < 1e-5


def test_routing_weights_renormalised_or_not() -> None:
    """normalize_expert_weights: the top-k weights sum to 1 (times routed_scaling_factor); off, they are the raw
    softmax scores."""
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(3))
    moe = MoE(H, I, E, K, moe_type="Dropless", routed_scaling_factor=2.5)
    randomize(moe, 0)
    routing = moe.router(x)
    assert torch.allclose(routing.weights.sum(-1), torch.full((10,), 2.5))
    raw = MoE(H, I, E, K, moe_type="Dropless", normalize_expert_weights=False)
    raw.load_state_dict(moe.state_dict())
    r = raw.router(x)
    assert torch.equal(r.weights, r.scores.gather(1, r.indices))
    sig = MoE(H, I, E, K, moe_type="Dropless", scoring_func="sigmoid", normalize_expert_weights=False)
    sig.load_state_dict(moe.state_dict())
    s = sig.router(x)
    assert torch.equal(s.scores, s.logits.sigmoid()) and torch.equal(s.indices, routing.indices)


# ----------------------------------------------------------------------------- GShard by hand


def test_gshard_capacity_formula() -> None:
    """max(ceil(T / E * capacity_factor * k), min_capacity), from the local token count."""
    assert gshard_capacity(4, 2, 2, 0.5, 1) == 2
    assert gshard_capacity(10, 4, 1, 1.0, 1) == 3  # ceil(2.5)
    assert gshard_capacity(10, 4, 1, 1.0, 4) == 4  # min_capacity wins


def gshard_case() -> tuple[MoE, torch.Tensor]:
    """4 tokens, 2 experts, top-2, capacity 2. Preferences (1st, 2nd): t0 (e0, e1), t1 (e1, e0), t2 (e0, e1),
    t3 (e0, e1). Choice-major filling: 1st choices e0 <- t0, t2, [t3 dropped]; e1 <- t1; 2nd choices
    e1 <- t0, [t2, t3 dropped]; e0 <- [t1 dropped: e0 is full]."""
    moe = MoE(4, 8, 2, 2, moe_type="GShard", capacity_factor=0.5, min_capacity=1)
    randomize(moe, 5)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))  # logits = x[:, :2]
    x = torch.tensor([[2.0, 1.0, 0.3, -0.2], [1.0, 2.0, -0.5, 0.1], [3.0, 0.0, 0.2, 0.4], [2.0, 0.0, -0.1, 0.7]])
    return moe, x


def test_gshard_keeps_choices_in_choice_major_order() -> None:
    moe, x = gshard_case()
    routing = moe.router(x)
    kept = capacity_keep(routing.indices, 2, capacity=2)
    assert kept.tolist() == [[True, True], [True, False], [True, False], [False, False]]


def test_gshard_output_by_hand() -> None:
    """Survivors renormalised to sum to 1 per token; a token with no survivor outputs 0."""
    moe, x = gshard_case()
    out = moe(x)
    w = moe.experts

    def expert(e: int, row: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(row, w.w1[e])) * F.linear(row, w.w3[e]), w.w2[e])

    p0 = torch.softmax(x[0, :2], -1)
    expected = torch.stack(
        [
            p0[0] * expert(0, x[0]) + p0[1] * expert(1, x[0]),  # both survive: renormalised over the two
            expert(1, x[1]),  # only its 1st choice: weight 1
            expert(0, x[2]),
            torch.zeros(4),  # all dropped
        ]
    )
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-7)
    assert moe.tokens_per_expert.tolist() == [2.0, 2.0]  # after capacity


def test_gshard_without_dropping_computes_every_choice() -> None:
    moe, x = gshard_case()
    moe.drop_tokens = False
    moe(x)
    assert moe.tokens_per_expert.tolist() == [4.0, 4.0]


# ----------------------------------------------------------------------------- expert compute


def test_expert_counts_without_ints_on_cpu() -> None:
    """histc on cpu rejects ints: counted as floats; ids >= E (dropped) are not counted. The accelerators' path
    (scatter_add_) counts the same, run here on meta for its shapes and on cpu for its values."""
    ids = torch.tensor([[0, 3], [3, 1], [4, 4]])
    assert expert_counts(ids, 4).tolist() == [1.0, 1.0, 0.0, 2.0]
    assert scatter_counts(ids.reshape(-1), 4).tolist() == [1.0, 1.0, 0.0, 2.0]
    assert expert_counts(ids.to("meta"), 4).shape == (4,)


def per_expert_reference(experts: GroupedExperts, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    outs, start = [], 0
    for e, n in enumerate(sizes):
        xe = x[start : start + n]
        outs.append(F.linear(F.silu(F.linear(xe, experts.w1[e])) * F.linear(xe, experts.w3[e]), experts.w2[e]))
        start += n
    outs.append(torch.zeros(x.shape[0] - start, x.shape[1]))
    return torch.cat(outs)


@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [0, 0, 0, 7], [4, 1, 1, 1]])
def test_grouped_mm_equals_per_expert_matmuls(sizes: list[int]) -> None:
    """The grouped GEMM (empty experts and a dropped tail included) against per-expert matmuls, forward and
    backward, with a gradient that a real loss produces."""
    experts = GroupedExperts(4, H, I)
    randomize(experts, 1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(sizes) + 3, H, generator=gen)  # 3 dropped rows at the end
    target = torch.randn(x.shape, generator=gen)
    counts = torch.tensor(sizes, dtype=torch.float32)
    assert experts.uses_grouped_mm(x)
    xg = x.clone().requires_grad_(True)
    out = experts(xg, counts)
    F.mse_loss(out, target).backward()
    grads = [p.grad.clone() for p in experts.parameters()]
    experts.zero_grad()
    xr = x.clone().requires_grad_(True)
    ref = per_expert_reference(experts, xr, sizes)
    F.mse_loss(ref, target).backward()
    assert rel_err(out, ref) < 1e-6 and torch.equal(out[-3:], torch.zeros(3, H))
    assert rel_err(xg.grad, xr.grad) < 1e-6 and torch.equal(xg.grad[-3:], torch.zeros(3, H))
    for g, p in zip(grads, experts.parameters()):
        assert rel_err(g, p.grad) < 1e-6


def test_grouped_mm_takes_an_expanded_gradient() -> None:
    """`.sum().backward()` hands the kernel an expanded gradient, which torch 2.13 rejects ("Invalid
    strides/sizes"): the grouped linear makes it dense."""
    w = torch.randn(4, I, H, requires_grad=True)
    x = torch.randn(6, H, requires_grad=True)
    _grouped_linear(x, w, torch.tensor([2, 4, 5, 6], dtype=torch.int32)).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_loop_fallback_where_rows_are_misaligned() -> None:
    """Widths whose fp32 rows are not 16-byte aligned take the loop over contiguous slices, same result."""
    experts = GroupedExperts(3, 6, 10)
    randomize(experts, 4)
    x = torch.randn(7, 6)
    assert not experts.uses_grouped_mm(x)
    out = experts(x, torch.tensor([2.0, 0.0, 4.0]))
    assert torch.allclose(out, per_expert_reference(experts, x, [2, 0, 4]), rtol=1e-6, atol=1e-7)


def test_meta_tensors_trace_the_grouped_shapes() -> None:
    """The planner traces on meta, where fp32 has no grouped GEMM kernel and no counts: the stand-in makes tensors of
    the grouped path's shapes, and backward reaches every expert weight."""
    with torch.device("meta"):
        experts = GroupedExperts(4, H, I)
        x = torch.empty(10, H, requires_grad=True)
        out = experts(x, torch.empty(4))
    assert out.shape == (10, H) and out.is_meta
    out.backward(torch.empty_like(out))
    assert x.grad.shape == x.shape and experts.w1.grad.shape == experts.w1.shape


SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique", "repeat_interleave.Tensor")


@pytest.mark.parametrize("moe_type", ["GShard", "Dropless"])
def test_routing_reads_nothing_back_to_the_host(moe_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward of a block on the grouped path run no op whose output size or value an accelerator
    would have to send to the host (a host sync per block and micro-batch): no .item()/.tolist(), no nonzero,
    bincount, unique or boolean indexing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    reads: list[str] = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append("tolist") or tolist(t))
    moe = MoE(H, I, E, K, moe_type=moe_type, num_shared_experts=1)
    randomize(moe, 0)
    x = torch.randn(2, 12, H, requires_grad=True)
    with Ops() as ops:
        F.mse_loss(moe(x), torch.zeros(2, 12, H)).backward()
    synced = [name for name in ops.names if any(op in name for op in SYNCING_OPS)]
    assert not synced and not reads, (synced, reads)
    assert any("grouped_mm" in name for name in ops.names)

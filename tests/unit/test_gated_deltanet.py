"""Gated DeltaNet (model/gated_deltanet.py): against transformers' Qwen3-Next layer (its torch path), packed
documents against each document alone, and the chunked rule against the token-by-token recurrence."""

import pytest
import torch

from internlm_offload.model.attention import Documents
from internlm_offload.model.gated_deltanet import ChunkLayout, DeltaScan, GatedDeltaNet, chunk_gated_delta_rule

HIDDEN, HK, HV, DK, DV = 32, 2, 4, 8, 6


def make(fused: bool = True, seed: int = 0, chunk_size: int = 64) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, fused=fused, chunk_size=chunk_size)
    for param, init in layer.param_inits(0.2, 0.2):
        init(param.data)
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
    return layer


def recurrent_rule(q, k, v, g, beta) -> torch.Tensor:
    """S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - e^{g_t} S_{t-1}^T k_t)^T, o_t = S_t^T q_t, token by token."""
    H, N, dk = k.shape
    state = q.new_zeros(H, dk, v.shape[-1])
    outs = []
    for t in range(N):
        state = state * g[:, t].exp()[:, None, None]
        delta = (v[:, t] - (state * k[:, t, :, None]).sum(1)) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        outs.append((state * q[:, t, :, None]).sum(1))
    return torch.stack(outs, 1)


def test_the_chunked_rule_is_the_recurrence():
    """Two chunks of 8 (a state carried across them) against the loop over tokens."""
    g_ = torch.Generator().manual_seed(0)
    H, N = 3, 16
    q = torch.nn.functional.normalize(torch.randn(H, N, 5, generator=g_), dim=-1) * 5**-0.5
    k = torch.nn.functional.normalize(torch.randn(H, N, 5, generator=g_), dim=-1)
    v = torch.randn(H, N, 4, generator=g_)
    g = -torch.rand(H, N, generator=g_)
    beta = torch.rand(H, N, generator=g_)
    out = chunk_gated_delta_rule(q, k, v, g, beta, [True, False], chunk_size=8)
    torch.testing.assert_close(out, recurrent_rule(q, k, v, g, beta), rtol=0, atol=1e-5)


def autograd_scan(u, w, q_decayed, attn, k_decayed, chunk_decay, resets):
    """The scan over chunks as plain ops under autograd (one node per chunk and op): `DeltaScan`'s reference."""
    state = u.new_zeros(u.shape[0], w.shape[-1], u.shape[-1])
    outs = []
    for i in range(u.shape[1]):
        if resets[i]:
            state = torch.zeros_like(state)
        v_new = u[:, i] - w[:, i] @ state
        outs.append(q_decayed[:, i] @ state + attn[:, i] @ v_new)
        state = state * chunk_decay[:, i] + k_decayed[:, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_scan_and_its_backward_are_autograd_s(dtype):
    """`DeltaScan` (hand-written backward, buffers allocated before its loops) against autograd through the loop:
    5 chunks of 8, two documents (a reset at chunk 3); the output and every input's gradient bit for bit."""
    g_ = torch.Generator().manual_seed(0)
    H, n, c, dk, dv = 3, 5, 8, 5, 4
    shapes = [(H, n, c, dv), (H, n, c, dk), (H, n, c, dk), (H, n, c, c), (H, n, c, dk), (H, n, 1, 1)]
    inputs = [torch.randn(shape, generator=g_, dtype=dtype) * 0.5 for shape in shapes]
    inputs[-1] = inputs[-1].sigmoid()
    resets = [True, False, False, True, False]
    ours = [t.clone().requires_grad_() for t in inputs]
    ref = [t.clone().requires_grad_() for t in inputs]
    out = DeltaScan.apply(*ours, resets)
    expected = autograd_scan(*ref, resets)
    assert torch.equal(out, expected)
    grad = torch.randn(out.shape, generator=g_, dtype=dtype)
    out.backward(grad)
    expected.backward(grad)
    for name, a, b in zip(("u", "w", "q_decayed", "attn", "k_decayed", "chunk_decay"), ours, ref, strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_the_layout_pads_each_document_to_whole_chunks():
    layout = ChunkLayout(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]), 4)
    assert layout.index.tolist() == [0, 1, 2, 4, 5, 8, 9, 10, 11, 12]
    assert layout.padded == 16 and layout.resets == [True, True, True, False]


@pytest.mark.parametrize("fused", [True, False])
def test_equals_transformers_qwen3_next_layer(fused: bool):
    """One document, 70 tokens (two chunks), fp32: output and every weight gradient within 1e-5 of transformers'
    Qwen3NextGatedDeltaNet (its torch fallback); the split layout (Qwen3.5) is fed the same weights regrouped."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(
        hidden_size=HIDDEN,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    ref = Qwen3NextGatedDeltaNet(config, 0).float()
    ours = make(fused=True)
    with torch.no_grad():
        ref.in_proj_qkvz.weight.copy_(ours.in_proj_qkvz.weight)
        ref.in_proj_ba.weight.copy_(ours.in_proj_ba.weight)
        for name in ("out_proj.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight"):
            ref.get_parameter(name).copy_(ours.get_parameter(name.replace("conv1d.weight", "conv_weight")))
    if not fused:
        ours = split_copy(ours)
    x = torch.randn(2, 70, HIDDEN)
    out, want = ours(x), ref(x)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    grad = torch.randn_like(out)
    (out * grad).sum().backward()
    (want * grad).sum().backward()
    for mine, theirs in (
        (ours.A_log, ref.A_log),
        (ours.conv_weight, ref.conv1d.weight),
        (ours.out_proj.weight, ref.out_proj.weight),
    ):
        # a whole-tensor relative error: fp32 sums over 140 tokens through two triangular solves
        assert (mine.grad - theirs.grad).norm() / theirs.grad.norm() < 1e-5


def split_copy(fused: GatedDeltaNet) -> GatedDeltaNet:
    """The same layer in Qwen3.5's split layout: the per-key-head groups of in_proj_qkvz / in_proj_ba de-grouped."""
    split = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, fused=False)
    r = HV // HK
    qkvz = fused.in_proj_qkvz.weight.view(HK, 2 * DK + 2 * r * DV, HIDDEN)
    q, k, v, z = qkvz.split([DK, DK, r * DV, r * DV], dim=1)
    b, a = fused.in_proj_ba.weight.view(HK, 2 * r, HIDDEN).split([r, r], dim=1)
    with torch.no_grad():
        split.in_proj_qkv.weight.copy_(torch.cat([t.reshape(-1, HIDDEN) for t in (q, k, v)]))
        split.in_proj_z.weight.copy_(z.reshape(-1, HIDDEN))
        split.in_proj_b.weight.copy_(b.reshape(-1, HIDDEN))
        split.in_proj_a.weight.copy_(a.reshape(-1, HIDDEN))
        for name in ("out_proj.weight", "conv_weight", "dt_bias", "A_log", "norm.weight"):
            split.get_parameter(name).copy_(fused.get_parameter(name))
    return split


def test_packed_documents_equal_each_alone():
    """Three documents packed in one row (lengths 5, 11, 3; chunks of 8 so one straddles a chunk) give each
    document's own output, and their gradients add up to the packed row's; a second row unpacked."""
    layer = make(chunk_size=8)
    lengths = [5, 11, 3]
    x = torch.randn(1, sum(lengths), HIDDEN, dtype=torch.float64)
    layer = layer.double()
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = layer(x, documents=Documents(positions))
    alone = torch.cat([layer(part) for part in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)
    grad = torch.randn_like(packed)
    want = torch.autograd.grad((alone * grad).sum(), layer.conv_weight)[0]
    got = torch.autograd.grad((packed * grad).sum(), layer.conv_weight)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_it_traces_on_meta():
    """The preflight and the planner trace a step on meta (the default device meta, packed position ids on meta):
    the layout takes one document a row there, and the output has the shape of the input."""
    with torch.device("meta"):
        layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, chunk_size=8)
        x = torch.randn(2, 19, HIDDEN, requires_grad=True)
        positions = torch.arange(19).expand(2, 19)
        out = layer(x, documents=Documents(positions))
        out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape

"""GPT-OSS's pieces on the shared modules (model/attention.py sinks and windows, model/experts.py's clamped SwiGLU and
biases, model/router.py's top-k-then-softmax router with bias, the MXFP4 dequantiser), each against a hand
computation."""

import math

import pytest
import torch

from internlm_offload.model.attention import Attention, Documents, attend_masked, sliding_window
from internlm_offload.model.experts import ClampedSwiGLU, GroupedExperts
from internlm_offload.model.families.gpt_oss.mxfp4 import dequantize, dequantize_folder
from internlm_offload.model.router import Router


def qkv(seed: int = 0, heads: int = 4, kv_heads: int = 2, seq: int = 10) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, seq, h, 8, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))


def test_a_sink_of_minus_infinity_is_plain_attention():
    q, k, v = qkv()
    allowed = sliding_window(10, None, q.device)
    plain = attend_masked(q, k, v, allowed, None)
    sunk = attend_masked(q, k, v, allowed, torch.full((4,), float("-inf"), dtype=torch.float64))
    torch.testing.assert_close(sunk, plain, rtol=0, atol=1e-12)


def test_a_sink_only_joins_the_denominator():
    """Each row of a head is the plain output times sum(exp(logits)) / (sum(exp(logits)) + exp(sink)): the sink is a
    key whose value is zero, its logit not scaled."""
    q, k, v = qkv()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    allowed = sliding_window(10, None, q.device)
    plain = attend_masked(q, k, v, allowed, None)
    keys = k.repeat_interleave(2, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, keys) * 8**-0.5
    lse = logits.masked_fill(~allowed, float("-inf")).logsumexp(-1)  # (B, H, S)
    share = torch.sigmoid(lse - sinks[None, :, None]).transpose(1, 2)[..., None]  # (B, S, H, 1)
    torch.testing.assert_close(attend_masked(q, k, v, allowed, sinks), plain * share, rtol=0, atol=1e-12)


def test_the_window_sees_the_last_keys_of_its_own_document():
    """Query q sees key k iff 0 <= q - k < window and both are in one document: a key outside is free to change."""
    torch.manual_seed(0)
    attention = Attention(16, 4, 2, "sdpa", bias=True, head_dim=4, sinks=True, window=3).double()
    for _, param in attention.named_parameters():
        torch.nn.init.normal_(param)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])  # documents 0..5 and 6..9
    documents = Documents(positions)
    rope = (torch.ones(10, 4, dtype=torch.float64), torch.zeros(10, 4, dtype=torch.float64))
    x = torch.randn(1, 10, 16, dtype=torch.float64)
    out = attention(x, rope, documents)
    want = torch.zeros(10, 10, dtype=torch.bool)
    for query in range(10):
        for key in range(10):
            want[query, key] = 0 <= query - key < 3 and (query < 6) == (key < 6)
    assert torch.equal(documents.window_mask(3)[0, 0], want)
    assert torch.equal(documents.window_mask(3, sink_column=True)[0, 0, :, 1:], want)
    for key in range(10):
        moved = x.clone()
        moved[0, key] += 1.0
        changed = (attention(moved, rope, documents) - out).abs().amax(-1)[0] > 0  # (T,)
        assert torch.equal(changed, want[:, key]), (key, changed)


def test_the_clamped_swiglu_is_gpt_oss_formula_by_hand():
    gate = torch.tensor([10.0, 1.0, -10.0, 0.3])
    up = torch.tensor([8.0, -9.0, 0.5, -0.2])
    want = []
    for g, u in zip(gate.tolist(), up.tolist(), strict=True):
        g, u = min(g, 7.0), max(min(u, 7.0), -7.0)  # gate clamped from above only
        want.append((u + 1) * g / (1 + math.exp(-1.702 * g)))
    torch.testing.assert_close(ClampedSwiGLU(1.702, 7.0)(gate, up), torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_biased_experts_add_each_experts_own_biases():
    """The grouped GEMM (row biases by a one-hot matmul) and the loop per expert agree, and the biases are each
    expert's own: against a hand loop."""
    torch.manual_seed(0)
    experts = GroupedExperts(3, 8, 5, bias=True, activation=ClampedSwiGLU())
    for param in experts.parameters():
        torch.nn.init.normal_(param)
    x, counts = torch.randn(7, 8), torch.tensor([2, 0, 5])
    ends = counts.cumsum(0)
    rows = [0, 0, 2, 2, 2, 2, 2]
    want = torch.stack(
        [
            (ClampedSwiGLU()(xr @ experts.w1[e].T + experts.b1[e], xr @ experts.w3[e].T + experts.b3[e]))
            @ experts.w2[e].T
            + experts.b2[e]
            for xr, e in zip(x, rows, strict=True)
        ]
    )
    grouped = experts.compute_with(x, counts, ends, experts.w1, experts.w3, experts.w2)
    looped = experts._loop(x, counts, experts.w1, experts.w3, experts.w2)
    torch.testing.assert_close(grouped, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(looped, want, rtol=1e-5, atol=1e-5)


def test_the_router_takes_the_top_k_raw_logits_then_a_softmax_over_them():
    router = Router(2, 4, 2, bias=True, softmax_over_topk=True)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]]))
        router.bias.copy_(torch.tensor([0.0, 0.0, -1.5, 2.0]))
    routing = router(torch.tensor([[1.0, 0.5]]))  # logits 1, 0.5, 0, 1: the bias decides
    assert routing.indices.tolist() == [[0, 3]] or routing.indices.tolist() == [[3, 0]]
    torch.testing.assert_close(routing.weights, torch.tensor([[0.5, 0.5]]))
    routing = router(torch.tensor([[2.0, 0.0]]))  # logits 2, 0, 0.5, 0
    assert routing.indices.tolist() == [[0, 2]]
    e = math.exp(1.5)
    torch.testing.assert_close(routing.weights, torch.tensor([[e / (e + 1), 1 / (e + 1)]]))


def test_mxfp4_blocks_dequantise_by_hand():
    """Low nibble first, e2m1 values, one E8M0 exponent (bias 127) per 32 values, (E, out, in) -> (E, in, out)."""
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x21  # low 1 -> 0.5, high 2 -> 1.0
    blocks[0, 1, 0, 15] = 0xF7  # low 7 -> 6.0, high 15 -> -6.0
    scales = torch.tensor([[[128], [125]]], dtype=torch.uint8)  # 2^1, 2^-2
    out = dequantize(blocks, scales)
    assert out.shape == (1, 32, 2)
    want = torch.zeros(1, 32, 2)
    want[0, 0, 0], want[0, 1, 0] = 1.0, 2.0
    want[0, 30, 1], want[0, 31, 1] = 1.5, -1.5
    assert torch.equal(out, want)


def test_mxfp4_is_transformers_dequantiser():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (3, 6, 2), dtype=torch.uint8, generator=g)
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize(blocks, scales), want)


def test_a_lone_half_of_an_mxfp4_pair_is_named():
    with pytest.raises(ValueError, match="experts.down_proj_scales"):
        dequantize_folder({"x.experts.down_proj_scales": torch.zeros(1, 1, 1, dtype=torch.uint8)})


def gpt_oss(**sections: object) -> dict:
    config = {"model_type": "gpt_oss", "num_hidden_layers": 2, "num_local_experts": 4}
    return {"model": {"type": "gpt_oss", "hf_config": config, **sections.pop("model", {})}, **sections}


@pytest.mark.parametrize(
    "sections, fragment",
    [
        ({"model": {"lora": {"r": 4, "target_modules": ["gate_proj"]}}}, "'gate_proj' is not a linear of"),
        ({"model": {"attn_impl": "flash"}}, "model.attn_impl='flash'"),
        ({"ckpt": {"load_ckpt_info": {"path": "/x", "content": ("model",), "ckpt_type": "hf"}}}, "model.hf_path"),
    ],
)
def test_what_is_not_built_is_refused_in_one_line(sections, fragment):
    from internlm_offload.config import resolve_config

    with pytest.raises(ValueError) as raised:
        resolve_config(gpt_oss(**sections))
    message = str(raised.value).strip().splitlines()[-1]
    assert fragment in message, message


def test_the_config_refuses_a_balancing_loss_the_family_does_not_compute():
    """DeepSeek-V3's sequence-wise loss reads the bias router's routing (tests/unit/test_balancing_folders.py: the
    ones it computes)."""
    from internlm_offload.config import ConfigError, resolve_config

    with pytest.raises(ConfigError, match="model.balancing_loss='sequence': model.type='gpt_oss' computes"):
        resolve_config(gpt_oss(model={"balancing_loss": "sequence"}, loss={"moe_loss_coeff": 1e-4}))


@pytest.mark.parametrize(
    "parallel",
    [
        {"mode": "fsdp2", "tensor": {"size": 2, "mode": "msp"}, "expert": {"no_tp": True}},
        {"mode": "ddp", "tensor": {"size": 2, "mode": "isp"}},
        {"pipeline": {"size": 2}},
    ],
    ids=["msp", "isp", "pipeline"],
)
def test_the_splits_and_lora_are_taken(parallel):
    """The layouts tests/e2e/test_gpt_oss_e2e.py trains, and LoRA on the attention (transformers' names mapped)."""
    from internlm_offload.builder.model import lora_targets
    from internlm_offload.config import resolve_config

    resolve_config(gpt_oss(parallel=parallel, data={"micro_num": 2}), world_size=2)
    cfg = resolve_config(gpt_oss(model={"lora": {"r": 4, "target_modules": ["q_proj", "o_proj", "wk"]}}))
    assert lora_targets(cfg.model) == ["wq", "wo", "wk"]

"""The DeepSeek-V3 lineage's attention blocks against transformers' (tiny, CPU, float32): multi-head latent attention
(model/mla.py) for DeepseekV3Attention and Glm4MoeLiteAttention, GLM-4.5's partial-rotary grouped-query attention
(model/attention.py `Attention`), and the RoPE pieces under them (model/rope.py: interleaved and partial rotations,
YaRN's frequencies, attention factor and softmax mscale)."""

import copy
import threading

import pytest
import torch
import torch.nn.functional as F

from internlm_offload.model import attention as attention_module
from internlm_offload.model.attention import Attention, Documents, attend, document_mask
from internlm_offload.model.decoder import Decoder, DecoderLayer
from internlm_offload.model.mla import LATENT_NORM_EPS, MultiLatentAttention
from internlm_offload.model.mlp import FeedForward
from internlm_offload.model.rope import (
    apply_partial_rope,
    apply_rope_interleaved,
    rope_cos_sin,
    rope_from_parameters,
    rope_inv_freq,
    softmax_mscale,
)

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds3  # noqa: E402
from transformers.models.glm4_moe import modeling_glm4_moe as hf_glm  # noqa: E402
from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as hf_lite  # noqa: E402

H, HEADS, B, T = 64, 4, 2, 12
MLA_DIMS = dict(kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
# YaRN as DeepSeek-V3 ships it (mscale == mscale_all_dim: cos/sin unscaled, softmax scale x mscale^2), and with
# the two apart (cos/sin scaled too); a context of 64 stretched 40x: of the 4 rope pairs YaRN keeps the first, mixes
# the second, and divides the last two by 40
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
            original_max_position_embeddings=64, beta_fast=32, beta_slow=1)  # fmt: skip
YARN_APART = {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7}
DEFAULT_ROPE = dict(rope_type="default", rope_theta=500.0)


def ds3_config(rope=YARN, q_lora_rank=24, interleave=True, v_head_dim=10, bias=False):
    dims = {**MLA_DIMS, "v_head_dim": v_head_dim}
    return transformers.DeepseekV3Config(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        rope_interleave=interleave,
        rope_parameters=dict(rope),
        max_position_embeddings=2560,
        attention_bias=bias,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
        **dims,
    )


def lite_config():
    return transformers.Glm4MoeLiteConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=24,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
        **{**MLA_DIMS, "qk_nope_head_dim": 14, "v_head_dim": 30},
    )


def glm_config():
    return transformers.Glm4MoeConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
    )


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (norm weights around 1), so a weight read under the wrong name shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.2 * noise)
    return module


def ours_of(config) -> torch.nn.Module:
    """Our module for a transformers attention config, from plain arguments as a family would read them."""
    if isinstance(config, transformers.Glm4MoeConfig):
        head_dim = config.head_dim
        return Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            "sdpa",
            bias=config.attention_bias,
            head_dim=head_dim,
            qk_norm=config.use_qk_norm,
            norm_eps=config.rms_norm_eps,
            o_bias=False,
            rotary_dim=int(head_dim * config.rope_parameters["partial_rotary_factor"]),
        )
    return MultiLatentAttention(
        hidden_size=config.hidden_size,
        n_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        attn_impl="sdpa",
        bias=config.attention_bias,
        rope_interleave=config.rope_interleave,
        softmax_mscale=softmax_mscale(config.rope_parameters),
    )


GLM_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}


def our_name(hf_name: str, ours: torch.nn.Module) -> str:
    """Ours for a transformers attention parameter: MLA keeps transformers' names, `Attention` has InternLM's."""
    if isinstance(ours, MultiLatentAttention):
        return hf_name
    module, rest = hf_name.split(".", 1)
    return f"{GLM_NAMES.get(module, module)}.{rest}"


def pair(config):
    """(theirs, ours, rotary embedding) with the same random weights."""
    hf_module = {
        transformers.DeepseekV3Config: hf_ds3.DeepseekV3Attention,
        transformers.Glm4MoeLiteConfig: hf_lite.Glm4MoeLiteAttention,
        transformers.Glm4MoeConfig: hf_glm.Glm4MoeAttention,
    }[type(config)]
    rotary = {
        transformers.DeepseekV3Config: hf_ds3.DeepseekV3RotaryEmbedding,
        transformers.Glm4MoeLiteConfig: hf_lite.Glm4MoeLiteRotaryEmbedding,
        transformers.Glm4MoeConfig: hf_glm.Glm4MoeRotaryEmbedding,
    }[type(config)](config)
    theirs = randomized(hf_module(config, layer_idx=0))
    ours = ours_of(config)
    ours.load_state_dict({our_name(k, ours): v for k, v in theirs.state_dict().items()}, strict=True)
    return theirs, ours, rotary


def our_rope(config, position_ids: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) as the decoder computes them from the config's rope parameters."""
    make, attention_factor = rope_from_parameters(config.rope_parameters, config.max_position_embeddings)
    inv_freq = make(rope_dim, config.rope_parameters["rope_theta"], None)
    return rope_cos_sin(inv_freq, position_ids.shape[-1], torch.float32, position_ids, attention_factor)


def rope_dim_of(config) -> int:
    if isinstance(config, transformers.Glm4MoeConfig):
        return int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
    return config.qk_rope_head_dim


def hf_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """transformers' additive (B, 1, T, T) mask of the same packed, causal attention."""
    return torch.zeros(document_mask(position_ids).shape).masked_fill(~document_mask(position_ids), -1e30)


def packed_positions() -> torch.Tensor:
    """Row 0 one document; row 1 two (5 and 7 tokens)."""
    return torch.stack([torch.arange(T), torch.cat([torch.arange(5), torch.arange(T - 5)])])


def run_both(config, position_ids: torch.Tensor):
    """Outputs and input grads of theirs and ours on the same hidden states and output grads."""
    theirs, ours, rotary = pair(config)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, H, generator=gen)
    grad_out = torch.randn(B, T, H, generator=gen)
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    hf_rope = rotary(x, position_ids)
    rope = our_rope(config, position_ids, rope_dim_of(config))
    torch.testing.assert_close(rope, hf_rope, rtol=0, atol=1e-6)
    out_theirs, _ = theirs(x_theirs, position_embeddings=hf_rope, attention_mask=hf_mask(position_ids))
    out_ours = ours(x_ours, rope, Documents(position_ids))
    out_theirs.backward(grad_out)
    out_ours.backward(grad_out)
    return (theirs, out_theirs, x_theirs.grad), (ours, out_ours, x_ours.grad)


MLA_CASES = {
    "ds3 q_lora yarn interleaved": ds3_config(),
    "ds3 q_proj yarn interleaved": ds3_config(q_lora_rank=None),
    "ds3 q_lora yarn half-split": ds3_config(interleave=False),
    "ds3 yarn mscales apart, biases": ds3_config(rope=YARN_APART, bias=True),
    "ds3 default rope, v wider than q.k": ds3_config(rope=DEFAULT_ROPE, v_head_dim=28),
    "glm4_moe_lite": lite_config(),
    "glm4_moe partial rotary, qk-norm, biases": glm_config(),
}


@pytest.mark.parametrize("config", MLA_CASES.values(), ids=MLA_CASES.keys())
def test_outputs_and_gradients_match_transformers(config):
    (theirs, out_theirs, dx_theirs), (ours, out_ours, dx_ours) = run_both(config, packed_positions())
    torch.testing.assert_close(out_ours, out_theirs, rtol=0, atol=1e-5)
    torch.testing.assert_close(dx_ours, dx_theirs, rtol=0, atol=1e-5)
    ours_params = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():  # sums over tokens, up to ~40: fp32 rounding scales with them
        torch.testing.assert_close(ours_params[our_name(name, ours)].grad, p.grad, rtol=1e-6, atol=1e-5)


def test_the_cases_exercise_what_they_name():
    """The yarn cases scale the softmax beyond (dn+dr)^-0.5 and, with the mscales apart, cos and sin; v is narrower
    and wider than q.k; the latent norms keep transformers' 1e-6 while the configs say 1e-5."""
    ds3, apart = ours_of(MLA_CASES["ds3 q_lora yarn interleaved"]), ours_of(MLA_CASES["ds3 yarn mscales apart, biases"])
    assert ds3.scale == hf_ds3.DeepseekV3Attention(ds3_config(), 0).scaling != 20**-0.5
    assert apart.scale == hf_ds3.DeepseekV3Attention(ds3_config(rope=YARN_APART), 0).scaling != ds3.scale
    assert rope_from_parameters(YARN, 2560)[1] == 1.0 and rope_from_parameters(YARN_APART, 2560)[1] != 1.0
    assert ds3.v_head_dim < ds3.qk_head_dim and ours_of(lite_config()).v_head_dim > 20
    assert ds3.q_a_layernorm.eps == ds3.kv_a_layernorm.eps == LATENT_NORM_EPS == 1e-6
    assert hf_ds3.DeepseekV3Attention(ds3_config(), 0).kv_a_layernorm.variance_epsilon == LATENT_NORM_EPS
    assert ours_of(glm_config()).q_norm.eps == 1e-5 and ours_of(glm_config()).wo.bias is None


@pytest.mark.parametrize("rope", [YARN, YARN_APART, {**YARN, "mscale": None, "mscale_all_dim": None}, DEFAULT_ROPE])
def test_frequencies_and_attention_factor_are_transformers(rope):
    config = ds3_config(rope=rope)
    rotary = hf_ds3.DeepseekV3RotaryEmbedding(config)
    make, attention_factor = rope_from_parameters(config.rope_parameters, config.max_position_embeddings)
    assert torch.equal(make(config.qk_rope_head_dim, rope["rope_theta"], None), rotary.inv_freq)
    assert attention_factor == rotary.attention_scaling
    positions = torch.arange(3000)[None]  # past the stretched context: every ramp region turns
    torch.testing.assert_close(our_rope(config, positions, 8), rotary(torch.zeros(1), positions), rtol=0, atol=1e-6)


def test_rotations_are_bitwise_transformers():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(B, T, HEADS, 8, generator=gen), torch.randn(B, T, 1, 8, generator=gen)
    cos, sin = rope_cos_sin(rope_inv_freq(8, 100.0), T, torch.float32)
    theirs = hf_ds3.apply_rotary_pos_emb_interleave(q, k, cos[None], sin[None], unsqueeze_dim=2)
    assert torch.equal(apply_rope_interleaved(q, cos, sin), theirs[0])
    assert torch.equal(apply_rope_interleaved(k, cos, sin), theirs[1])
    q16, k16 = torch.randn(B, T, HEADS, 16, generator=gen), torch.randn(B, T, 2, 16, generator=gen)
    theirs = hf_glm.apply_rotary_pos_emb(q16, k16, cos[None], sin[None], unsqueeze_dim=2)
    assert torch.equal(apply_partial_rope(q16, cos, sin), theirs[0]) and torch.equal(q16[..., 8:], theirs[0][..., 8:])
    assert torch.equal(apply_partial_rope(k16, cos, sin), theirs[1])


@pytest.mark.parametrize("config", [ds3_config(), glm_config()], ids=["mla", "glm4_moe"])
def test_packed_documents_attend_as_if_alone(config):
    _, ours, _ = pair(config)
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(3))
    positions = packed_positions()[1:]
    packed = ours(x, our_rope(config, positions, rope_dim_of(config)), Documents(positions))
    for doc in (slice(0, 5), slice(5, T)):
        alone_positions = positions[:, doc]
        alone = ours(x[:, doc], our_rope(config, alone_positions, rope_dim_of(config)))
        torch.testing.assert_close(packed[:, doc], alone, rtol=0, atol=1e-5)


def fake_flash(q, k, v, softmax_scale=None, causal=True):
    """flash_attn_func's contract on cpu: one head width for q, k and v."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and causal
    return attend(q, k, v, None, flash=False, scale=softmax_scale)


def fake_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True):
    """flash_attn_varlen_func's contract on cpu: (total, H, D) rows, documents at cu_q."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and causal and torch.equal(cu_q, cu_k)
    bounds = cu_q.tolist()
    docs = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    return torch.cat([fake_flash(q[None, d], k[None, d], v[None, d], softmax_scale)[0] for d in docs])


@pytest.mark.parametrize("v_head_dim", [10, 28], ids=["v narrower", "v wider"])
@pytest.mark.parametrize("packed", [False, True], ids=["one document", "packed"])
def test_flash_path_pads_to_one_head_width(monkeypatch, v_head_dim, packed):
    config = ds3_config(v_head_dim=v_head_dim)
    _, ours, _ = pair(config)
    x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(4))
    positions = packed_positions() if packed else torch.arange(T).expand(B, T)
    rope = our_rope(config, positions, 8)
    documents = Documents(positions) if packed else None
    sdpa = ours(x, rope, documents)
    monkeypatch.setattr(attention_module, "_flash_attn_func", lambda: fake_flash)
    monkeypatch.setattr(attention_module, "_flash_attn_varlen_func", lambda: fake_flash_varlen)
    ours.attn_impl = "flash"
    torch.testing.assert_close(ours(x, rope, documents), sdpa, rtol=0, atol=1e-5)


class ThreadExchange:
    """isp's all-to-all between threads standing in for ranks: each sends chunk j of `scatter_dim` to rank j."""

    def __init__(self, box: dict, barrier: threading.Barrier, rank: int, size: int) -> None:
        self.box, self.barrier, self.rank, self.size = box, barrier, rank, size

    def __call__(self, x: torch.Tensor, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        self.box[self.rank] = x.chunk(self.size, dim=scatter_dim)
        self.barrier.wait()
        out = torch.cat([self.box[src][self.rank] for src in range(self.size)], dim=gather_dim)
        self.barrier.wait()  # every rank has read before the next call overwrites
        return out


@pytest.mark.parametrize("config", [ds3_config(), glm_config()], ids=["mla", "glm4_moe"])
def test_isp_exchange_gives_the_whole_sequence_output(config):
    """Two ranks, each with half the tokens and (after the exchange) half the heads, give the one-rank output."""
    _, ours, _ = pair(config)
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(5))
    positions = packed_positions()[1:]
    documents = Documents(positions)  # the whole sequence's, as the decoder hands it
    whole = ours(x, our_rope(config, positions, rope_dim_of(config)), documents)
    size, box, barrier, outs = 2, {}, threading.Barrier(2, timeout=60), {}

    def rank(r: int) -> None:
        local = copy.deepcopy(ours)
        local.sequence_exchange = ThreadExchange(box, barrier, r, size)
        part = slice(r * T // size, (r + 1) * T // size)
        outs[r] = local(x[:, part], our_rope(config, positions[:, part], rope_dim_of(config)), documents)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat([outs[0], outs[1]], dim=1), whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_param_inits_cover_every_parameter_once_in_a_fixed_order(q_lora_rank):
    ours = ours_of(ds3_config(q_lora_rank=q_lora_rank, bias=True))
    names = {id(p): n for n, p in ours.named_parameters()}
    order = [names[id(p)] for p, _ in ours.param_inits(0.02, 0.01)]
    q = ["q_proj.weight"] if q_lora_rank is None else ["q_a_proj.weight", "q_b_proj.weight"]
    q_bias = [] if q_lora_rank is None else ["q_a_proj.bias"]
    norms = ["kv_a_layernorm.weight"] if q_lora_rank is None else ["q_a_layernorm.weight", "kv_a_layernorm.weight"]
    assert order == [*q, "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight",
                     *q_bias, "kv_a_proj_with_mqa.bias", "o_proj.bias", *norms]  # fmt: skip
    assert sorted(order) == sorted(names.values())


def mla_decoder(rope: dict) -> Decoder:
    """A two-block decoder of MLA blocks whose RoPE is the rope parameters' (as a deepseek_v3 family would build)."""
    make, attention_factor = rope_from_parameters(rope, 2560)
    config = ds3_config(rope=rope)

    def block(i: int) -> DecoderLayer:
        return DecoderLayer(H, 1e-5, ours_of(config), FeedForward(H, 96))

    return Decoder(
        vocab_size=50,
        hidden_size=H,
        num_layers=2,
        norm_eps=1e-5,
        rope_dim=8,
        rope_base=rope["rope_theta"],
        tie_word_embeddings=False,
        init_std=0.02,
        block=block,
        inv_freq_fn=make,
        rope_attention_factor=attention_factor,
    )


def test_a_decoder_takes_a_family_rope_and_keeps_it_through_low_precision_and_pipeline_stages():
    from internlm_offload.engine.pipeline_split import split_model

    torch.manual_seed(0)
    model = mla_decoder(YARN_APART)
    rotary = hf_ds3.DeepseekV3RotaryEmbedding(ds3_config(rope=YARN_APART))
    positions = torch.arange(T)[None]
    assert torch.equal(model.inv_freq, rotary.inv_freq)
    hf_rope = rotary(torch.zeros(1), positions)
    torch.testing.assert_close(model.rope_cos_sin(T, torch.float32, positions), hf_rope, rtol=0, atol=1e-6)
    fp32 = model.rope_cos_sin(T, torch.bfloat16)
    model.to(torch.bfloat16)  # casts inv_freq: RoPE remakes it with the family's frequencies, not rope_inv_freq's
    assert torch.equal(torch.stack(model.rope_cos_sin(T, torch.bfloat16)), torch.stack(fp32))
    ids = torch.randint(0, 50, (1, T), generator=torch.Generator().manual_seed(6))
    stages = split_model(model, size=2, num_chunks=1, rank=0, v_shape=False) | split_model(
        model, size=2, num_chunks=1, rank=1, v_shape=False
    )
    assert torch.equal(stages[1](stages[0](ids)), model(ids).logits)


def test_the_native_decoder_keeps_its_rope():
    from internlm_offload.model import InternLM2

    model = InternLM2(num_layers=1, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=4, vocab_size=50)
    assert model.inv_freq_fn is rope_inv_freq and model.rope_attention_factor == 1.0
    assert torch.equal(model.inv_freq, rope_inv_freq(16, model.rope_base))
    assert "inv_freq" in dict(model.named_buffers()) and "inv_freq" not in model.state_dict()


def test_scale_none_keeps_the_kernel_default_bitwise():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, T, HEADS, 16, generator=gen) for _ in range(3))
    default = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    assert torch.equal(attend(q, k, v, None, flash=False), default.transpose(1, 2))
    assert not torch.equal(attend(q, k, v, None, flash=False, scale=0.3), default.transpose(1, 2))

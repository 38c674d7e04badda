"""Unit tests for the InternLM2 model and the Hugging Face wrapper (tiny, CPU, float32)."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tiny_configs import TINY_HF_LLAMA

from internlm_offload.config import ModelConfig
from internlm_offload.model import DecoderLayer, HFCausalLM, InternLM2
from internlm_offload.model.attention import _flash_attn_func, uses_flash
from internlm_offload.registry import MODELS
from internlm_offload.registry import build as build_registered

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=97)
TINY_LLAMA = {**TINY_HF_LLAMA, "vocab_size": 300}


def build(seed: int = 0, **overrides) -> InternLM2:
    torch.manual_seed(seed)
    return InternLM2(**{**TINY, **overrides})


def tokens(batch: int = 2, seq: int = 16, vocab: int = TINY["vocab_size"], seed: int = 123) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- InternLM2 ----


def test_forward_shape_and_submodules():
    model = build()
    logits = model(tokens(2, 16)).logits
    assert logits.shape == (2, 16, TINY["vocab_size"]) and logits.dtype == torch.float32
    assert model.num_layers == 2 and model.vocab_size == TINY["vocab_size"]
    assert len(model.layers) == 2 and all(isinstance(layer, DecoderLayer) for layer in model.layers)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_tied_vs_untied(tied):
    model = build(tie_word_embeddings=tied)
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    embed = TINY["vocab_size"] * TINY["hidden_size"]
    assert model.num_params() - model.num_params(exclude_embeddings=True) == embed
    untied = build(tie_word_embeddings=False)
    assert untied.num_params() - model.num_params() == (0 if not tied else embed)


def test_intermediate_size_rounds_up_to_multiple_of():
    model = build(hidden_size=64, mlp_ratio=8 / 3, multiple_of=64)  # int(170.67) = 170 -> 192
    assert model.layers[0].feed_forward.w1.out_features == 192
    model = build(hidden_size=64, mlp_ratio=2.0, multiple_of=32)  # 128 already a multiple
    assert model.layers[0].feed_forward.w2.in_features == 128


def test_same_seed_is_bitwise_identical():
    a, b = build(seed=7), build(seed=7)
    assert params_equal(a, b)
    x = tokens()
    assert torch.equal(a(x).logits, b(x).logits)


def test_different_seed_differs():
    a, b = build(seed=7), build(seed=8)
    assert not torch.equal(a.layers[0].attention.wq.weight, b.layers[0].attention.wq.weight)
    assert not torch.equal(a(tokens()).logits, b(tokens()).logits)


def test_init_weights_statistics():
    model = build(num_layers=8, hidden_size=256, num_attention_heads=4, num_kv_attention_heads=4, init_std=0.02)
    layer = model.layers[0]
    assert torch.equal(layer.attention_norm.weight, torch.ones(256))
    assert layer.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.attention.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert layer.feed_forward.w2.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_causal_masking():
    model = build()
    x = tokens(1, 12)
    t = 7
    y = x.clone()
    y[0, t] = (x[0, t] + 1) % TINY["vocab_size"]
    lx, ly = model(x).logits, model(y).logits
    assert torch.equal(lx[:, :t], ly[:, :t])
    assert not torch.allclose(lx[:, t:], ly[:, t:])


def reference_attention(attn, x: torch.Tensor, rope_base: float) -> torch.Tensor:
    """Causal GQA written out: explicit RoPE, kv heads repeated, masked softmax."""
    B, T, C = x.shape
    H, KVH, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = (x @ attn.wq.weight.T).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
    k = (x @ attn.wk.weight.T).view(B, T, KVH, D).transpose(1, 2)  # (B, KVH, T, D)
    v = (x @ attn.wv.weight.T).view(B, T, KVH, D).transpose(1, 2)
    inv_freq = rope_base ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    angle = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (T, D/2)
    cos, sin = angle.cos(), angle.sin()

    def rotate(t: torch.Tensor) -> torch.Tensor:  # rotates the pair (i, i + D/2) by angle[:, i]
        t1, t2 = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat([t1 * cos - t2 * sin, t1 * sin + t2 * cos], dim=-1)

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(H // KVH, dim=1), v.repeat_interleave(H // KVH, dim=1)  # (B, H, T, D)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = scores.softmax(dim=-1) @ v  # (B, H, T, D)
    return out.transpose(1, 2).reshape(B, T, C) @ attn.wo.weight.T


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_attention_matches_reference(kv_heads):
    model = build(num_attention_heads=4, num_kv_attention_heads=kv_heads, rope_base=500.0)
    attn = model.layers[0].attention
    x = torch.randn(2, 10, TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    got = attn(x, model.rope_cos_sin(10, x.dtype))
    torch.testing.assert_close(got, reference_attention(attn, x, rope_base=500.0), rtol=1e-5, atol=1e-6)


def test_auto_attention_uses_sdpa_on_cpu():
    attn = build(attn_impl="auto").layers[0].attention
    assert not uses_flash(attn.attn_impl, torch.zeros(1, 2, TINY["hidden_size"], dtype=torch.bfloat16))


@pytest.mark.skipif(_flash_attn_func() is not None, reason="flash_attn is installed")
def test_flash_without_flash_attn_raises():
    with pytest.raises(ValueError, match="attn_impl='flash'"):
        build(attn_impl="flash")


def test_state_dict_holds_only_parameters():
    model = build()
    keys = set(model.state_dict())
    assert not any("inv_freq" in k for k in keys)
    assert keys == {name for name, _ in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_meta_build_then_init_matches_direct_build(tied):
    direct = build(seed=3, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = InternLM2(**TINY, tie_word_embeddings=tied)
    assert model.layers[0].attention.wq.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.init_weights()
    assert params_equal(direct, model)
    assert torch.equal(direct.inv_freq, model.inv_freq)
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    assert torch.equal(direct(tokens()).logits, model(tokens()).logits)


def test_bf16_forward_keeps_dtype():
    model = build().to(torch.bfloat16)
    logits = model(tokens()).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("overrides", "arg"),
    [
        (dict(num_attention_heads=6, num_kv_attention_heads=4, hidden_size=48), "num_kv_attention_heads=4"),
        (dict(hidden_size=66), "hidden_size=66"),
        (dict(hidden_size=12, num_attention_heads=4, num_kv_attention_heads=4), "hidden_size=12"),  # head_dim 3
        (dict(num_layers=0), "num_layers=0"),
        (dict(vocab_size=-1), "vocab_size=-1"),
        (dict(multiple_of=0), "multiple_of=0"),
        (dict(mlp_ratio=0.0), "mlp_ratio=0.0"),
        (dict(norm_eps=-1e-6), "norm_eps=-1e-06"),
        (dict(rope_base=0), "rope_base=0"),
        (dict(init_std=0.0), "init_std=0.0"),
        (dict(attn_impl="xformers"), "attn_impl='xformers'"),
    ],
)
def test_bad_args_raise_value_error_naming_the_arg(overrides, arg):
    with pytest.raises(ValueError, match=arg.replace("(", r"\(")):
        InternLM2(**{**TINY, **overrides})


def test_registry_lookup_builds_each_family():
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=97)
    assert isinstance(build_registered(MODELS, "internlm2", "model.type", config, torch.device("cpu")), InternLM2)
    hf = ModelConfig(type="hf_causal_lm", hf_config=TINY_LLAMA)
    assert isinstance(build_registered(MODELS, "hf_causal_lm", "model.type", hf, torch.device("cpu")), HFCausalLM)


def test_training_reduces_loss():
    model = build(seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = tokens(4, 32)
    inputs, targets = x[:, :-1], x[:, 1:]
    losses = []
    for _ in range(30):
        logits = model(inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


# ---- Hugging Face wrapper ----


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


def build_hf(seed: int = 0, **config_overrides) -> HFCausalLM:
    torch.manual_seed(seed)
    return HFCausalLM(config={**TINY_LLAMA, **config_overrides})


def test_hf_from_config(transformers):
    model = build_hf()
    assert len(model.layers) == 2 and model.num_layers == 2 and model.vocab_size == 300
    assert model.layers is model.hf_model.model.layers
    assert model.hf_model.config.use_cache is False
    x = tokens(2, 8, vocab=300)
    logits = model(x).logits
    assert logits.shape == (2, 8, 300)
    F.cross_entropy(logits.reshape(-1, 300), x.reshape(-1)).backward()
    assert all(p.grad is not None for p in model.layers.parameters())


def test_hf_dropout_is_zeroed(transformers):
    model = build_hf(attention_dropout=0.1)
    assert model.hf_model.config.attention_dropout == 0.0


def test_hf_init_weights_follows_the_seed(transformers):
    a, b = build_hf(seed=0), build_hf(seed=1)
    torch.manual_seed(5)
    a.init_weights()
    torch.manual_seed(5)
    b.init_weights()
    assert params_equal(a, b)
    torch.manual_seed(6)
    b.init_weights()
    assert not params_equal(a, b)


def test_hf_save_and_load_from_path(transformers, tmp_path):
    model = build_hf()
    model.hf_model.save_pretrained(tmp_path)
    loaded = HFCausalLM(path=str(tmp_path))
    before = {k: v.clone() for k, v in loaded.state_dict().items()}
    loaded.init_weights()  # pretrained: must keep the loaded weights
    assert all(torch.equal(before[k], v) for k, v in loaded.state_dict().items())
    x = tokens(2, 8, vocab=300)
    assert torch.equal(model(x).logits, loaded(x).logits)


def test_hf_missing_path_raises(transformers, tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match="no_such_model"):
        HFCausalLM(path=missing)


@pytest.mark.parametrize("kwargs", [{}, {"path": "x", "config": {"model_type": "llama"}}])
def test_hf_needs_exactly_one_source(kwargs):
    with pytest.raises(ValueError, match="exactly one of path= and config="):
        HFCausalLM(**kwargs)


def test_hf_without_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ImportError, match=r'pip install "internlm_offload\[hf\]"'):
        HFCausalLM(config=TINY_LLAMA)


def test_model_package_imports_without_transformers():
    code = "import sys; sys.modules['transformers'] = None; import internlm_offload.model"
    subprocess.run([sys.executable, "-c", code], check=True)

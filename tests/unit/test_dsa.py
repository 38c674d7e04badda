"""DeepSeek Sparse Attention (model/indexer.py, model/sparse_attention.py, model/dsa.py) on tiny CPU float32 blocks:
the indexer's choice against transformers' (GLM-5's interleaved and DeepSeek-V3.2's half-split RoPE), the sparse
kernel against dense attention masked to the chosen keys (forward, gradients, chunking, float64 gradcheck), the
whole block against transformers' GlmMoeDsaAttention / DeepseekV32Attention with top-k below the sequence, dense MLA
bit for bit at top-k >= the sequence, packed documents apart, and cross-layer top-k sharing."""

import pytest
import torch
from test_mla import randomized

from internlm_offload.model import indexer as indexer_module
from internlm_offload.model.attention import Documents, document_mask
from internlm_offload.model.dsa import SparseLatentAttention, indexer_sources
from internlm_offload.model.indexer import LightningIndexer
from internlm_offload.model.mla import MultiLatentAttention
from internlm_offload.model.rope import rope_cos_sin, rope_inv_freq
from internlm_offload.model.sparse_attention import sparse_attend

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm5

C, HEADS, B, T, TOPK = 64, 4, 2, 16, 5
DIMS = {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10}
# 8 indexer heads: a key scores exactly 0 when every head's ReLU is 0 (1 in 256 here), and topk breaks such ties by
# the row's layout, not by position: fewer heads make ties, and a packed row may then keep another of the tied keys
INDEX = {"index_n_heads": 8, "index_head_dim": 16, "index_topk": TOPK}
# the sparse kernel sums in another order than dense attention's: measured at most 6e-7 (fp32, these sizes)
ATOL = 1e-5


def hf_config(kind: str, topk: int = TOPK, **extra):
    """A tiny GLM-5 ("glm5") or DeepSeek-V3.2 ("v32") attention config (sdpa: transformers' bool-mask path)."""
    make = transformers.GlmMoeDsaConfig if kind == "glm5" else transformers.DeepseekV32Config
    return make(
        hidden_size=C,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        rms_norm_eps=1e-5,
        attn_implementation="sdpa",
        num_hidden_layers=3,
        **DIMS,
        **{**INDEX, "index_topk": topk},
        **extra,
    )


def ours_of(config, *, layer: int = 0, source: int = 0) -> SparseLatentAttention:
    """Our block for a transformers config, as the family builds it (model/families/deepseek_v3/model.py)."""
    indexer = None
    if source == layer:
        indexer = LightningIndexer(
            hidden_size=config.hidden_size,
            q_lora_rank=config.q_lora_rank,
            n_heads=config.index_n_heads,
            head_dim=config.index_head_dim,
            rope_dim=config.qk_rope_head_dim,
            rope_interleave=config.model_type == "glm_moe_dsa",
            topk=config.index_topk,
        )
    return SparseLatentAttention(
        layer=layer,
        source=source,
        indexer=indexer,
        topk=config.index_topk,
        hidden_size=config.hidden_size,
        n_heads=config.num_attention_heads,
        attn_impl="sdpa",
        **{k: getattr(config, k) for k in DIMS},
    )


def rope(position_ids: torch.Tensor, dim: int = DIMS["qk_rope_head_dim"]) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin(rope_inv_freq(dim, 500.0), position_ids.shape[-1], torch.float32, position_ids)


def packed_positions(length: int = T) -> torch.Tensor:
    """Row 0 one document; row 1 two (7 and length - 7 tokens)."""
    return torch.stack([torch.arange(length), torch.cat([torch.arange(7), torch.arange(length - 7)])])


def hidden(seed: int = 1, length: int = T) -> torch.Tensor:
    return torch.randn(B, length, C, generator=torch.Generator().manual_seed(seed))


def visible(indices: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, T) True where query t chose key s (and s is visible: the -1 slots choose nothing)."""
    length = indices.shape[1]
    chosen = torch.zeros(*indices.shape[:2], length + 1, dtype=torch.bool)  # column T: the empty slots
    chosen.scatter_(-1, indices.long().masked_fill(indices < 0, length), True)
    return chosen[..., :length] & document_mask(position_ids)[:, 0]


def masked_dense(q, k, v, allowed, scale):
    """The reference: dense attention with every key but the allowed ones masked out."""
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", probs, v)


# -- the indexer ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["glm5", "v32"])
def test_indexer_chooses_what_transformers_chooses(kind):
    """Same weights, same inputs: the same top-k in the same order (a wrong rope layout or slice changes it)."""
    config = hf_config(kind)
    hf_cls = hf_glm5.GlmMoeDsaIndexer if kind == "glm5" else hf_v32.DeepseekV32Indexer
    theirs = randomized(hf_cls(config, layer_idx=0))
    ours = ours_of(config).indexer
    ours.load_state_dict(theirs.state_dict())
    positions = torch.arange(T).expand(B, T)
    x, latent = hidden(1), hidden(2)[..., : config.q_lora_rank]
    cos, sin = rope(positions)
    mask = document_mask(positions)[:, 0]
    want = theirs(x, latent, (cos, sin), mask, positions)
    got = ours(x, latent, (cos, sin), positions)
    # transformers' -inf slots (fewer visible keys than top-k) point at arbitrary keys: ours are -1 there
    assert torch.equal(got[got >= 0], want[got >= 0])
    assert torch.equal((got < 0).sum(-1), (TOPK - torch.arange(1, T + 1)).clamp(min=0).expand(B, T))


def test_indexer_is_frozen_and_keeps_each_query_in_its_document():
    config = hf_config("glm5")
    indexer = randomized(ours_of(config).indexer)
    assert not any(p.requires_grad for p in indexer.parameters())
    positions = packed_positions()
    x = hidden(1).requires_grad_()
    chosen = indexer(x, hidden(2)[..., :24], rope(positions), positions)
    assert not chosen.requires_grad and chosen.dtype == torch.int32
    doc = (positions == 0).cumsum(-1)
    for b in range(B):
        for t in range(T):
            picks = chosen[b, t][chosen[b, t] >= 0].long()
            count = min(TOPK, int(positions[b, t]) + 1)  # the keys of its document up to itself
            assert len(picks) == count and len(set(picks.tolist())) == count
            assert (picks <= t).all() and (doc[b, picks] == doc[b, t]).all(), (b, t, picks)


def test_indexer_chunked_chooses_as_whole(monkeypatch):
    config = hf_config("v32")
    indexer = randomized(ours_of(config).indexer)
    positions = packed_positions()
    args = (hidden(1), hidden(2)[..., :24], rope(positions), positions)
    whole = indexer(*args)
    monkeypatch.setattr(indexer_module, "CHUNK_ELEMENTS", INDEX["index_n_heads"] * T * 3)  # 3 queries a chunk
    assert torch.equal(indexer(*args), whole)


# -- the sparse kernel ---------------------------------------------------------------------------------------------


def kernel_inputs(dtype=torch.float32, length: int = T):
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(B, length, HEADS, 12, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, length, HEADS, 10, generator=gen, dtype=dtype)
    positions = packed_positions(length)
    # a random choice among each query's visible keys, -1 past them
    score = torch.rand(B, length, length, generator=gen).masked_fill(~document_mask(positions)[:, 0], -1.0)
    best, where = score.topk(TOPK, dim=-1)
    indices = where.masked_fill(best < 0, -1).to(torch.int32)
    return [t.requires_grad_() for t in (q, k, v)], indices, positions


def test_sparse_kernel_is_dense_attention_masked_to_the_chosen_keys():
    (q, k, v), indices, positions = kernel_inputs()
    allowed = visible(indices, positions)
    grad = torch.randn(B, T, HEADS, 10, generator=torch.Generator().manual_seed(4))
    got = sparse_attend(q, k, v, indices, scale=0.3)
    want = masked_dense(q, k, v, allowed, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL)


def test_sparse_kernel_gradcheck_float64():
    """One row of 9 (two documents), 2 heads of 3 / 2 dims: small, gradcheck perturbs every input element."""
    (q, k, v), indices, _ = kernel_inputs(torch.float64, length=9)
    q, k, v = (t.detach()[:1, :, :2, :3].clone().requires_grad_() for t in (q, k, v))
    indices = indices[:1]
    assert torch.autograd.gradcheck(lambda q, k, v: sparse_attend(q, k, v, indices, scale=0.3, chunk=4), (q, k, v))


def test_sparse_kernel_chunked_equals_unchunked():
    (q, k, v), indices, _ = kernel_inputs()
    grad = torch.randn(B, T, HEADS, 10, generator=torch.Generator().manual_seed(4))
    runs = []
    for chunk in (T, 5, 1):
        out = sparse_attend(q, k, v, indices, scale=0.3, chunk=chunk)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


# -- the block -----------------------------------------------------------------------------------------------------


def pair(kind: str, topk: int = TOPK):
    config = hf_config(kind, topk)
    hf_cls = hf_glm5.GlmMoeDsaAttention if kind == "glm5" else hf_v32.DeepseekV32Attention
    theirs = randomized(hf_cls(config, layer_idx=0))
    ours = ours_of(config)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("kind", ["glm5", "v32"])
def test_block_equals_transformers_with_topk_below_the_sequence(kind):
    theirs, ours = pair(kind)
    positions = torch.arange(T).expand(B, T)
    x = hidden(1)
    grad = hidden(5)
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    mask = document_mask(positions)
    out_theirs = theirs(x_theirs, position_embeddings=rope(positions), attention_mask=mask)[0]
    out_ours = ours(x_ours, rope(positions), Documents(positions))
    torch.testing.assert_close(out_ours, out_theirs, rtol=0, atol=ATOL)
    out_theirs.backward(grad)
    out_ours.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=0, atol=ATOL)
    for name, p in ours.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, theirs.get_parameter(name).grad, rtol=0, atol=ATOL, msg=name)
        else:  # frozen, as transformers' no_grad indexer
            assert name.startswith("indexer.") and p.grad is None
    # top-k matters at this length: dense attention is another output
    dense = MultiLatentAttention(hidden_size=C, n_heads=HEADS, attn_impl="sdpa", **DIMS)
    dense.load_state_dict(ours.state_dict(), strict=False)
    assert (dense(x, rope(positions), Documents(positions)) - out_ours).abs().max() > 1e-3


def test_block_at_topk_of_the_sequence_is_dense_mla_bit_for_bit():
    _, ours = pair("glm5", topk=T)
    dense = MultiLatentAttention(hidden_size=C, n_heads=HEADS, attn_impl="sdpa", **DIMS)
    dense.load_state_dict(ours.state_dict(), strict=False)
    positions = packed_positions()
    x = hidden(1)
    assert torch.equal(ours(x, rope(positions), Documents(positions)), dense(x, rope(positions), Documents(positions)))


def test_packed_documents_see_only_their_own_keys():
    """Each document of a packed row gets the output it gets alone (top-k below each document's length)."""
    _, ours = pair("glm5")
    positions = packed_positions()[1:]  # 7 + 9 tokens
    x = hidden(1)[1:]
    with torch.no_grad():
        packed = ours(x, rope(positions), Documents(positions))
        for start, stop in ((0, 7), (7, T)):
            alone_positions = torch.arange(stop - start)[None]
            alone = ours(x[:, start:stop], rope(alone_positions), Documents(alone_positions))
            torch.testing.assert_close(packed[:, start:stop], alone, rtol=0, atol=ATOL)


def test_packed_documents_get_no_gradient_from_each_other():
    """d(the second document's outputs) / d(the first's inputs) is exactly zero, and the reverse."""
    _, ours = pair("v32")
    positions = packed_positions()[1:]
    x = hidden(1)[1:].requires_grad_()
    out = ours(x, rope(positions), Documents(positions))
    (grad_first,) = torch.autograd.grad(out[:, 7:].sum(), x, retain_graph=True)
    assert torch.equal(grad_first[:, :7], torch.zeros_like(grad_first[:, :7])) and grad_first[:, 7:].abs().sum() > 0
    (grad_second,) = torch.autograd.grad(out[:, :7].sum(), x)
    assert torch.equal(grad_second[:, 7:], torch.zeros_like(grad_second[:, 7:]))


# -- cross-layer sharing -------------------------------------------------------------------------------------------


def test_indexer_sources_follow_the_last_full_layer():
    assert indexer_sources(("full", "shared", "full", "shared", "shared")) == (0, 0, 2, 2, 2)
    with pytest.raises(ValueError, match=r"indexer_types\[0\]='shared' has no 'full' layer"):
        indexer_sources(("shared", "full"))
    with pytest.raises(ValueError, match=r"indexer_types\[1\]='sparse' must be"):
        indexer_sources(("full", "sparse"))


def test_shared_layer_attends_over_its_source_layers_choice():
    """full, full, shared: layer 2 uses layer 1's top-k (not layer 0's), read from the forward's Documents."""
    config = hf_config("glm5")
    full0, full1 = randomized(ours_of(config), 0), randomized(ours_of(config, layer=1, source=1), 1)
    shared = randomized(ours_of(config, layer=2, source=1), 2)
    assert shared.indexer is None
    positions = packed_positions()
    documents = Documents(positions)
    x = hidden(1)
    full0(x, rope(positions), documents)
    full1(hidden(2), rope(positions), documents)
    got = shared(x, rope(positions), documents)
    q, k, v, _ = shared._heads(x, rope(positions))
    for source, same in ((1, True), (0, False)):
        want = shared.o_proj(
            sparse_attend(q, k, v, documents.shared[("dsa_topk", source)], scale=shared.scale).flatten(2)
        )
        assert torch.equal(got, want) == same
    with pytest.raises(RuntimeError, match="shares layer 1's top-k, which did not run"):
        shared(x, rope(positions), Documents(positions))

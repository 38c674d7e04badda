"""The native decoder with experts and Qwen's attention: whole-model logits against transformers, the
load-balancing losses, dense blocks, bitwise determinism (tiny, CPU, float32)."""

import gc

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from internlm_offload.engine.loss import weighted_aux_losses
from internlm_offload.model import InternLM2
from internlm_offload.model.moe import MoE
from internlm_offload.model.output import MOE_AUX, ModelOutput
from internlm_offload.model.router import RouterStats, global_aux_loss

V, H, HEADS, KV, E, K = 97, 64, 4, 2, 4, 2
TINY = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, num_kv_attention_heads=KV, vocab_size=V)
TINY["attn_impl"] = "sdpa"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(seed))


def logits_and_aux(out: ModelOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE model's logits and its load-balancing loss (unweighted)."""
    return out.logits, out.aux_losses[MOE_AUX]


def load_from_hf(model: InternLM2, hf: torch.nn.Module) -> None:
    """transformers' Qwen2/3-MoE names onto the native ones (the test's own map; checkpoints are a later step)."""
    sd = hf.state_dict()
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    out["output.weight"] = sd["lm_head.weight"]
    for i in range(model.num_layers):
        hf_l, l = f"model.layers.{i}.", f"layers.{i}."
        out[l + "attention_norm.weight"] = sd[hf_l + "input_layernorm.weight"]
        out[l + "ffn_norm.weight"] = sd[hf_l + "post_attention_layernorm.weight"]
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            for kind in ("weight", "bias"):
                if hf_l + f"self_attn.{theirs}.{kind}" in sd:
                    out[l + f"attention.{ours}.{kind}"] = sd[hf_l + f"self_attn.{theirs}.{kind}"]
        for norm in ("q_norm", "k_norm"):
            if hf_l + f"self_attn.{norm}.weight" in sd:
                out[l + f"attention.{norm}.weight"] = sd[hf_l + f"self_attn.{norm}.weight"]
        if hf_l + "mlp.gate.weight" in sd:
            out[l + "feed_forward.router.weight"] = sd[hf_l + "mlp.gate.weight"]
            gate, up = sd[hf_l + "mlp.experts.gate_up_proj"].chunk(2, dim=1)
            out[l + "feed_forward.experts.w1"], out[l + "feed_forward.experts.w3"] = gate, up
            out[l + "feed_forward.experts.w2"] = sd[hf_l + "mlp.experts.down_proj"]
            shared = hf_l + "mlp.shared_expert."
            if shared + "gate_proj.weight" in sd:
                for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                    out[l + f"feed_forward.shared_experts.{ours}.weight"] = sd[shared + f"{theirs}.weight"]
                out[l + "feed_forward.coefficient.weight"] = sd[hf_l + "mlp.shared_expert_gate.weight"]
        else:
            for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                out[l + f"feed_forward.{ours}.weight"] = sd[hf_l + f"mlp.{theirs}.weight"]
    model.load_state_dict(out, strict=True)


def hf_config(cls, **extra):
    common = dict(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        num_hidden_layers=2,
        vocab_size=V,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=32,
        intermediate_size=48,
        rms_norm_eps=1e-6,
    )
    return cls(**common, **extra)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_model_matches_transformers(family: str) -> None:
    """Qwen3-MoE (head_dim 32 apart from hidden / heads = 16, q/k norms, a dense block via mlp_only_layers) and
    Qwen2-MoE (biases on q, k, v, none on o; a sigmoid-gated shared expert): logits, the global aux loss and the
    gradients of a real loss within 1e-5 relative of transformers'."""
    torch.manual_seed(0)
    if family == "qwen3":
        config = hf_config(Qwen3MoeConfig, head_dim=32, norm_topk_prob=True, mlp_only_layers=[1])
        hf = Qwen3MoeForCausalLM(config)
        ours = dict(head_dim=32, qk_norm=True, mlp_only_layers=(1,), dense_intermediate_size=48)
        ours["moe_layer_kwargs"] = dict(normalize_expert_weights=True, aux_loss_by_layer=False)
    else:
        config = hf_config(Qwen2MoeConfig, shared_expert_intermediate_size=64, norm_topk_prob=False)
        hf = Qwen2MoeForCausalLM(config)
        ours = dict(qkv_bias=True, o_bias=False, num_shared_experts=2, shared_expert_gate="sigmoid")
        ours["moe_layer_kwargs"] = dict(normalize_expert_weights=False, aux_loss_by_layer=False)
    with torch.no_grad():
        for p in hf.parameters():  # transformers zero-inits biases and norms: random ones check their wiring
            p.add_(torch.randn_like(p) * 0.05)
    model = InternLM2(**TINY, num_experts=E, top_k=K, moe_type="Dropless", mlp_ratio=0.5, multiple_of=32, **ours)
    load_from_hf(model, hf)
    ids = tokens()
    hf_out = hf(ids, output_router_logits=True)
    logits, aux = logits_and_aux(model(ids))
    assert rel_err(logits, hf_out.logits) < 1e-5
    assert rel_err(aux, hf_out.aux_loss) < 1e-5
    labels = torch.roll(ids, -1, 1)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(hf_out.logits.flatten(0, 1), labels.flatten()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert rel_err(grads["layers.0.attention.wq.weight"], hf_grads["model.layers.0.self_attn.q_proj.weight"]) < 1e-5
    assert rel_err(grads["layers.0.feed_forward.router.weight"], hf_grads["model.layers.0.mlp.gate.weight"]) < 1e-5
    assert rel_err(grads["layers.0.feed_forward.experts.w2"], hf_grads["model.layers.0.mlp.experts.down_proj"]) < 1e-5
    assert rel_err(grads["tok_embeddings.weight"], hf_grads["model.embed_tokens.weight"]) < 1e-5


def test_attention_bias_apart_from_output_bias() -> None:
    """qkv_bias without o_bias: biases on wq, wk, wv only; head_dim sets the projections' widths."""
    model = InternLM2(**TINY, qkv_bias=True, o_bias=False, head_dim=24)
    attn = model.layers[0].attention
    assert attn.wq.bias.shape == (HEADS * 24,) and attn.wk.bias.shape == (KV * 24,) and attn.wo.bias is None
    assert attn.wo.weight.shape == (H, HEADS * 24) and model.inv_freq.shape == (12,)
    assert "layers.0.attention.q_norm.weight" not in model.state_dict()


# ----------------------------------------------------------------------------- load-balancing losses


def uniform_model(moe_type: str, **kwargs) -> InternLM2:
    """Routers at zero: every expert scores 1/E exactly."""
    model = InternLM2(**TINY, num_experts=E, top_k=K, moe_type=moe_type, **kwargs)
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.router.weight.zero_()
    return model


@pytest.mark.parametrize("moe_type", ["GShard", "Dropless"])
def test_per_layer_aux_loss_is_one_per_layer_for_a_uniform_router(moe_type: str) -> None:
    _, aux = logits_and_aux(uniform_model(moe_type)(tokens()))
    assert aux.item() == 2.0  # two sparse blocks, 1 each


def test_global_aux_loss_is_top_k_for_a_uniform_router() -> None:
    model = uniform_model("Dropless", moe_layer_kwargs=dict(aux_loss_by_layer=False))
    _, aux = logits_and_aux(model(tokens()))
    assert aux.item() == float(K)


def test_the_engine_weighs_the_aux_loss_by_its_coefficient() -> None:
    """The model returns its loss without a coefficient; the engine multiplies it by `loss.moe_loss_coeff`."""
    raw = uniform_model("GShard")(tokens()).aux_losses
    weighted = weighted_aux_losses(raw, {MOE_AUX: 0.01})
    assert raw[MOE_AUX].item() == 2.0 and weighted[MOE_AUX].item() == pytest.approx(0.02, rel=1e-6)
    assert torch.equal(weighted[MOE_AUX], 0.01 * raw[MOE_AUX])


def test_global_aux_loss_equals_transformers_on_random_logits() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = [torch.randn(20, E, generator=gen) for _ in range(3)]
    stats = []
    for layer in logits:
        probs = layer.softmax(-1)
        top = probs.topk(K, dim=-1).indices
        counts = torch.stack([(top == e).sum() for e in range(E)]).float()
        stats.append(RouterStats(20, counts, counts, probs.sum(0), probs.sum(0)))
    expected = load_balancing_loss_func(tuple(logits), E, K)
    assert rel_err(global_aux_loss(stats, E), expected) < 1e-6


def test_gshard_aux_loss_counts_top1_only() -> None:
    """InternEvo GShard's f_e is the share of tokens whose top-1 is e (not of all k choices): computed by hand."""
    moe = MoE(8, 8, 4, 2, moe_type="GShard")
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    torch.nn.init.normal_(moe.router.weight, generator=torch.Generator().manual_seed(2))
    routing = moe.router(x)
    f = torch.stack([(routing.indices[:, 0] == e).float().mean() for e in range(4)])
    expected = 4 * torch.sum(f * routing.scores.mean(0))
    model_loss = InternLM2(**{**TINY, "num_layers": 1}, num_experts=4, top_k=2)
    moe.stats_sink = stats = []
    moe(x)
    assert model_loss.aux_loss(stats).item() == pytest.approx(expected.item(), rel=1e-6)


# ----------------------------------------------------------------------------- dense blocks, determinism


def test_dense_blocks_where_configured() -> None:
    """Qwen's rule: block i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    model = InternLM2(**{**TINY, "num_layers": 4}, num_experts=E, top_k=K, decoder_sparse_step=2, mlp_only_layers=(3,))
    sparse = [isinstance(layer.feed_forward, MoE) for layer in model.layers]
    assert sparse == [False, True, False, False]


@pytest.mark.parametrize("moe_type", ["GShard", "Dropless"])
def test_same_seed_same_losses_bitwise(moe_type: str) -> None:
    """Two runs of three SGD steps from the same seed: torch.equal losses, aux losses and weights."""

    def run() -> tuple[list[torch.Tensor], InternLM2]:
        torch.manual_seed(11)
        model = InternLM2(**TINY, num_experts=E, top_k=K, moe_type=moe_type, num_shared_experts=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            ids = tokens(step)
            logits, aux = logits_and_aux(model(ids))
            loss = F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten()) + aux
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses += [loss.detach(), aux.detach()]
        return losses, model

    (a, model_a), (b, model_b) = run(), run()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))


def test_expert_load_sums_forwards_once_each_even_when_recomputed() -> None:
    """ExpertLoad logs the tokens per expert of every forward since the last step: a checkpointed block, recomputed
    in backward, is counted once."""
    from torch.utils.checkpoint import checkpoint

    from internlm_offload.engine.expert_load import ExpertLoad

    model = InternLM2(**TINY, num_experts=E, top_k=K, moe_type="Dropless")
    load = ExpertLoad(model.layers)
    plain = [layer.forward for layer in model.layers]
    for layer, forward in zip(model.layers, plain):
        layer.forward = lambda *args, f=forward: checkpoint(f, *args, use_reentrant=False)
    for seed in (1, 2):
        logits, aux = logits_and_aux(model(tokens(seed)))
        (logits.float().pow(2).mean() + aux).backward()
    figures = load.metrics()
    routed = 2 * 2 * 16 * K * 2  # forwards x rows x tokens x choices x sparse blocks
    assert sum(figures["moe_tokens_per_expert"]) == routed and figures["moe_max_load"] >= 1.0
    assert load.metrics() == {}  # taken: nothing until the next forward


def live_tensors() -> dict[int, tuple[int, ...]]:
    """The shape of one tensor per distinct storage Python can reach, after a full collection."""
    gc.collect()
    return {o.untyped_storage().data_ptr(): tuple(o.shape) for o in gc.get_objects() if isinstance(o, torch.Tensor)}


@pytest.mark.parametrize("selective", [False, True])
def test_a_recomputed_block_keeps_nothing_alive_after_backward(selective: bool) -> None:
    """Under activation checkpointing a sparse block's forward runs again in backward; what it routes there must not
    outlive the backward (router statistics stored on the module kept the recomputed graph and the block's
    activations alive until the next step: 9.1 MiB at rest on configs/internlm2_tiny_moe.py). A step leaves only
    each sparse block's tokens per expert and its load since the last log, (E,) each."""
    from internlm_offload.offload.checkpointing import apply_activation_checkpointing

    torch.manual_seed(5)
    model = InternLM2(**TINY, num_experts=E, top_k=K, moe_type="GShard")
    apply_activation_checkpointing(model.layers, range(len(model.layers)), selective=selective)
    before = live_tensors()
    logits, aux = logits_and_aux(model(tokens(1)))
    (logits.float().pow(2).mean() + aux).backward()
    for p in model.parameters():
        p.grad = None
    del logits, aux
    left = [shape for ptr, shape in live_tensors().items() if ptr not in before]
    assert sorted(left) == [(E,)] * (2 * len(model.moe_layers()))


def test_every_parameter_is_initialised_once_and_a_meta_build_matches() -> None:
    """FSDP2's meta build draws each parameter through `param_inits`: every MoE, shared-expert, q/k-norm and bias
    parameter is there once, and meta + to_empty + init_weights equals a direct build under the same seed."""
    kwargs = dict(**{**TINY, "num_layers": 3}, num_experts=E, top_k=K, num_shared_experts=1, mlp_only_layers=(0,))
    kwargs.update(head_dim=32, qk_norm=True, qkv_bias=True, o_bias=False)
    torch.manual_seed(5)
    direct = InternLM2(**kwargs)
    inited = [id(p) for p, _ in direct.param_inits()]
    assert sorted(inited) == sorted(id(p) for p in direct.parameters())
    with torch.device("meta"):
        meta = InternLM2(**kwargs)
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    meta.init_weights()
    assert all(torch.equal(a, b) for a, b in zip(direct.state_dict().values(), meta.state_dict().values()))

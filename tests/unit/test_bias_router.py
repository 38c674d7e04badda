"""DeepSeek-V3's noaux_tc router and un-gated shared expert as options of the native sparse block: transformers'
`DeepseekV3MoE` reproduced, the bias choosing and never weighing, groups masked with -inf, the bias moved once a step
by the rule over the choices of the training forwards (never a recompute's), kept fp32 and checkpointed."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from internlm_offload.builder import build_components, build_trainer
from internlm_offload.config import ConfigError, resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.router_bias import RouterBiasUpdate
from internlm_offload.engine.runtime import RunContext
from internlm_offload.model.families.hf_causal_lm.model import HFCausalLM
from internlm_offload.model.moe import MoE
from internlm_offload.model.router import BiasRouter, group_limited

H, I, E, K, GROUPS, KEPT, SCALE = 32, 24, 8, 2, 4, 2, 2.5
SPEED = 0.001  # model.router_bias_update_speed's default
CTX = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
DEEPSEEK = dict(
    moe_type="Dropless",
    scoring_func="sigmoid",
    routed_scaling_factor=SCALE,
    score_correction_bias=True,
    n_group=GROUPS,
    topk_group=KEPT,
    num_shared_experts=1,
    shared_expert_gate="none",
)
# the native decoder with DeepSeek-V3's sparse blocks, from config keys
MODEL = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_kv_attention_heads": 2,
    "mlp_ratio": 0.5,
    "num_experts": E,
    "top_k": K,
    "moe_type": "Dropless",
    "num_shared_experts": 1,
    "shared_expert_gate": "none",
    "moe_layer_kwargs": {"scoring_func": "sigmoid", "routed_scaling_factor": SCALE, "score_correction_bias": True,
                         "n_group": GROUPS, "topk_group": KEPT},
}  # fmt: skip


def deepseek_pair(seed: int = 0) -> tuple[DeepseekV3MoE, MoE]:
    """transformers' block with random weights and a random nonzero bias, and the native block holding the same."""
    config = DeepseekV3Config(
        hidden_size=H,
        moe_intermediate_size=I,
        n_routed_experts=E,
        n_group=GROUPS,
        topk_group=KEPT,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        routed_scaling_factor=SCALE,
        n_shared_experts=1,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=64,
    )
    hf = DeepseekV3MoE(config)
    gen = torch.Generator().manual_seed(seed)
    moe = MoE(H, I, E, K, **DEEPSEEK)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        # scales where the bias and the groups both change choices, and some biased scores are negative
        hf.gate.weight.mul_(3.0)
        hf.gate.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
        moe.router.weight.copy_(hf.gate.weight)
        moe.router.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)  # [gate; up] per expert
        moe.experts.w1.copy_(gate)
        moe.experts.w3.copy_(up)
        moe.experts.w2.copy_(hf.experts.down_proj)
        moe.shared_experts.w1.weight.copy_(hf.shared_experts.gate_proj.weight)
        moe.shared_experts.w3.weight.copy_(hf.shared_experts.up_proj.weight)
        moe.shared_experts.w2.weight.copy_(hf.shared_experts.down_proj.weight)
    return hf, moe


def tokens(seed: int = 1, n: int = 64) -> torch.Tensor:
    return torch.randn(2, n // 2, H, generator=torch.Generator().manual_seed(seed))


def test_the_block_gives_transformers_deepseek_v3_output_and_choices() -> None:
    """Same weights and bias, same tokens: the output within 1e-6 of `DeepseekV3MoE`'s (fp32), the same top-k experts
    per token, the input gradient within 1e-5; the bias and the groups both change choices here, and some biased
    scores are negative (else they would be untested)."""
    hf, moe = deepseek_pair()
    x = tokens()
    want, got = hf(x), moe(x)
    assert (got - want).abs().max().item() <= 1e-6
    _, _, hf_ids = hf.gate(x)
    routing = moe.router(x.view(-1, H))
    assert torch.equal(routing.indices.sort(-1).values, hf_ids.sort(-1).values)
    scores = routing.scores
    unbiased = scores.topk(K, dim=-1).indices.sort(-1).values
    ungrouped = (scores + moe.router.e_score_correction_bias).topk(K, dim=-1).indices.sort(-1).values
    chosen = routing.indices.sort(-1).values
    assert (chosen != unbiased).any(-1).sum() > 0 and (chosen != ungrouped).any(-1).sum() > 0
    assert (scores + moe.router.e_score_correction_bias).min() < 0
    target = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for block in (hf, moe):
        leaf = x.clone().requires_grad_(True)
        F.mse_loss(block(leaf), target).backward()
        grads.append(leaf.grad)
    assert ((grads[1] - grads[0]).norm() / grads[0].norm()).item() < 1e-5


def test_the_bias_chooses_experts_but_never_weighs_them() -> None:
    """A large bias on expert 5 puts it in every token's top-k, yet the weights are the unbiased sigmoid scores of the
    chosen experts, renormalised over the k (plus transformers' 1e-20) and times the scaling factor."""
    router = BiasRouter(H, E, K, normalize_weights=True, scaling_factor=SCALE, n_group=GROUPS, topk_group=KEPT)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(3)) * 0.1)
        router.e_score_correction_bias[5] = 10.0
    x = tokens().view(-1, H)
    routing = router(x)
    assert (routing.indices == 5).any(-1).all()
    scores = (x @ router.weight.t()).sigmoid()
    chosen = scores.gather(1, routing.indices)
    torch.testing.assert_close(routing.weights, chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * SCALE)
    torch.testing.assert_close(routing.scores, scores)


def test_groups_left_out_are_masked_with_minus_infinity() -> None:
    """Biased scores all negative (bias -2): every chosen expert lies in the 2 best groups of 4 (by the sum of their 2
    best biased scores). XTuner's 0.0 mask would rank every left-out expert above every kept one."""
    router = BiasRouter(H, E, K, n_group=GROUPS, topk_group=KEPT)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(4)) * 0.1)
        router.e_score_correction_bias.fill_(-2.0)
    x = tokens().view(-1, H)
    routing = router(x)
    biased = routing.scores - 2.0
    group_scores = biased.view(-1, GROUPS, E // GROUPS).topk(2, dim=-1).values.sum(-1)
    best_groups = group_scores.topk(KEPT, dim=-1).indices.sort(-1).values
    chosen_groups = (routing.indices // (E // GROUPS)).unique(dim=-1, sorted=True)
    assert all(set(c.tolist()) <= set(b.tolist()) for c, b in zip(chosen_groups, best_groups))
    masked = group_limited(biased, GROUPS, KEPT)
    assert torch.isneginf(masked).sum(-1).eq((GROUPS - KEPT) * E // GROUPS).all()


def test_all_groups_kept_is_the_same_choice_bitwise() -> None:
    """topk_group == n_group skips the group step: the same indices and weights as with no groups at all."""
    x = tokens().view(-1, H)
    weight = torch.randn(E, H, generator=torch.Generator().manual_seed(5)) * 0.1
    bias = torch.randn(E, generator=torch.Generator().manual_seed(6))
    outs = []
    for groups in (1, GROUPS):
        router = BiasRouter(H, E, K, n_group=groups, topk_group=groups)
        with torch.no_grad():
            router.weight.copy_(weight)
            router.e_score_correction_bias.copy_(bias)
        outs.append(router(x))
    masked_nothing = group_limited(outs[1].scores + bias, GROUPS, GROUPS)
    assert torch.equal(masked_nothing, outs[1].scores + bias)
    assert torch.equal(outs[0].indices, outs[1].indices) and torch.equal(outs[0].weights, outs[1].weights)


def test_a_bias_block_counts_training_forwards_only() -> None:
    """`record_load` (the model's, after its own forward) adds the top-k choices to `choices` in training mode only: a
    validation forward (eval mode) must not move the bias."""
    _, moe = deepseek_pair()
    x = tokens()
    moe.eval()
    moe(x)
    moe.record_load()
    assert moe.take_choices() is None
    moe.train()
    moe(x)
    moe.record_load()
    ids = moe.router(x.view(-1, H)).indices
    assert torch.equal(moe.take_choices(), torch.bincount(ids.flatten(), minlength=E).float())
    assert moe.take_choices() is None


@pytest.mark.parametrize("bias", [False, True])
def test_a_sigmoid_block_is_recomputed_in_backward(bias: bool) -> None:
    """A sigmoid router's statistics save a softmax of their own: the block computes them in the recompute too, so
    activation checkpointing finds the tensors it saved in the forward (a CheckpointError before), and the gradient
    of output and aux terms is the one of the plain forward."""
    from torch.utils.checkpoint import checkpoint

    kwargs = DEEPSEEK if bias else dict(moe_type="Dropless", scoring_func="sigmoid")
    moe = MoE(H, I, E, K, **kwargs)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(7))
    x = tokens().requires_grad_(True)
    grads = []
    for recompute in (False, True):
        moe.stats_sink = []  # lent during the forward only, as the model does
        out = checkpoint(moe, x, use_reentrant=False) if recompute else moe(x)
        (stats,), moe.stats_sink = moe.stats_sink, None
        (out.square().mean() + stats.prob_sum.square().sum()).backward()
        grads.append(x.grad.clone())
        x.grad = None
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize(
    "kwargs, part",
    [
        ({"moe_type": "GShard", "moe_layer_kwargs": {"score_correction_bias": True}},
         "model.moe_layer_kwargs.score_correction_bias is a moe_type='Dropless' option"),
        ({"moe_layer_kwargs": {"score_correction_bias": True}}, "scoring_func='softmax' must be 'sigmoid'"),
        ({"moe_layer_kwargs": {"scoring_func": "sigmoid", "n_group": 4, "topk_group": 2}},
         "group-limited routing is DeepSeek-V3's noaux_tc router's; set model.moe_layer_kwargs.score_correction_bias"),
        ({"moe_layer_kwargs": {**MODEL["moe_layer_kwargs"], "n_group": 3}},
         "model.moe_layer_kwargs.n_group=3 must divide the 8 experts"),
        ({"moe_layer_kwargs": {**MODEL["moe_layer_kwargs"], "topk_group": 5}},
         "model.moe_layer_kwargs.topk_group=5 must be in [1, model.moe_layer_kwargs.n_group=4]"),
        ({"moe_layer_kwargs": {**MODEL["moe_layer_kwargs"], "n_group": 8, "topk_group": 1}},
         "model.moe_layer_kwargs.n_group=8 leaves groups of 1 expert"),
        ({"top_k": 6}, "model.moe_layer_kwargs.topk_group=2 groups of 2 experts hold fewer than top_k=6"),
    ],
)  # fmt: skip
def test_bad_router_combinations_are_one_line(kwargs: dict, part: str) -> None:
    model = {**MODEL, **kwargs}
    with pytest.raises(ConfigError) as info:
        resolve_config({"model": model})
    assert part in str(info.value) and "\n" not in str(info.value), str(info.value)


# ----------------------------------------------------------------------------- through the trainer


def run_config(**model: object) -> dict:
    return {
        "model": {**MODEL, **model},
        "data": {"seq_len": 16, "micro_bsz": 2, "micro_num": 2, "total_steps": 3},
        "ckpt": {"enable_save_ckpt": False},
        "monitor": {"progress_bar": "off"},
    }


def trainer_of(raw: dict, work_dir: Path):
    work_dir.mkdir(parents=True, exist_ok=True)
    return build_trainer(resolve_config(raw), CTX, work_dir)


def expected_bias(bias: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The rule, written out: -SPEED where an expert was chosen more often than its router's mean, +SPEED where less."""
    mean = counts.mean()
    return torch.where(counts > mean, bias - SPEED, torch.where(counts < mean, bias + SPEED, bias))


def train_recounting(trainer, recomputed: bool = False) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Train; returns each step's biases and the counts the bias update took. Each router's forwards are recorded
    (hooks): once per micro-batch, or twice when its block is `recomputed` in backward. Without recompute, each
    step's taken counts are this test's own count of those choices, and every bias moved by the rule over them."""
    update = next(f for f in trainer.features if isinstance(f, RouterBiasUpdate))
    routers = [block.router for block in update.choices.blocks]
    chosen: list[list[torch.Tensor]] = [[] for _ in routers]
    for i, router in enumerate(routers):
        router.register_forward_hook(lambda module, args, out, i=i: chosen[i].append(out.indices.clone()))
    taken: list[torch.Tensor] = []
    take = update.choices.take
    update.choices.take = lambda: taken.append(take().clone()) or taken[-1]
    step, history = trainer.train_step, []

    def train_step(micro_batches):
        before = [r.e_score_correction_bias.clone() for r in routers]
        for ids in chosen:
            ids.clear()
        result = step(micro_batches)
        after = [r.e_score_correction_bias.clone() for r in routers]
        assert all(b.dtype == torch.float32 for b in after)
        assert all(len(ids) == len(micro_batches) * (2 if recomputed else 1) for ids in chosen)
        if not recomputed:
            hand = torch.stack([sum(torch.bincount(i.flatten(), minlength=E).float() for i in ids) for ids in chosen])
            assert torch.equal(taken[-1], hand)
            for old, new, counts in zip(before, after, hand):
                assert torch.equal(new, expected_bias(old, counts)), (old, new)
        history.append(after)
        return result

    trainer.train_step = train_step
    trainer.train()
    return history, taken


def test_the_bias_moves_by_the_rule_and_checkpointing_counts_once(tmp_path: Path) -> None:
    """3 steps of 2 micro-batches: each sparse block's bias moves by the rule over this test's own count of its choices
    (2 micro-batches x 32 tokens x top-2 per step) and logs XTuner's maxvio; with every block checkpointed (recomputed
    in backward) the counts and the biases are the same, bit for bit: a recompute counts nothing."""
    trainer = trainer_of(run_config(), tmp_path / "plain")
    history, taken = train_recounting(trainer)
    trainer.close()
    assert len(history) == 3 and all(c.sum(-1).eq(2 * 32 * K).all() for c in taken)
    assert not torch.equal(history[-1][0], torch.zeros(E))  # it moved
    records = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    maxvio = [float(((c.amax(-1) - c.mean(-1)) / c.mean(-1)).mean()) for c in taken]
    assert [r["moe_maxvio"] for r in records] == pytest.approx(maxvio, rel=1e-6)
    again = trainer_of(run_config(checkpoint=1.0), tmp_path / "checkpointed")
    checkpointed, recounted = train_recounting(again, recomputed=True)
    again.close()
    assert all(torch.equal(a, b) for a, b in zip(recounted, taken))
    assert all(torch.equal(a, b) for step_a, step_b in zip(checkpointed, history) for a, b in zip(step_a, step_b))
    losses = [
        json.loads(line)["loss"] for line in (tmp_path / "checkpointed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert losses == [r["loss"] for r in records]


def test_the_bias_is_an_fp32_buffer_in_the_state_dict_under_bf16() -> None:
    """The bias is a persistent buffer (not a parameter, not stepped): `...router.e_score_correction_bias` in the
    state dict; bf16 with fp32 masters keeps it fp32 and one tensor in the model and the masters (which checkpoints
    save); bf16 without masters keeps it fp32 in the model."""
    name = "layers.1.feed_forward.router.e_score_correction_bias"
    for masters in (True, False):
        raw = run_config(dtype="torch.bfloat16")
        raw["mixed_precision"] = {"master_weights": masters}
        torch.manual_seed(0)
        parts = build_components(resolve_config(raw), CTX)
        model = parts.model
        assert model.layers[1].feed_forward.router.weight.dtype == torch.bfloat16
        bias = model.get_buffer(name)
        assert bias.dtype == torch.float32 and torch.equal(model.state_dict()[name], torch.zeros(E))
        assert name not in dict(model.named_parameters())
        assert parts.router_bias is not None and any(b is bias for b in parts.router_bias.biases())
        if masters:
            assert parts.masters.module.get_buffer(name) is bias


def test_a_meta_build_zeroes_the_bias() -> None:
    """FSDP2's meta build allocates buffers empty and draws through `param_inits`: the bias comes out zero and the
    rest equal to a direct build under the same seed."""
    from internlm_offload.builder.model import build_model

    cfg = resolve_config(run_config()).model
    torch.manual_seed(5)
    direct = build_model(cfg, torch.device("cpu"))
    with torch.device("meta"):
        meta = build_model(cfg, torch.device("meta"))
    meta.to_empty(device="cpu")
    for moe in meta.moe_layers():
        moe.router.e_score_correction_bias.fill_(float("nan"))
    torch.manual_seed(5)
    meta.init_weights()
    assert all(torch.equal(a, b) for a, b in zip(direct.state_dict().values(), meta.state_dict().values()))


def test_a_checkpoint_resumes_the_bias(tmp_path: Path) -> None:
    """Saved at step 2 and resumed: the biases are step 2's, and step 3 moves them as the uninterrupted run did."""
    raw = run_config()
    raw["ckpt"] = {"enable_save_ckpt": True, "checkpoint_every": 2}
    trainer = trainer_of(raw, tmp_path / "run")
    history, _ = train_recounting(trainer)
    trainer.close()
    again = trainer_of(raw, tmp_path / "resumed")
    routers = [moe.router for moe in again.model.moe_layers()]
    assert all(torch.equal(r.e_score_correction_bias, torch.zeros(E)) for r in routers)
    again.resume_from(tmp_path / "run" / "checkpoints" / "step_00000002")
    assert all(torch.equal(r.e_score_correction_bias, b) for r, b in zip(routers, history[1]))
    resumed, _ = train_recounting(again)
    again.close()
    assert len(resumed) == 1 and all(torch.equal(a, b) for a, b in zip(resumed[0], history[2]))


def test_a_transformers_model_counts_training_forwards_only() -> None:
    """The transformers wrapper counts its bias routers' choices in training forwards only, as the native block does."""
    config = {"model_type": "deepseek_v3", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16, "intermediate_size": 64, "n_group": 1, "topk_group": 1,
              "first_k_dense_replace": 0, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 8, "v_head_dim": 8}  # fmt: skip
    torch.manual_seed(0)
    model = HFCausalLM(config=config)
    ids = torch.randint(0, 32, (1, 8))
    with torch.no_grad():
        model.eval()
        model(ids)
        assert model.routers.choices.take() is None
        model.train()
        model(ids)
    assert model.routers.choices.take().sum() == 8 * 2


def test_lora_keeps_the_bias_as_loaded() -> None:
    """The bias is part of LoRA's frozen base, which a LoRA checkpoint does not hold: the update leaves it alone (a
    moved bias would be lost on resume and in every export), and says so."""
    from internlm_offload.builder.model import build_model, router_bias_update

    cfg = resolve_config(run_config(lora={"r": 4, "target_modules": ["wq", "wv"]}))
    update = router_bias_update(cfg, CTX, build_model(cfg.model, torch.device("cpu")))
    plain = resolve_config(run_config())
    assert cfg.model.router_bias_update_speed == plain.model.router_bias_update_speed > 0
    assert update is not None and update.speed == 0.0
    assert router_bias_update(plain, CTX, build_model(plain.model, torch.device("cpu"))).speed > 0

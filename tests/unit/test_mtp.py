"""Multi-token prediction (model/mtp.py) on the DeepSeek-V3 family, a 2-block tiny model (a dense block, a sparse
one): the roll stays inside each packed document; the forward is the equations written out by hand on the same weights
([embedding, hidden] concat, the pre-norm hidden state, the head norm, depth k + 1 reading depth k's output); the
engine's loss is λ x the mean over depths of their token means, weighed as the language model's loss, logged as
`mtp_loss` beside an unchanged `loss`; the MTP router's bias moves by the rule on the choices of every depth; the
config's section resolves as documented and refuses what is not built in one line."""

import pytest
import torch
import torch.nn.functional as F

from internlm_offload.builder import build_components, make_trainer
from internlm_offload.builder.model import build_model
from internlm_offload.config import ConfigError, ModelConfig, RunConfig, resolve_config
from internlm_offload.config import pipeline as pipeline_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.loss import mtp_labels
from internlm_offload.engine.runtime import RunContext
from internlm_offload.family import Capabilities
from internlm_offload.model.attention import Documents
from internlm_offload.model.families.deepseek_v3 import build as deepseek_build
from internlm_offload.model.moe import BiasBlocks
from internlm_offload.model.mtp import roll_in_documents
from internlm_offload.model.output import MTP
from internlm_offload.model.router import bias_update

pytest.importorskip("transformers")

CTX = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
VOCAB, SEQ = 64, 16
TINY = dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1)  # fmt: skip
# two rows of packed documents: 7 + 9 tokens, and 4 + 5 + 7
POSITIONS = torch.stack(
    [torch.cat([torch.arange(7), torch.arange(9)]), torch.cat([torch.arange(n) for n in (4, 5, 7)])]
)


def model_section(**mtp: object) -> dict:
    return {"type": "deepseek_v3", "hf_config": TINY, "dtype": "torch.float32", "mtp_config": mtp}


def run_config(speed: float = 0.001, **mtp: object) -> RunConfig:
    model = {**model_section(**mtp), "router_bias_update_speed": speed}
    return resolve_config({"model": model, "data": {"seq_len": SEQ, "micro_bsz": 2}})


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, positions): labels the next token inside each document, -100 at a document's last token."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    return ids, roll_by_hand(ids, 1, POSITIONS, -100), POSITIONS


def roll_by_hand(x: torch.Tensor, shift: int, positions: torch.Tensor | None, fill: int) -> torch.Tensor:
    """x[t + shift] where t + shift is in t's document, else `fill`: position by position."""
    out = torch.full_like(x, fill)
    for row in range(x.shape[0]):
        for t in range(x.shape[1] - shift):
            same = positions is None or all(positions[row, s] != 0 for s in range(t + 1, t + shift + 1))
            if same:
                out[row, t] = x[row, t + shift]
    return out


@pytest.mark.parametrize("shift", [1, 2, 5])
def test_the_roll_never_crosses_a_document(shift):
    """Red with the documents ignored (a plain roll brings the next document's tokens in)."""
    ids = torch.arange(1, 2 * SEQ + 1).reshape(2, SEQ)
    assert torch.equal(roll_in_documents(ids, shift, POSITIONS, 0), roll_by_hand(ids, shift, POSITIONS, 0))
    assert torch.equal(roll_in_documents(ids, shift, None, -100), roll_by_hand(ids, shift, None, -100))
    rolled = roll_in_documents(ids, 2, POSITIONS, 0)
    assert rolled[0, 4].item() == ids[0, 6] and rolled[0, 5].item() == 0 and rolled[0, 6].item() == 0


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@pytest.mark.parametrize("share", [False, True], ids=["a-layer-per-depth", "one-shared-layer"])
def test_the_forward_is_the_equations_on_the_same_weights(share):
    """Depth k: h^k = head_norm(block(eh_proj([enorm(Emb(ids rolled by k)), hnorm(h^{k-1})]))), h^0 the main stack's
    output before its final norm, logits^k = head(h^k); the main logits unchanged. Red with the concat reversed, with
    the main stack's normed output fed in, or with depth k + 1 fed the main stack's output again."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(**model_section(num_layers=2, share_weights=share)), torch.device("cpu"))
    assert len(model.mtp.layers) == (1 if share else 2)
    ids, _, positions = batch()
    with torch.no_grad():
        out = model(ids, positions)
        documents = Documents(positions)
        h = model.tok_embeddings(ids)
        rope = model.rope_cos_sin(SEQ, h.dtype, positions)
        for layer in model.layers:
            h = layer(h, rope, documents)
        assert torch.equal(out.logits, model.output(model.norm(h)))
        eps = model.args.rms_norm_eps
        for k in (1, 2):
            layer = model.mtp.layers[0 if share else k - 1]
            embedded = model.tok_embeddings(roll_by_hand(ids, k, positions, 0))
            joined = torch.cat([rms(embedded, layer.enorm.weight, eps), rms(h, layer.hnorm.weight, eps)], dim=-1)
            h = rms(layer.block(F.linear(joined, layer.eh_proj.weight), rope, documents), layer.head_norm.weight, eps)
            assert torch.equal(out.mtp_logits[k - 1], F.linear(h, model.output.weight)), k
    model.eval()
    assert model(ids, positions).mtp_logits == ()  # validation scores the language model alone


def build(cfg: RunConfig):
    torch.manual_seed(0)
    return build_components(cfg, CTX)


def test_the_loss_is_lambda_times_the_mean_over_depths_of_token_means():
    """Depth k's labels: the labels rolled by k inside each document (-100 past its end), counted per depth; the
    objective adds λ / D x sum_k CE_k / n_k, whose gradient and value are the hand computation's bit for bit.
    Red with the labels rolled across documents, or divided by the language model's token count."""
    cfg = run_config(num_layers=2, loss_scaling_factor=0.3)
    parts = build(cfg)
    trainer = make_trainer(cfg, CTX, parts)
    ids, labels, positions = batch()
    hand = [roll_by_hand(labels, k, positions, -100) for k in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(mtp_labels(labels, positions, 2), hand, strict=True))
    counts = [int((rolled != -100).sum()) for rolled in hand]
    weights = trainer.mtp_weights([(ids, labels, positions)])
    assert weights == tuple(0.3 / 2 / n for n in counts) and counts == [
        22,
        17,
    ]  # 5 documents: 27 labels, 5 fewer a depth
    token_weight = 1 / int((labels != -100).sum())
    try:
        _, aux = trainer.forward_backward((ids, labels, positions), token_weight, 0.0, mtp_weights=weights)
    finally:
        trainer.close()
    model = parts.model
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = model(ids, positions)
    main = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="sum")
    mtp = sum(
        F.cross_entropy(logits.flatten(0, 1), rolled.flatten(), reduction="sum") * weight
        for logits, rolled, weight in zip(out.mtp_logits, hand, weights, strict=True)
    )
    (main * token_weight + mtp).backward()
    assert torch.equal(aux[MTP], mtp.detach())
    assert all(torch.equal(grads[name], p.grad) for name, p in model.named_parameters()), "gradients differ"
    assert all(p.grad.abs().sum() > 0 for name, p in model.named_parameters() if name.startswith("mtp."))


def test_mtp_loss_is_logged_apart_and_the_language_model_loss_is_the_same_with_it_off():
    """Two micro-batches: `mtp` (metrics.jsonl's `mtp_loss`) is λ x the mean over depths of each depth's token mean
    over the step; `loss` is the language model's alone, bit for bit that of the same model with MTP off (the MTP
    weights are drawn after the main model's), which logs no `mtp`."""
    micro_batches = [batch(1), batch(2)]
    on, off = run_config(num_layers=2, loss_scaling_factor=0.3), run_config(num_layers=0)
    results = {}
    for name, cfg in (("on", on), ("off", off)):
        parts = build(cfg)
        if name == "on":  # the hand value, on the weights the step starts from (a training forward counts nothing)
            with torch.no_grad():
                outs = [parts.model(ids, positions) for ids, _, positions in micro_batches]
            BiasBlocks(parts.model).take()
            depth_sums = [
                sum(
                    F.cross_entropy(out.mtp_logits[k].flatten(0, 1), rolled.flatten(), reduction="sum")
                    for out, (_, labels, positions) in zip(outs, micro_batches, strict=True)
                    for rolled in [roll_by_hand(labels, k + 1, positions, -100)]
                )
                for k in range(2)
            ]
            counts = [sum(int((mtp_labels(mb[1], mb[2], 2)[k] != -100).sum()) for mb in micro_batches) for k in (0, 1)]
            want = 0.3 * sum(s / n for s, n in zip(depth_sums, counts, strict=True)) / 2
        trainer = make_trainer(cfg, CTX, parts)
        try:
            results[name] = trainer.train_step(micro_batches)
        finally:
            trainer.close()
    assert results["on"].aux_losses.keys() == {MTP} and not results["off"].aux_losses
    assert results["on"].aux_losses[MTP] == pytest.approx(float(want), rel=1e-6)
    assert results["on"].loss == results["off"].loss and results["on"].grad_norm != results["off"].grad_norm


def test_the_mtp_routers_bias_moves_by_the_rule_on_every_depths_choices():
    """One layer shared by two depths: its router is one more row of the bias update (after the main blocks'), its
    counts the sum of both depths' choices, and its bias moves by -speed x sign(count - mean). Red with the choices
    recorded once per forward (the last depth's alone)."""
    cfg = run_config(speed=0.01, num_layers=2, share_weights=True)
    parts = build(cfg)
    model = parts.model
    blocks = BiasBlocks(model).blocks
    mtp_moe = model.mtp.layers[0].block.feed_forward
    assert len(blocks) == 2 and blocks[-1] is mtp_moe
    calls = []
    mtp_moe.register_forward_hook(lambda module, args, out: calls.append(module.tokens_per_expert.clone()))
    trainer = make_trainer(cfg, CTX, parts)
    try:
        trainer.train_step([batch()])
    finally:
        trainer.close()
    assert len(calls) == 2
    counts = calls[0] + calls[1]
    bias = mtp_moe.router.e_score_correction_bias
    assert torch.equal(bias, bias_update(torch.zeros_like(bias), counts, 0.01)) and bias.abs().sum() > 0


def test_unset_the_section_follows_the_configs_depth_with_one_shared_layer():
    """As XTuner's GLM-5.2 `from_hf`: config.json's num_nextn_predict_layers (transformers' default 1 for DeepSeek-V3
    where left out), one physical layer, λ 0.1; under LoRA off; `num_layers` left out of a given section is the
    config's too."""
    section = ModelConfig(type="deepseek_v3", hf_config={**TINY, "num_nextn_predict_layers": 3}).mtp_config
    assert (section.num_layers, section.share_weights, section.loss_scaling_factor) == (3, True, 0.1)
    assert ModelConfig(type="deepseek_v3", hf_config=TINY).mtp_config.num_layers == 1
    assert ModelConfig(type="deepseek_v3", hf_config={**TINY, "model_type": "glm4_moe_lite"}).mtp_config.num_layers == 0
    given = ModelConfig(type="deepseek_v3", hf_config=TINY, mtp_config={"loss_scaling_factor": 0.3}).mtp_config
    assert (given.num_layers, given.share_weights, given.loss_scaling_factor) == (1, False, 0.3)
    lora = ModelConfig(type="deepseek_v3", hf_config=TINY, lora={"target_modules": ["q_b_proj"]})
    assert lora.mtp_config.num_layers == 0
    assert ModelConfig().mtp_config is None and ModelConfig(mtp_config={"num_layers": 0}).mtp_config is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"model": model_section(num_layers=-1)},
            "model.mtp_config.num_layers=-1: input should be greater than or equal to 0",
        ),
        (
            {"model": model_section(num_layers=1, loss_scaling_factor=-0.1)},
            "model.mtp_config.loss_scaling_factor=-0.1: input should be greater than or equal to 0",
        ),
        ({"model": model_section(depth=1)}, "model.mtp_config.depth"),
        (
            {"model": {"mtp_config": {"num_layers": 1}}},
            "model.mtp_config: multi-token prediction is built for model.type='deepseek_v3' / 'qwen3_next', not 'internlm2'",
        ),
        (
            {"model": {**model_section(num_layers=1), "lora": {"target_modules": ["q_b_proj"]}}},
            "model.mtp_config.num_layers=1 with model.lora: multi-token prediction is not built under LoRA",
        ),
    ],
    ids=["negative-depth", "negative-scale", "unknown-key", "another-family", "lora"],
)
def test_bad_values_are_one_line(config, message):
    with pytest.raises(ConfigError) as error:
        resolve_config(config)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_pipeline_under_a_tensor_mode_and_a_detached_head_under_tensor_parallel_are_refused_in_one_line(
    monkeypatch,
):
    """Whatever family gains a pipeline split: MTP under a pipeline with a tensor mode refused (the depths' inputs the
    stages pass on are not checked under a split sequence), MTP under a pipeline alone taken; the head's detached
    weight needs the whole head (not mtp / msp / fsp)."""
    piped = run_config(num_layers=1)
    monkeypatch.setattr(pipeline_config, "capabilities", lambda _: Capabilities(pipeline=True))
    piped.parallel.pipeline.size = 2  # as a resolved config of a family with a split would hold it
    assert pipeline_config.pipeline_problem(piped) is None
    piped.parallel.tensor.size = 2
    assert pipeline_config.pipeline_problem(piped) == (
        "parallel.pipeline.size=2 with model.mtp_config.num_layers=1 and parallel.tensor.size=2: multi-token "
        "prediction's stage inputs under a tensor mode are not checked yet; set parallel.tensor.size=1 or "
        "model.mtp_config=dict(num_layers=0)"
    )
    detached = resolve_config(
        {
            "model": model_section(num_layers=1, detach_mtp_lm_head_weight=True),
            "parallel": {"mode": "fsdp2", "tensor": {"size": 2, "mode": "msp"}, "expert": {"no_tp": True}},
        },
        world_size=2,
    )
    with pytest.raises(ConfigError, match=r"detach_mtp_lm_head_weight=True with parallel.tensor.mode='msp'"):
        deepseek_build.check_run(detached)
    deepseek_build.check_run(run_config(num_layers=1, detach_mtp_lm_head_weight=True))


def test_the_detach_options_cut_what_they_name():
    """detach_mtp_inputs: the MTP loss reaches no main-model weight but the head; detach_mtp_lm_head_weight: not the
    head."""
    ids, labels, positions = batch()
    for options, untouched in (
        ({"detach_mtp_inputs": True}, lambda n: not n.startswith(("mtp.", "output."))),
        ({"detach_mtp_lm_head_weight": True}, lambda n: n.startswith("output.")),
    ):
        torch.manual_seed(0)
        model = build_model(ModelConfig(**model_section(num_layers=1, **options)), torch.device("cpu"))
        out = model(ids, positions)
        F.cross_entropy(out.mtp_logits[0].flatten(0, 1), labels.flatten()).backward()
        touched = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert touched and not {n for n in touched if untouched(n)}, sorted(touched)

"""A mixture of experts over pipeline stages, in one process: each stage's auxiliary losses backpropagated on their
own stage (engine/stage_aux_loss.py) give one process's gradients bit for bit; each pipeline rank counts its own bias
routers' choices in a table of all the model's (model/moe.py `BiasBlocks`) whose sum over the ranks is one process's
counts and moves each rank's biases as one process moves them; torch's shape inference records no routing; and the
config checks count the family's own blocks and refuse what is not built in one line."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pipeline_configs import resolve

from internlm_offload.builder.model import build_model
from internlm_offload.config import ConfigError, ModelConfig, load_config_file, resolve_config
from internlm_offload.config.pipeline import pipeline_rank_blocks
from internlm_offload.config.pipeline_partition import local_stages
from internlm_offload.engine.loss import mtp_labels, token_loss_sum, weighted_aux_losses
from internlm_offload.engine.pipeline import PipelineRunner, PipelineStages
from internlm_offload.engine.pipeline_split import split_model
from internlm_offload.engine.router_bias import RouterBiasUpdate
from internlm_offload.engine.stage_aux_loss import carry_aux_loss
from internlm_offload.model.families.deepseek_v3.build import check_run
from internlm_offload.model.families.internlm2.model import InternLM2
from internlm_offload.model.moe import BiasBlocks
from internlm_offload.model.output import MOE_AUX

DEEPSEEK = Path(__file__).resolve().parents[2] / "configs" / "deepseek_v3_tiny.py"
TINY = load_config_file(DEEPSEEK)["model"]["hf_config"]
COEFFICIENTS = {MOE_AUX: 0.01}
TOKEN_WEIGHT, AUX_WEIGHT = 1 / 32, 0.25  # the trainer's weights of one step (any values: the same on both sides)
SPEED = 0.001  # model.router_bias_update_speed
MTP_WEIGHTS = (0.05 / 30, 0.05 / 28)  # each depth's weight on its loss sum (the trainer's: any values, the same)
NO_MTP = {"num_layers": 0}  # the bias tests without multi-token prediction (test_multi_token_prediction_* with)
LAYOUTS = [(2, 1, False), (4, 1, False), (2, 2, True)]  # (P, chunks, V): 1F1B at P=2 and P=4, ZBV's V at P=2


def test_a_carried_aux_loss_backpropagates_as_a_term_of_the_objective():
    """The stage's output is its hidden state (a copy, no view: torch's zero-bubble input pass detaches it in place);
    its backward gives every input the gradient of the objective plus the carried loss, bit for bit. Red with the
    loss's gradient dropped in backward (None for it)."""
    torch.manual_seed(0)
    x, w, g = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True), torch.randn(4, 5)
    hidden = x @ w
    ((hidden * g).sum() + (w.square().sum() * 0.1) * AUX_WEIGHT).backward()
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    hidden = x @ w
    out = carry_aux_loss(hidden, (w.square().sum() * 0.1) * AUX_WEIGHT)
    assert torch.equal(out, hidden) and out._base is None
    (out * g).sum().backward()
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])


def moe_decoder(moe_type: str) -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=67, num_experts=4,
        top_k=2, moe_type=moe_type, num_shared_experts=1,
    )  # fmt: skip


def stages_of(model: Any, size: int, chunks: int, v_shape: bool, coefficients: dict[str, float]) -> dict[int, Any]:
    """Every rank's stages of `model` by stage index, recording routing as in the schedule's forwards."""
    stages: dict[int, Any] = {}
    for rank in range(size):
        stages.update(split_model(model, size, chunks, rank, v_shape, coefficients))
    for stage in stages.values():
        stage.record_routing, stage.aux_losses.weight = True, AUX_WEIGHT
    return stages


def run_stages(stages: dict[int, Any], ids: torch.Tensor, labels: torch.Tensor) -> None:
    """One micro-batch forward through the stages in order, then backward stage by stage, each from the gradient of
    its output the next one gave its input (as the schedule sends it)."""
    inputs, outputs, x = {}, {}, ids
    for index in sorted(stages):
        inputs[index] = x
        outputs[index] = stages[index](x)
        x = outputs[index].detach().requires_grad_()
    grad = None
    for index in sorted(stages, reverse=True):
        out = outputs[index]
        if grad is None:
            (token_loss_sum(out, labels) * TOKEN_WEIGHT).backward()
        else:
            out.backward(grad)
        grad = inputs[index].grad if index else None


def one_process(model: Any, ids: torch.Tensor, labels: torch.Tensor, coefficients: dict[str, float]) -> torch.Tensor:
    """The trainer's objective of one micro-batch (loss sum times its weight plus each weighted aux loss times the
    aux weight) backpropagated; its summed weighted aux losses."""
    out = model(ids)
    objective = token_loss_sum(out.logits, labels) * TOKEN_WEIGHT
    aux = weighted_aux_losses(out.aux_losses, coefficients)
    for loss in aux.values():
        objective = objective + loss * AUX_WEIGHT
    objective.backward()
    return sum(loss.detach() for loss in aux.values())


@pytest.mark.parametrize("moe_type", ["GShard", "Dropless"])
@pytest.mark.parametrize(("size", "chunks", "v_shape"), LAYOUTS)
def test_the_stages_aux_losses_give_one_process_gradients_bitwise(moe_type, size, chunks, v_shape):
    """InternEvo's per-layer load-balancing loss, each stage's share backpropagated on its stage: every parameter's
    gradient (routers, experts, attention, embedding, head) equals one process's bit for bit; the stages' logged aux
    losses add up to one process's within float rounding (summed in another order). Red with the carried loss's
    gradient dropped (the routers' gradients off)."""
    ids, labels = torch.randint(0, 67, (2, 16)), torch.randint(0, 67, (2, 16))
    whole = moe_decoder(moe_type)
    want_aux = one_process(whole, ids, labels, COEFFICIENTS)
    model = moe_decoder(moe_type)
    stages = stages_of(model, size, chunks, v_shape, COEFFICIENTS)
    run_stages(stages, ids, labels)
    want = dict(whole.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, want[name].grad), name
    logged = [stage.aux_losses.take() for stage in stages.values()]
    got_aux = sum(sums[MOE_AUX] for sums in logged if sums)
    assert got_aux.item() == pytest.approx(want_aux.item(), rel=1e-6)


def deepseek_model(mtp: dict[str, Any] = NO_MTP) -> Any:
    torch.manual_seed(0)
    return build_model(ModelConfig(type="deepseek_v3", hf_config=TINY, mtp_config=mtp), torch.device("cpu"))


@pytest.mark.parametrize(("size", "chunks", "v_shape"), LAYOUTS)
def test_each_rank_counts_its_routers_in_a_table_of_all_and_moves_its_biases_as_one_process(size, chunks, v_shape):
    """DeepSeek-V3's tiny model (a dense first block, 3 sparse ones): each pipeline rank's table has the model's 3
    rows, its own routers' choices in theirs and zeros elsewhere (a rank holding only the dense block still gives
    one, so that every rank joins the sum); the tables summed over the ranks are one process's counts, and each
    rank's update (its rows) moves its biases to one process's bit for bit. The gradients are one process's too (no
    aux loss: the bias balances). Red with a rank's rows taken in stage order from 0 (a rank's routers filled in
    the first rows)."""
    ids, labels = torch.randint(0, 259, (2, 16)), torch.randint(0, 259, (2, 16))
    whole = deepseek_model()
    one_process(whole, ids, labels, {})
    one_blocks = BiasBlocks(whole)
    want = one_blocks.take()
    one_update = RouterBiasUpdate(one_blocks.biases, SimpleNamespace(take=want.clone), SPEED, distributed=False)
    one_update.after_backward()
    want_maxvio = one_update.metrics()["moe_maxvio"]
    model = deepseek_model()
    stages = stages_of(model, size, chunks, v_shape, {})
    run_stages(stages, ids, labels)
    want_grads = dict(whole.named_parameters())
    assert all(torch.equal(p.grad, want_grads[n].grad) for n, p in model.named_parameters())
    held = [{s: stages[s] for s in local_stages(rank, size, chunks, v_shape)} for rank in range(size)]
    ranks = [BiasBlocks(model, PipelineStages(mine)) for mine in held]
    tables = [blocks.take() for blocks in ranks]
    assert all(table.shape == want.shape for table in tables)
    summed = torch.stack(tables).sum(0)
    assert torch.equal(summed, want)
    for blocks in ranks:  # what each rank's after_backward does once the sum over every rank came back
        update = RouterBiasUpdate(
            blocks.biases, SimpleNamespace(take=summed.clone), SPEED, distributed=False, rows=blocks.rows
        )
        update.after_backward()
        assert update.metrics()["moe_maxvio"] == want_maxvio  # over all the model's routers on every rank
    got = dict(model.named_buffers())
    moved = [(name, bias) for name, bias in whole.named_buffers() if name.endswith("e_score_correction_bias")]
    assert len(moved) == 3 and all(bias.abs().sum() > 0 for _, bias in moved)
    assert all(torch.equal(got[name], bias) for name, bias in moved)


def run_stages_with_mtp(stages: dict[int, Any], ids: torch.Tensor, positions: torch.Tensor, target: torch.Tensor):
    """`run_stages` with multi-token prediction: the stages exchange tuples (the hidden state, then each depth's input
    embedding), the last stage's output (logits, then each depth's) scored by the runner's own loss function."""
    runner = SimpleNamespace(_sequence_shard=None, _label_smoothing=0.0, _sums=[], _mtp_sums=[], _loss_scale=1.0)
    inputs, outputs, x = {}, {}, (ids,)
    for index in sorted(stages):
        inputs[index] = x
        out = stages[index](*x, position_ids=positions)
        outputs[index] = out if isinstance(out, tuple) else (out,)
        x = tuple(o.detach().requires_grad_() for o in outputs[index])
    grads = None
    for index in sorted(stages, reverse=True):
        if grads is None:
            PipelineRunner.loss(runner, outputs[index], target, TOKEN_WEIGHT, MTP_WEIGHTS).backward()
        else:
            torch.autograd.backward(outputs[index], grads)
        grads = tuple(t.grad for t in inputs[index]) if index else None
    return runner


@pytest.mark.parametrize(("size", "chunks", "v_shape"), LAYOUTS)
@pytest.mark.parametrize("share", [False, True])
def test_multi_token_prediction_on_the_last_stage_gives_one_process_gradients_and_biases_bitwise(
    size, chunks, v_shape, share
):
    """DeepSeek-V3's tiny model with two MTP depths (two layers, or one shared) over pipeline stages, two documents
    packed in each row: the first stage embeds each depth's rolled ids and the stages pass them on beside the hidden
    state; the last runs the depths and scores them with the runner's loss. Every parameter's gradient (the embedding
    taking the depths' share through the stages) and the routers' counts (the MTP router's row too) are one
    process's bit for bit, and the loss sums too. Red with the depths' embeddings passed on detached (the embedding's
    gradient off), with the last stage's logits computed after the depths (every gradient a few ulps off: the hidden
    state's two gradients summed in the other order) and with the MTP routers' choices not counted (their row 0)."""
    mtp = {"num_layers": 2, "share_weights": share}
    ids = torch.randint(0, 259, (2, 16))
    positions = torch.cat([torch.arange(10), torch.arange(6)]).repeat(2, 1)
    labels = torch.randint(0, 259, (2, 16))
    depth_labels = mtp_labels(labels, positions, 2)
    whole = deepseek_model(mtp)
    out = whole(ids, positions)
    want_mtp = sum(token_loss_sum(d, t) * w for d, t, w in zip(out.mtp_logits, depth_labels, MTP_WEIGHTS, strict=True))
    want_loss = token_loss_sum(out.logits, labels)
    (want_loss * TOKEN_WEIGHT + want_mtp).backward()
    want_counts = BiasBlocks(whole).take()
    assert want_counts.shape[0] == 3 + (1 if share else 2)
    model = deepseek_model(mtp)
    stages = stages_of(model, size, chunks, v_shape, {})
    runner = run_stages_with_mtp(stages, ids, positions, torch.stack([labels, *depth_labels], 1))
    assert torch.equal(runner._sums[0], want_loss) and torch.equal(runner._mtp_sums[0], want_mtp)
    want_grads = dict(whole.named_parameters())
    assert all(torch.equal(p.grad, want_grads[n].grad) for n, p in model.named_parameters())
    held = [{s: stages[s] for s in local_stages(rank, size, chunks, v_shape)} for rank in range(size)]
    tables = [BiasBlocks(model, PipelineStages(mine)).take() for mine in held]
    assert torch.equal(torch.stack(tables).sum(0), want_counts)
    assert any(name.startswith("mtp.") for mine in held for name, _ in PipelineStages(mine).named_parameters())


def test_a_forward_outside_the_schedules_micro_batches_records_no_routing():
    """torch's shape inference runs each stage once before the first step (elsewhere than the first stage on
    uninitialised buffers): without `record_routing` a stage counts no choice, no load and no aux loss, so the bias
    update and the logged losses see the micro-batches alone. Red with every forward recording."""
    model = deepseek_model()
    (stage,) = split_model(model, 2, 1, 1, False).values()
    stage(torch.randn(2, 16, 128))
    assert all(moe.take_choices() is None and moe.take_load() is None for moe in BiasBlocks(model).blocks)
    moe_model = moe_decoder("GShard")
    (first,) = split_model(moe_model, 2, 1, 0, False, COEFFICIENTS).values()
    first(torch.randint(0, 67, (2, 16)))
    assert first.aux_losses.take() == {}


# ----------------------------------------------------------------------------- config


def deepseek(world_size: int, options: dict[str, Any], **hf_config: Any):
    """configs/deepseek_v3_tiny.py under `options` (dotted), its hf_config updated by `hf_config`."""
    config = load_config_file(DEEPSEEK, {"model.mtp_config": NO_MTP, **options})
    config["model"]["hf_config"].update(hf_config)
    return resolve_config(config, world_size=world_size)


def test_the_partition_counts_the_familys_blocks():
    """DeepSeek-V3's blocks are its config's `num_hidden_layers` (6 here), not the section's `num_layers` (4):
    InternEvo's uniform split by count, each dense-first block counted as one; the refusals name the config's
    count."""
    cfg = deepseek(2, {"parallel.pipeline.size": 2, "data.micro_num": 4}, num_hidden_layers=6)
    assert cfg.model.num_layers == 4
    assert [pipeline_rank_blocks(cfg, r) for r in range(2)] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ConfigError) as info:
        deepseek(4, {"parallel.pipeline.size": 4, "model.num_chunks": 2, "data.micro_num": 4}, num_hidden_layers=6)
    assert "the config's num_hidden_layers=6 over 4 pipeline ranks x 2 chunks leaves a stage without a block" in str(
        info.value
    )


@pytest.mark.parametrize(
    ("world_size", "options", "message"),
    [
        (
            2,
            {"model.num_experts": 4, "model.moe_type": "Dropless", "model.moe_layer_kwargs.aux_loss_by_layer": False},
            "aux_loss_by_layer=False: the global load-balancing loss pools the router statistics of all blocks",
        ),
        (
            4,
            {"model.num_experts": 4, "parallel.tensor.size": 2, "parallel.tensor.mode": "isp", "parallel.mode": "ddp"},
            "parallel.tensor.size=2 on a mixture of experts: a stage's tensor group under experts is not checked yet",
        ),
        (4, {"model.num_experts": 4, "parallel.expert.size": 2}, "pipeline with expert parallel is not built yet"),
    ],
)
def test_what_a_pipeline_of_experts_cannot_take_is_one_line(world_size, options, message):
    with pytest.raises(ConfigError) as info:
        resolve(world_size, options)
    assert message in str(info.value), str(info.value)
    assert len(str(info.value).splitlines()) <= 2


def test_a_mixture_of_experts_and_multi_token_prediction_split():
    """InternEvo's MoE keys resolve under a pipeline (configs/internlm2_tiny_pp2.py with experts), and so does a model
    section with multi-token prediction (`model.mtp_config`: its layers on the last stage); a DeepSeek config that
    ties the embedding and the head is refused by its family."""
    assert resolve(2, {"model.num_experts": 4, "model.top_k": 2}).model.num_experts == 4
    mtp = deepseek(2, {"parallel.pipeline.size": 2, "data.micro_num": 4, "model.mtp_config": {"num_layers": 2}})
    assert mtp.model.mtp_config.num_layers == 2
    cfg = deepseek(2, {"parallel.pipeline.size": 2, "data.micro_num": 4}, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="the config's tie_word_embeddings=True: the embedding and the head sit on"):
        check_run(cfg)


def test_a_balancing_loss_is_refused_under_a_pipeline():
    """A balancing loss (`model.balancing_loss`) has no stage share yet: one line naming the key."""
    options = {"parallel.pipeline.size": 2, "data.micro_num": 4, "model.balancing_loss": "micro_batch"}
    options["loss.moe_loss_coeff"] = 0.001
    with pytest.raises(ConfigError, match="model.balancing_loss='micro_batch': the balancing loss is not split"):
        deepseek(2, options)

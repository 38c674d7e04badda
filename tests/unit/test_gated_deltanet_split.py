"""Gated DeltaNet over ranks, one process (model/gated_deltanet.py): tensor parallel's split by whole key-head groups
and isp's exchange of the groups for the whole sequence, each rank a module (threads stand in for isp's ranks), in
float64 against the whole layer on packed documents, outputs and gradients."""

import copy
import re
import threading
from dataclasses import dataclass

import pytest
import torch
from test_mla import ThreadExchange

from internlm_offload.model.attention import Documents
from internlm_offload.model.gated_deltanet import GatedDeltaNet

HIDDEN, HK, HV, DK, DV = 24, 4, 8, 6, 5
# two rows, each two documents; the second row's boundary (token 37) is off isp's shard boundaries
POSITIONS = torch.tensor([list(range(30)) + list(range(34)), list(range(37)) + list(range(27))])
WHOLE_PARAMS = ("conv_weight", "A_log", "dt_bias", "norm.weight")
COLUMN = {True: ("in_proj_qkvz", "in_proj_ba"), False: ("in_proj_z", "in_proj_b", "in_proj_a")}


@dataclass(frozen=True)
class Split:
    """engine/tensor_parallel.py `HeadGroups` on one process: the input as it is (the test sums its gradients)."""

    rank: int
    size: int

    def local_input(self, x: torch.Tensor) -> torch.Tensor:
        return x


def make(fused: bool) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, fused=fused, chunk_size=16).double()
    for param, init in layer.param_inits(0.3, 0.3):
        init(param.data)
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
    return layer


def whole_run(layer: GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The layer's output on x with packed documents, and every parameter's (and the input's, "x") gradient of a
    fixed projection of it."""
    x = x.clone().requires_grad_()
    out = layer(x, None, Documents(POSITIONS))
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


def tensor_rank(layer: GatedDeltaNet, rank: int, size: int) -> GatedDeltaNet:
    """Rank `rank` of `size` as tensor parallel shards it (engine/tensor_parallel.py): the column projections' rows
    split evenly (the fused ones: whole key-head groups; the split in_proj_z / b / a: whole value heads), out_proj's
    columns, the rest whole (the split in_proj_qkv too: the layer reads its groups' rows)."""
    local = copy.deepcopy(layer)
    with torch.no_grad():
        for name in COLUMN[layer.fused]:
            getattr(local, name).weight = torch.nn.Parameter(getattr(layer, name).weight.chunk(size)[rank].clone())
        local.out_proj.weight = torch.nn.Parameter(layer.out_proj.weight.chunk(size, dim=1)[rank].clone())
    local.head_groups = Split(rank, size)
    return local


@pytest.mark.parametrize("fused", [True, False], ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("size", [2, 4])
def test_tensor_ranks_of_whole_key_head_groups_add_up_to_the_whole_layer(fused, size):
    """Each rank's out_proj partial sums (the row-parallel all-reduce) give the whole output; the input's and the
    whole parameters' gradients summed over ranks give the whole layer's, the column / row projections' are the whole
    gradient's shards. Red with the conv's channels taken as one even run of rows per rank (the output 13.6 off at 2
    ranks), and with Qwen3.5's in_proj_qkv rows taken as one even run per rank (18.8 off at 2 ranks)."""
    layer = make(fused)
    x = torch.randn(2, 64, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want, grads = whole_run(layer, x)
    outs, local_grads = zip(*(whole_run(tensor_rank(layer, r, size), x) for r in range(size)), strict=True)
    torch.testing.assert_close(sum(outs), want, rtol=0, atol=1e-12)
    for name in ("x", *WHOLE_PARAMS, *(() if fused else ("in_proj_qkv.weight",))):
        torch.testing.assert_close(sum(g[name] for g in local_grads), grads[name], rtol=0, atol=1e-12)
    for name, dim in (*((f"{n}.weight", 0) for n in COLUMN[fused]), ("out_proj.weight", 1)):
        got = torch.cat([g[name] for g in local_grads], dim=dim)
        torch.testing.assert_close(got, grads[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False], ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("size", [2, 4])
def test_isp_ranks_give_the_whole_sequence_output(fused, size):
    """`size` ranks, each with its chunk of the tokens (documents crossing the chunks' boundaries), exchange the
    key-head groups for the whole sequence of theirs: their outputs, concatenated, are the whole layer's, and the
    weights' gradients summed over ranks (DDP's sum) the whole layer's. Red with the exchange's rank ignored (every
    rank reading group 0's conv channels and decay rates: the output 10.1 off at 2 ranks)."""
    layer = make(fused)
    x = torch.randn(2, 64, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want, grads = whole_run(layer, x)
    box, barrier, outs = {}, threading.Barrier(size, timeout=60), {}
    locals_ = [copy.deepcopy(layer) for _ in range(size)]

    def rank(r: int) -> None:
        local = locals_[r]
        local.sequence_exchange = ThreadExchange(box, barrier, r, size)
        part = x.chunk(size, dim=1)[r]
        outs[r] = local(part, None, Documents(POSITIONS))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = torch.cat([outs[r] for r in range(size)], dim=1)  # one graph through the exchanges: backward once
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=1e-12)
    for name, grad in grads.items():
        if name == "x":
            continue
        got = sum(dict(local.named_parameters())[name].grad for local in locals_)
        torch.testing.assert_close(got, grad, rtol=0, atol=1e-12)


def test_a_split_that_does_not_say_its_rank_is_refused():
    """A module holding some of its groups without a split (a broken plan) says so instead of guessing."""
    layer = tensor_rank(make(fused=True), 0, 2)
    layer.head_groups = None
    with pytest.raises(ValueError, match="2 of 4 key-head groups here without a split"):
        layer(torch.zeros(1, 16, HIDDEN, dtype=torch.float64))


TINY = {"model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "intermediate_size": 32, "vocab_size": 64,
        "mlp_only_layers": [1]}  # fmt: skip


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_the_tensor_plan_names_every_module_it_splits(model_type):
    """The family's plan (model/families/qwen3_next/model.py) names modules the model has (the engine checks the
    same before splitting): DeltaNet blocks by their key heads, the attention block by its heads, the dense block 1
    column / row, the rest sparse."""
    from transformers import AutoConfig

    from internlm_offload.engine.model_plan import check_model_names, check_names, planned_blocks
    from internlm_offload.engine.tensor_parallel import _block_names
    from internlm_offload.model.families.qwen3_next.args import args_from_config
    from internlm_offload.model.families.qwen3_next.model import Qwen3Next

    config = {**TINY, "model_type": model_type}
    if model_type != "qwen3_next":
        config.pop("mlp_only_layers")
    model = Qwen3Next(args_from_config(AutoConfig.for_model(**config)))
    plan = model.tensor_plan()
    check_model_names(model, plan, "test")
    for index, block, block_plan in planned_blocks(model, plan):
        check_names(block, index, _block_names(block_plan), "test")
    assert [(b.heads, b.kv_heads, b.sparse) for b in plan.blocks] == [
        (2, 2, True),
        (2, 2, model_type != "qwen3_next"),
        (2, 2, True),
        (4, 2, True),
    ]
    assert all(b.attention.whole_parameters for b in plan.blocks)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"parallel": {"mode": "ddp", "tensor": {"size": 4, "mode": "isp"}}},
            "parallel.tensor.size=4 (mode 'isp'): the Gated DeltaNet's linear_num_key_heads=2 must be a multiple of it",
        ),
        (
            {"parallel": {"pipeline": {"size": 2}}, "tie_word_embeddings": True},
            "parallel.pipeline.size=2 with the config's tie_word_embeddings=True",
        ),
    ],
)
def test_a_split_the_family_cannot_take_is_refused_in_one_line(options, message):
    """A tensor / isp group that does not divide the DeltaNet's key heads, a pipeline that ties the embedding to the
    head."""
    from internlm_offload.config import ConfigError, RunConfig
    from internlm_offload.model.families.qwen3_next.build import check_run

    tie = options.pop("tie_word_embeddings", False)
    model = {"type": "qwen3_next", "hf_config": {**TINY, "tie_word_embeddings": tie}}
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_run(RunConfig(model=model, **options))

"""The engine's hooks on model modules (model/hooks.py) and the tensor plan (model/tensor_plan.py): the engine finds
the attention and the sparse blocks through the model's plan and refuses in one line a feature asked of a module
that does not declare its hook, leaving the model as it was; a model without a plan is refused under tensor
parallel. One process over torch's fake process group (no collective runs)."""

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from internlm_offload.config import ConfigError
from internlm_offload.engine.expert_parallel import apply_expert_parallel
from internlm_offload.engine.pipeline_split import PipelineChunk
from internlm_offload.engine.runtime import expert_mesh, tensor_parallel_mesh
from internlm_offload.engine.sequence_parallel import SequenceShard, apply_sequence_parallel
from internlm_offload.engine.tensor_parallel import apply_tensor_parallel
from internlm_offload.model.attention import Attention
from internlm_offload.model.families.internlm2.model import InternLM2
from internlm_offload.model.hooks import DispatchesExperts, ExchangesSequence, ShardsSequence
from internlm_offload.model.mlp import FeedForward
from internlm_offload.model.moe import MoE

TINY = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=64)
SPARSE = dict(num_experts=4, top_k=2, multiple_of=16)


@contextlib.contextmanager
def fake_world(size: int = 2) -> Iterator[None]:
    """Rank 0 of `size` over the fake backend: meshes build, nothing is sent."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class HomegrownAttention(nn.Module):
    """A new family's attention that does not declare `ExchangesSequence`: under isp it would attend to its own
    chunk of the sequence alone."""

    def __init__(self, inner: Attention) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, rope: tuple, documents: object = None) -> torch.Tensor:
        return self.inner(x, rope, documents)


class HomegrownMoE(nn.Module):
    """A new family's sparse block that does not declare `DispatchesExperts`: under expert parallel its experts would
    stay whole on every rank, its rows never sent."""

    def __init__(self, inner: MoE) -> None:
        super().__init__()
        self.experts, self.num_experts = inner.experts, inner.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def isp_shard() -> SequenceShard:
    return SequenceShard(rank=0, size=2, group=None)  # the exchange is only bound here, never called


def test_isp_refuses_a_block_whose_attention_takes_no_sequence_exchange():
    """Block 1's attention replaced by a class without the hook: refused in one line naming the block, the class and
    the hook, before the model or any other attention is touched. The model as built takes isp whole."""
    model = InternLM2(**TINY)
    model.layers[1].attention = HomegrownAttention(model.layers[1].attention)
    with pytest.raises(ConfigError) as refused:
        apply_sequence_parallel(model, isp_shard())
    assert str(refused.value) == (
        "parallel.tensor.mode='isp': block 1's attention HomegrownAttention does not take a sequence exchange "
        "(model/hooks.py ExchangesSequence)"
    )
    assert model.sequence_shard is None and model.layers[0].attention.sequence_exchange is None

    model = InternLM2(**TINY)
    shard = isp_shard()
    apply_sequence_parallel(model, shard)
    assert model.sequence_shard is shard
    assert all(block.attention.sequence_exchange is not None for block in model.layers)


def test_isp_refuses_a_model_that_takes_no_sequence_shard():
    """A model that does not declare `ShardsSequence` would run every token on every rank: refused."""

    class Unsharded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = InternLM2(**TINY).layers

    with pytest.raises(ConfigError, match=r"^parallel.tensor.mode='isp': the model Unsharded does not take a sequence"):
        apply_sequence_parallel(Unsharded(), isp_shard())


def test_expert_parallel_refuses_a_sparse_block_that_takes_no_expert_dispatch():
    """Block 1, sparse by the config, replaced by a class without the hook: refused in one line, no block's experts
    sharded. The model as built: every sparse block's experts sharded over "ep", each given the dispatch."""
    with fake_world():
        mesh = expert_mesh("cpu", 2, 2)
        model = InternLM2(**TINY, **SPARSE)
        model.layers[1].feed_forward = HomegrownMoE(model.layers[1].feed_forward)
        with pytest.raises(ConfigError) as refused:
            apply_expert_parallel(model, mesh)
        assert str(refused.value) == (
            "parallel.expert.size=2: block 1's sparse block HomegrownMoE does not take an expert dispatch "
            "(model/hooks.py DispatchesExperts)"
        )
        untouched = model.layers[0].feed_forward
        assert untouched.expert_dispatch is None and not isinstance(untouched.experts.w1, DTensor)

        model = InternLM2(**TINY, **SPARSE)
        apply_expert_parallel(model, mesh)
        for block in model.layers:
            moe = block.feed_forward
            assert moe.expert_dispatch is not None
            assert all(isinstance(p, DTensor) and p.to_local().shape[0] == 2 for p in moe.experts.parameters())


def test_expert_parallel_refuses_a_sparse_block_the_plan_names_but_the_block_lacks():
    """A block whose sparse block sits elsewhere than the plan says: refused naming the block and the missing name."""
    with fake_world():
        model = InternLM2(**TINY, **SPARSE)
        model.layers[2].mixture = model.layers[2].feed_forward
        del model.layers[2].feed_forward
        with pytest.raises(ConfigError, match=r"^parallel.expert.size=2: block 2 \(DecoderLayer\) has no module "):
            apply_expert_parallel(model, expert_mesh("cpu", 2, 2))


def test_tensor_parallel_refuses_a_model_without_a_plan_and_a_block_without_a_planned_module():
    """No plan: refused in one line. A dense block whose MLP lacks a projection the plan names: refused, where torch's
    `parallelize_module` would skip the name and leave the MLP whole and unreduced."""

    class Planless(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList()

    with fake_world():
        tp = tensor_parallel_mesh("cpu", 2, 2)["tp"]
        with pytest.raises(ConfigError) as refused:
            apply_tensor_parallel(Planless(), tp, mode="mtp", parallel_output=True)
        assert str(refused.value) == (
            "parallel.tensor.mode='mtp': the model Planless has no tensor plan (model/hooks.py HasTensorPlan)"
        )
        model = InternLM2(**TINY)
        model.layers[0].feed_forward = nn.Sequential(nn.Linear(32, 32))
        with pytest.raises(ConfigError) as refused:
            apply_tensor_parallel(model, tp, mode="msp", parallel_output=True)
        assert str(refused.value) == (
            "parallel.tensor.mode='msp': block 0 (DecoderLayer) has no module 'feed_forward.w1', which its tensor "
            "plan names (model/tensor_plan.py)"
        )
        assert not isinstance(model.tok_embeddings.weight, DTensor)  # checked before anything is sharded


def test_the_plan_says_which_blocks_are_sparse_by_the_config_and_names_what_the_model_has():
    """Qwen's rule (every 2nd block sparse, block 3 dense by `mlp_only_layers`: block 1 alone): the plan's sparse
    blocks are the config's, the blocks' feed-forwards match, and every name the plan gives resolves."""
    model = InternLM2(**{**TINY, "num_layers": 4}, **SPARSE, decoder_sparse_step=2, mlp_only_layers=(3,))
    plan = model.tensor_plan()
    assert plan.sparse_blocks() == [1]
    assert [isinstance(block.feed_forward, MoE) for block in model.layers] == [False, True, False, False]
    for block, block_plan in zip(model.layers, plan.blocks, strict=True):
        assert isinstance(block.get_submodule(block_plan.attention.module), ExchangesSequence)
        assert block_plan.kv_heads == 2 and block_plan.attention.extra_args == 2
        names = [*block_plan.attention.column, *block_plan.attention.row, *block_plan.kv, *block_plan.norms]
        names += [*block_plan.feed_forward.column, *block_plan.feed_forward.row]
        assert all(block.get_submodule(name) is not None for name in names)
        sparse = block.get_submodule(block_plan.feed_forward.module)
        assert isinstance(sparse, DispatchesExperts) == block_plan.sparse
        assert isinstance(sparse, FeedForward) != block_plan.sparse
    for name in (plan.embedding, plan.final_norm, plan.head):
        model.get_submodule(name)


def test_the_hooks_are_declared_not_guessed():
    """A module with a slot of the hook's name but no declaration is not taken for one (the old `hasattr` test
    would); the model, its pipeline stages, attention and sparse blocks declare theirs."""

    class LookAlike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sequence_exchange = self.expert_dispatch = None

    assert not isinstance(LookAlike(), (ExchangesSequence, DispatchesExperts))
    assert issubclass(InternLM2, ShardsSequence) and issubclass(PipelineChunk, ShardsSequence)
    assert issubclass(Attention, ExchangesSequence) and issubclass(MoE, DispatchesExperts)

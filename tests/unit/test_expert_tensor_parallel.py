"""mtp/msp/fsp with every expert split over the tensor group (InternEvo's `parallel.expert.no_tp=False`,
engine/expert_tensor_parallel.py): the config rules and the sharding plan on a fake process group. The numbers
(loss and grad norm against one process) are tests/e2e/test_expert_tensor_parallel_e2e.py's."""

import pytest
import torch
import torch.distributed as dist
from test_expert_parallel import refused, resolved
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from internlm_offload.config import ConfigError

FSDP2 = ["model.dtype=torch.float32", "parallel.mode=fsdp2", "parallel.tensor.size=2"]


@pytest.mark.parametrize("mode", ["mtp", "msp", "fsp"])
def test_split_experts_route_every_token_on_every_tensor_rank(mode):
    """no_tp=False at 4 ranks, tensor 2: the tensor ranks route the same tokens, so expert parallel is carved from the
    2 data-parallel ranks (InternEvo's -1: min(2, 4 experts), said in the log), the aux loss is one process's (no
    1/T) and mtp needs no sequence split; expert weight groups over split experts are refused in one line."""
    from internlm_offload.builder.run import aux_chunks
    from internlm_offload.config import expert_ranks, experts_over_tensor, experts_split_over_tensor

    layout = [*FSDP2, f"parallel.tensor.mode={mode}"]
    cfg = resolved([*layout, "parallel.expert.size=-1"], 4)
    assert experts_split_over_tensor(cfg) and not experts_over_tensor(cfg)
    assert (cfg.parallel.expert.size, expert_ranks(cfg, 4), aux_chunks(cfg)) == (2, 2, 1)
    note = next(n for n in cfg.migration_notes()[0] if n.startswith("parallel.expert.size=-1"))
    assert "-> 2: min(data-parallel ranks 2, model.num_experts 4)" in note
    message = refused([*layout, "parallel.expert.size=2", "parallel.expert_weight.size=2"], 8)
    assert message.startswith(
        f"parallel.expert_weight.size=2 with parallel.expert.no_tp=False under parallel.tensor (size 2, mode '{mode}')"
    ), message
    assert "set parallel.expert_weight.size=1 or parallel.expert.no_tp=True" in message and "\n" not in message
    if mode == "mtp":  # every rank routes the whole sequence: an odd length splits nothing
        assert resolved([*layout, "data.seq_len=63"], 2).data.seq_len == 63


def _fake_world(rank: int):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    from internlm_offload.engine.runtime import tensor_parallel_mesh

    return tensor_parallel_mesh("cpu", 2, 2)["tp"]


def test_a_sparse_block_holds_half_of_every_expert_and_of_the_shared_expert():
    """The plan of a sparse block under msp with split experts: w1 / w3 sharded on their rows of the intermediate
    dim, w2 on its columns, the shared expert column / row parallel as the dense MLP; the router and the softmax
    coefficient stay plain whole weights (every rank computes their whole gradient)."""
    from internlm_offload.engine.expert_tensor_parallel import PartialReaders
    from internlm_offload.engine.tensor_parallel import apply_tensor_parallel
    from internlm_offload.model.families.internlm2.model import InternLM2

    tp = _fake_world(rank=1)
    try:
        with torch.device("meta"):
            model = InternLM2(
                num_layers=1, hidden_size=32, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=64,
                num_experts=4, top_k=2, num_shared_experts=1, multiple_of=16,
            )  # fmt: skip
        width = model.layers[0].feed_forward.experts.w1.shape[1]
        apply_tensor_parallel(model, tp, mode="msp", parallel_output=True, split_experts=True)
        moe = model.layers[0].feed_forward
        experts, shared = moe.experts, moe.shared_experts
        assert (experts.w1.placements, experts.w3.placements, experts.w2.placements) == ((Shard(1),),) * 2 + (
            (Shard(2),),
        )
        assert tuple(experts.w1.to_local().shape) == (4, width // 2, 32)
        assert tuple(experts.w2.to_local().shape) == (4, 32, width // 2)
        assert shared.w1.weight.placements == shared.w3.weight.placements == (Shard(0),)
        assert shared.w2.weight.placements == (Shard(1),)
        assert not hasattr(moe.router.weight, "placements") and not hasattr(moe.coefficient.weight, "placements")
        assert isinstance(moe.expert_split, PartialReaders)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 1])
def test_biased_experts_split_b1_b3_with_their_rows_and_add_b2_on_one_rank(rank):
    """GPT-OSS's expert biases: b1 and b3 split with the rows of w1 and w3; b2 whole on every rank (a replicated
    DTensor), added by the first tensor rank only, so the sum over the ranks holds it once."""
    from torch.distributed.tensor.parallel import parallelize_module

    from internlm_offload.engine.expert_tensor_parallel import SplitMoE
    from internlm_offload.model.moe import MoE

    tp = _fake_world(rank)
    try:
        with torch.device("meta"):
            moe = MoE(16, 8, 4, 2, moe_type="Dropless", expert_bias=True, router_bias=True)
        parallelize_module(moe, tp, SplitMoE(sequence_sharded=False))
        experts = moe.experts
        assert experts.b1.placements == experts.b3.placements == (Shard(1),)
        assert tuple(experts.b1.to_local().shape) == (4, 4)
        assert experts.b2.placements == (Replicate(),) and tuple(experts.b2.to_local().shape) == (4, 16)
        assert experts.b2_share == (1.0 if rank == 0 else 0.0)
        assert not hasattr(moe.router.weight, "placements")
    finally:
        dist.destroy_process_group()


def test_a_width_the_tensor_size_does_not_divide_is_one_line():
    from torch.distributed.tensor.parallel import parallelize_module

    from internlm_offload.engine.expert_tensor_parallel import SplitMoE
    from internlm_offload.model.moe import MoE

    tp = _fake_world(rank=0)
    try:
        with torch.device("meta"):
            moe = MoE(16, 5, 4, 2, moe_type="Dropless")
        with pytest.raises(ConfigError, match=r"splits the routed experts' intermediate size \(5\) over the tensor"):
            parallelize_module(moe, tp, SplitMoE(sequence_sharded=True))
    finally:
        dist.destroy_process_group()


def test_the_planner_states_every_token_routed_through_a_rank_s_slices():
    """tools.plan's routing line with split experts: the tiny MoE's micro-batch of 512 tokens, top-2, is 1024 rows on
    each tensor rank (the whole sequence, not a chunk), through its half of every expert."""
    from internlm_offload.tools.plan import experts_assumption

    line = experts_assumption(resolved([*FSDP2, "parallel.tensor.mode=msp"], 2))
    assert "GShard: 1024 routed rows per sparse block per micro-batch through one grouped GEMM" in line
    assert "[assumed: one rank holds 1/2 of every expert's width (no_tp=False)" in line


def test_the_expert_groups_are_the_data_parallel_groups_of_one_tensor_rank():
    """Expert parallel over split experts at 4 ranks, tensor 2, expert 2: ("edp", "ep", "tp"), tensor innermost as in
    ("dp", "tp"), so rank 1's expert group is {1, 3} (its data-parallel group: both hold tensor rank 1's slice) and a
    stacked weight placed by expert parallel is whole over "tp" until the tensor plan cuts its slice."""
    from torch.distributed.tensor.parallel import parallelize_module

    from internlm_offload.engine.expert_parallel import apply_expert_parallel
    from internlm_offload.engine.expert_tensor_parallel import SplitMoE
    from internlm_offload.engine.runtime import expert_mesh, tensor_parallel_mesh
    from internlm_offload.model.moe import MoE

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh, experts = tensor_parallel_mesh("cpu", 4, 2), expert_mesh("cpu", 2, 2, tensor=2)
        assert experts.mesh_dim_names == ("edp", "ep", "tp")
        assert experts["ep"].mesh.tolist() == mesh["dp"].mesh.tolist() == [1, 3]
        assert experts["tp"].mesh.tolist() == mesh["tp"].mesh.tolist() == [0, 1]
        with torch.device("meta"):
            moe = MoE(16, 8, 4, 2, moe_type="Dropless", expert_bias=True)
        apply_expert_parallel(moe, experts)
        assert moe.experts.w1.placements == (Shard(0), Replicate())
        parallelize_module(moe, mesh["tp"], SplitMoE(sequence_sharded=False))
        assert moe.experts.w1.placements == (Shard(0), Shard(1)) and moe.experts.w2.placements == (Shard(0), Shard(2))
        assert tuple(moe.experts.w1.to_local().shape) == (2, 4, 16)
        assert moe.experts.b2.placements == (Shard(0), Replicate()) and moe.experts.b2_share == 0.0
    finally:
        dist.destroy_process_group()

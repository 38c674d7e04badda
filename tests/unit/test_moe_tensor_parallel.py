"""mtp/msp/fsp on a mixture of experts with InternEvo's `parallel.expert.no_tp=True` (engine/moe_tensor_parallel.py):
the config rules, the expert mesh carved from every rank, and the sparse block's plan. The 4-process run against one
process is tests/e2e/test_internevo_moe_e2e.py's qwen3 layout test."""

import pytest
import torch
import torch.distributed as dist
from test_expert_parallel import refused, resolved
from torch.testing._internal.distributed.fake_pg import FakeStore

FSDP2 = ["model.dtype=torch.float32", "parallel.mode=fsdp2", "parallel.tensor.size=2"]


@pytest.mark.parametrize("mode", ["mtp", "msp", "fsp"])
def test_no_tp_true_carves_experts_from_every_rank(mode):
    """no_tp=True: each tensor rank routes its own chunk, so the expert dims are carved from all 4 ranks (expert 2 x
    expert-data 2; -1 is min(world 4, experts 4)), as under isp. (no_tp=False: test_expert_tensor_parallel.py.)"""
    from internlm_offload.builder.run import aux_chunks
    from internlm_offload.config import expert_ranks

    layout = [*FSDP2, f"parallel.tensor.mode={mode}"]
    cfg = resolved([*layout, "parallel.expert.size=2", "parallel.expert.no_tp=True"], 4)
    assert (cfg.parallel.expert.size, expert_ranks(cfg, 4), aux_chunks(cfg)) == (2, 4, 2)
    cfg = resolved([*layout, "parallel.expert.size=-1", "parallel.expert.no_tp=True"], 4)
    assert cfg.parallel.expert.size == 4
    assert "-> 4: min(world ranks 4, model.num_experts 4)" in next(
        n for n in cfg.migration_notes()[0] if n.startswith("parallel.expert.size=-1")
    )
    # without expert parallel too: the experts whole on every rank of the tensor group
    assert resolved([*layout, "parallel.expert.no_tp=True"], 2).parallel.expert.size == 1
    # isp's chunks are weighted by the wrapper's mean over every rank: no 1/T on its aux loss
    isp = ["model.dtype=torch.float32", "parallel.mode=ddp", "parallel.tensor.size=2", "parallel.tensor.mode=isp"]
    assert aux_chunks(resolved(isp, 2)) == 1


def test_mtp_with_experts_needs_the_sequence_to_split():
    """mtp's sparse blocks route a chunk of the sequence each: data.seq_len must divide by the tensor size."""
    options = [*FSDP2, "parallel.tensor.mode=mtp", "parallel.expert.no_tp=True", "data.seq_len=63"]
    assert "parallel.tensor.size=2 (mode 'mtp') must divide data.seq_len=63" in refused(options, 2)


def test_the_expert_groups_are_the_tensor_groups_at_tensor_2_expert_2():
    """InternEvo's order with an expert tensor size of 1 (no_tp): expert ranks innermost over all ranks, so at 4
    ranks, tensor 2, expert 2, rank 1's expert group is its tensor group {0, 1} and its expert-data group {1, 3}
    (the rank of the other data-parallel replica holding the same experts)."""
    from internlm_offload.engine.runtime import RunContext, all_expert_data, expert_mesh, tensor_parallel_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh, experts = tensor_parallel_mesh("cpu", 4, 2), expert_mesh("cpu", 4, 2)
        assert mesh["tp"].mesh.tolist() == experts["ep"].mesh.tolist() == [0, 1]
        assert all_expert_data(experts).mesh.tolist() == [1, 3]
        ctx = RunContext(1, 1, 4, None, tensor_size=2, mesh=mesh, expert_mesh=experts)
        # expert gradients, summed over {1, 3}, are divided by the 2 data-parallel ranks (isp's: by all 4)
        assert ctx.expert_grad_divisor == 2
        assert RunContext(1, 1, 4, None, tensor_size=2, chunked_loss=True).expert_grad_divisor == 4
    finally:
        dist.destroy_process_group()


def test_a_sparse_block_keeps_its_moe_whole_and_replicated_over_the_tensor_group():
    """The plan of a sparse block under msp: attention column/row parallel, the MoE's weights replicated DTensors
    over "tp" (whole on every rank), seen as plain local tensors with Partial gradients during its forward only."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from internlm_offload.engine.moe_tensor_parallel import local_parameters
    from internlm_offload.engine.tensor_parallel import apply_tensor_parallel
    from internlm_offload.model.families.internlm2.model import InternLM2

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        from internlm_offload.engine.runtime import tensor_parallel_mesh

        tp = tensor_parallel_mesh("cpu", 2, 2)["tp"]
        with torch.device("meta"):
            model = InternLM2(
                num_layers=1, hidden_size=32, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=64,
                num_experts=4, top_k=2, num_shared_experts=1, multiple_of=16,
            )  # fmt: skip
        apply_tensor_parallel(model, tp, mode="msp", parallel_output=True)
        block = model.layers[0]
        assert block.attention.wq.weight.placements == (Shard(0),)
        moe = block.feed_forward
        names = {name for name, _ in moe.named_parameters()}
        assert {"router.weight", "experts.w1", "shared_experts.w1.weight", "coefficient.weight"} <= names
        assert all(
            p.placements == (Replicate(),) and tuple(p.shape) == tuple(p.to_local().shape) for p in moe.parameters()
        )
        slots = [(sub, name) for sub in moe.modules() for name, _ in sub.named_parameters(recurse=False)]
        with local_parameters(slots, tp):
            local = moe.router.weight
            assert not isinstance(local, DTensor) and local.requires_grad
            assert local.grad_fn is not None  # to_local: its gradient comes back as a Partial DTensor
        assert isinstance(moe.router.weight, torch.nn.Parameter) and moe.router.weight.placements == (Replicate(),)
    finally:
        dist.destroy_process_group()


def test_the_planner_states_a_rank_s_chunk_of_routed_rows():
    """tools.plan's routing line counts this rank's chunk where each tensor rank routes its own (isp, and msp with
    whole experts): the tiny MoE's micro-batch of 512 tokens, top-2, is 1024 rows on a rank of its own and 512 at
    tensor 2 (256 tokens each), GShard's capacity from the chunk's tokens."""
    from internlm_offload.tools.plan import experts_assumption

    one = experts_assumption(resolved(["model.dtype=torch.float32"], 1))
    assert one.startswith(
        "mixture of experts: 4 experts, top-2, GShard: 1024 routed rows per sparse block per micro-batch through"
    )
    layout = [*FSDP2, "parallel.tensor.mode=msp", "parallel.expert.no_tp=True", "parallel.expert.size=2"]
    line = experts_assumption(resolved(layout, 4))
    assert "GShard: 512 routed rows per sparse block per micro-batch (this rank's 1/2 of the sequence)" in line
    assert "capacity of 128 per expert" in line and "all 512 rows sent by all-to-all, 640 received" in line

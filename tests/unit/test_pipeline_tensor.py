"""Tensor modes within a pipeline stage: the ("pp", "dp", "tp") mesh and the config's rules (the curves:
tests/e2e/test_pipeline_e2e.py, P=2 x T=2 on 4 processes; the one-line refusals: tests/unit/test_pipeline.py)."""

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from internlm_offload.device import Accelerator
from internlm_offload.engine.runtime import RunContext, parallel_meshes, stage_data_mesh
from pipeline_configs import resolve


def test_the_pipeline_tensor_mesh_seen_from_rank_5():
    """8 ranks, P=2, T=2: one (2, 2, 2) mesh, pipeline outermost, tensor innermost (rank = pp * 4 + dp * 2 + tp).
    Rank 5 (pp 1, dp 0, tp 1) pairs with rank 1 over "pp" (the same dp and tp coordinate: a tensor rank sends its
    shard to the same tensor rank of the next stage), averages gradients with rank 7 over "dp", shards its tensors
    with rank 4 over "tp"; the tensor mesh is its stage's ("dp", "tp") sub-mesh; isp reduces over the stage's
    four ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        mesh, pipeline = parallel_meshes("cpu", 8, 2, 2)
        assert pipeline.mesh_dim_names == ("pp", "dp", "tp")
        assert pipeline.mesh.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
        groups = {name: pipeline[name].mesh.tolist() for name in ("pp", "dp", "tp")}
        assert groups == {"pp": [1, 5], "dp": [5, 7], "tp": [4, 5]}
        assert mesh.mesh_dim_names == ("dp", "tp") and mesh.mesh.tolist() == [[4, 5], [6, 7]]
        assert mesh["tp"].mesh.tolist() == [4, 5] and mesh["dp"].mesh.tolist() == [5, 7]
        ctx = RunContext(5, 5, 8, Accelerator("cpu"), tensor_size=2, mesh=mesh, pipeline_size=2, pipeline_mesh=pipeline)
        assert (ctx.dp_rank, ctx.dp_size) == (0, 2)
        assert stage_data_mesh(ctx).mesh.tolist() == [5, 7]
        assert stage_data_mesh(ctx, over_tensor=True).mesh.tolist() == [4, 5, 6, 7]
        # one of the two alone keeps its own 2-D mesh
        assert parallel_meshes("cpu", 8, 2, 1)[1] is None
        alone, pipe_alone = parallel_meshes("cpu", 8, 1, 2)
        assert alone is None and pipe_alone.mesh_dim_names == ("pp", "dp")
        assert pipe_alone["pp"].mesh.tolist() == [1, 5] and pipe_alone["dp"].mesh.tolist() == [4, 5, 6, 7]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("mode", "parallel_mode"), [("mtp", "none"), ("msp", "none"), ("fsp", "fsdp2"), ("isp", "ddp"), ("isp", "fsdp2")]
)
def test_every_tensor_mode_resolves_within_a_stage(mode, parallel_mode):
    """P=2 x T=2 on 4 ranks: one data-parallel rank per stage; 8 ranks: two, each stage FSDP2 (mtp/msp/fsp keep
    the rule that DDP takes no DTensors) or, under isp, DDP / FSDP2 over the stage's data-parallel and tensor ranks
    (`parallel.weight.size` 1 or all of them: 4 at 8 ranks)."""
    tensor = {"parallel.tensor.size": 2, "parallel.tensor.mode": mode, "parallel.mode": parallel_mode}
    cfg = resolve(4, tensor)
    assert (cfg.parallel.pipeline.size, cfg.parallel.tensor.size, cfg.data.micro_num) == (2, 2, 4)
    wide = {**tensor, "parallel.mode": "ddp" if mode == "isp" else "fsdp2"}
    assert resolve(8, wide).parallel.mode == wide["parallel.mode"]
    if mode == "isp" and parallel_mode == "fsdp2":
        assert resolve(8, {**wide, "parallel.mode": "fsdp2", "parallel.weight.size": 4}).parallel.weight.size == 4


def test_the_planner_traces_each_stage_of_a_pipeline_of_tensor_groups():
    """P=2 x T=2 (isp, DDP over each stage's two tensor ranks) on 4 ranks: each pipeline rank traced on its own
    stages with torch's micro-batches in flight (2 on the first, 1 on the last), each stage's activations per
    micro-batch about half of the same pipeline's without tensor parallel (a tensor rank's half of the sequence,
    received as such from the stage before). Red with receive buffers of the whole sequence (the last stage's
    logits then hold twice the labels' tokens: an error). `tools.plan --check-only --world-size 4` prints these rows for any mode
    (msp checked by hand against torchrun within 2.2 %: docs/parallelism.md)."""
    from internlm_offload.planner.trace import trace_step

    shape = {"data.seq_len": 64, "data.micro_bsz": 2, "data.micro_num": 4}
    alone = trace_step(resolve(2, shape), 2, count_work=False).stages
    isp = {"parallel.tensor.size": 2, "parallel.tensor.mode": "isp", "parallel.mode": "ddp"}
    staged = trace_step(resolve(4, {**shape, **isp}), 4, count_work=False).stages
    assert [s.in_flight for s in staged] == [2, 1]
    for with_tensor, without in zip(staged, alone, strict=True):
        assert 0.45 < with_tensor.activation_bytes / without.activation_bytes < 0.6, (with_tensor, without)
        assert with_tensor.device_peak_bytes < without.device_peak_bytes


def test_the_search_keeps_the_configured_tensor_mode_under_a_pipeline():
    """`tools.plan` with a budget searches every knob, the tensor mode among them where T > 1; under a pipeline the
    mode is not searched (as `parallel.tensor.mode="auto"` is refused there): its candidates are the configured
    mode's. Red with the pipeline's modes searched (the search chose isp under `parallel.mode='none'`, a layout
    the config refuses)."""
    from internlm_offload.planner.knobs import AUTO_KNOBS, tensor_mode_settings

    cfg = resolve(4, {"parallel.tensor.size": 2, "parallel.tensor.mode": "msp"})
    assert [(s.name, s.options) for s in tensor_mode_settings(cfg, AUTO_KNOBS)] == [("", {})]
    alone = resolve(2, {"parallel.tensor.size": 2, "parallel.pipeline.size": 1})
    assert [s.name for s in tensor_mode_settings(alone, AUTO_KNOBS)] == ["mtp", "msp", "fsp", "isp"]

"""The planner under expert parallel: rank 0's local experts, the all-to-all's buffers at the assumed imbalance
(`memory_budget.expert_imbalance`), its bytes priced as a collective; measured at 2 processes by
tests/e2e/test_planner_validation.py."""

from pathlib import Path

import pytest

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner.knobs import PARAMS_ON_HOST
from internlm_offload.planner.standins import assumed_split_sizes
from internlm_offload.planner.trace import UnsupportedLayout, trace_step

pytestmark = pytest.mark.usefixtures("shared_traces")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# 4 blocks, hidden 128, 4 experts top-2 of width 128: 2 x 64 tokens x 2 choices = 256 routed rows per micro-batch
MOE = {"data.seq_len": 64, "data.micro_bsz": 2, "data.micro_num": 1, "data.global_bsz": None,
       "model.num_experts": 4, "model.top_k": 2, "model.moe_type": "Dropless", "model.mlp_ratio": 1.0}  # fmt: skip


def moe(world_size: int = 2, **options):
    return resolve_config(load_config_file(CONFIGS / "internlm2_tiny.py", {**MOE, **options}), world_size=world_size)


def ep(size: int = 2, imbalance: float = 1.0, wrapper: str = "ddp", world_size: int = 2):
    options = {"parallel.mode": wrapper, "parallel.expert.size": size, "memory_budget.expert_imbalance": imbalance}
    return moe(world_size, **options)


def test_assumed_splits_send_every_row_and_make_rank_zero_the_busiest() -> None:
    """Sends spread over the experts, receives `imbalance` x the mean, capped at every rank's rows."""
    assert assumed_split_sizes(10, 4, 2, 1.0) == ([3, 3, 2, 2], [3, 3, 2, 2])
    assert assumed_split_sizes(10, 4, 2, 1.5) == ([3, 3, 2, 2], [4, 4, 4, 3])
    assert assumed_split_sizes(10, 4, 2, 8.0)[1] == [5, 5, 5, 5]  # all 2 x 10 rows, no more


def test_each_rank_holds_its_share_of_the_experts_and_ddp_leaves_them_out_of_its_buckets() -> None:
    """EP=2: the experts' bytes are half of one rank's (E/ep of them); DDP's buckets hold the rest only."""
    whole, split = trace_step(moe(1)), trace_step(ep(), 2)
    cfg = ep().model
    expert_bytes = 3 * cfg.num_experts * cfg.hidden_size * 128 * 4 * cfg.num_layers  # w1, w3, w2; width 128, fp32
    assert split.components["expert_params"] == expert_bytes // 2
    assert whole.components["model_params"] - split.components["model_params"] == expert_bytes // 2
    assert split.components["ddp_buckets"] == split.components["model_params"] - expert_bytes // 2


def test_the_busiest_rank_receives_the_assumed_rows_and_sends_them_at_the_collective_rate() -> None:
    """Imbalance 2 against 1: rank 0 receives 2N rows in place of N per sparse block, N = 256 routed rows; each
    of the block's four all-to-alls (dispatch, combine, their backwards) sends (n-1)/n of its input, N or f x N
    rows of H fp32: (1 + f) N H 4 bytes per block per micro-batch, priced by the cost model. The extra rows are
    kept for backward at least twice (as received, regrouped by expert), and computed by the local experts."""
    even, skewed = trace_step(ep(imbalance=1.0), 2), trace_step(ep(imbalance=2.0), 2)
    cfg, rows = ep().model, 256
    row_bytes = cfg.hidden_size * 4
    for f, memory in ((1, even), (2, skewed)):
        assert memory.micro_batch_work.collective_bytes == cfg.num_layers * (1 + f) * rows * row_bytes
    extra = skewed.components["activations"] - even.components["activations"]
    assert extra >= cfg.num_layers * 2 * rows * row_bytes, extra
    assert skewed.device_peak_bytes - even.device_peak_bytes >= cfg.num_layers * 2 * rows * row_bytes
    flops = skewed.micro_batch_work.flops - even.micro_batch_work.flops
    assert flops == 3 * 3 * 2 * rows * cfg.hidden_size * 128 * cfg.num_layers  # 3 matmuls, fwd + 2 bwd, 2 FLOP/MAC


def test_experts_are_fsdp2_shards_over_the_expert_data_ranks() -> None:
    """4 ranks, EP=2 x expert-data 2: each rank keeps half of its 2 experts' weights (a quarter of the whole)."""
    whole = trace_step(moe(1))
    sharded = trace_step(ep(wrapper="fsdp2", world_size=4), 4)
    cfg = ep().model
    expert_bytes = 3 * cfg.num_experts * cfg.hidden_size * 128 * 4 * cfg.num_layers
    assert sharded.components["expert_params"] == expert_bytes // 4
    assert whole.components["model_params"] > sharded.components["model_params"]


def test_expert_weight_parallel_shards_the_experts_over_its_groups_and_replicates_across_them() -> None:
    """8 ranks, 8 experts, EP=2 (4 experts per rank): with expert weight 2 the 4 expert-data ranks are 2 replicas of
    shard pairs (HSDP), so a rank keeps a quarter of the experts' weights (2 of its 4 experts); with 1, FSDP2 shards
    them over all 4 (an eighth)."""
    options = {"parallel.mode": "fsdp2", "parallel.expert.size": 2, "model.num_experts": 8}
    cfg = moe(8, **options).model
    expert_bytes = 3 * cfg.num_experts * cfg.hidden_size * 128 * 4 * cfg.num_layers
    for weight, share in ((2, 4), (1, 8)):
        traced = trace_step(moe(8, **options, **{"parallel.expert_weight.size": weight}), 8)
        assert traced.components["expert_params"] == expert_bytes // share, weight


def test_measuring_on_one_process_is_refused_in_one_line() -> None:
    with pytest.raises(UnsupportedLayout, match=r"^parallel.expert.size=2: .*torchrun") as info:
        trace_step(ep(), 2, measure=True)
    assert "\n" not in str(info.value)


def test_expert_size_auto_is_a_layout_the_search_chooses_within_the_budget() -> None:
    """`parallel.expert.size="auto"`: every size dividing the data-parallel ranks and the experts is a layout of its
    own, priced with its all-to-all. On a slow network (1 MB/s) EP=1 is the fastest, EP=2 next (it sends 1/2 of
    each all-to-all buffer, EP=4 3/4); at a device budget between EP=1's estimated peak and EP=2's the search
    takes EP=2."""
    import dataclasses

    from internlm_offload.planner.compose import Tracer
    from internlm_offload.planner.cost import HARDWARE
    from internlm_offload.planner.knobs import LAYOUT, MICRO_BATCH, OPTIMIZER, Space, settings_on
    from internlm_offload.planner.search import candidate_configs, search_tensor_modes

    options = {**MOE, "parallel.mode": "ddp", "parallel.expert.size": "auto", "memory_budget.device": "1GiB"}
    config_for = candidate_configs(load_config_file(CONFIGS / "internlm2_tiny.py", options), world_size=4)
    cfg = config_for({})
    assert cfg.parallel.expert.size == 1 and "parallel.expert.size" in cfg.auto_knobs
    space = Space(cfg, frozenset(cfg.auto_knobs), num_layers=cfg.model.num_layers, world_size=4)
    layouts = settings_on(LAYOUT, space)
    assert [s.name for s in layouts] == ["ep 1", "ep 2", "ep 4"]
    settings = settings_on(MICRO_BATCH, space), settings_on(OPTIMIZER, space)
    slow = dataclasses.replace(HARDWARE["h100"], collective_bytes_per_s=1e6)
    tracer = Tracer(4)  # both searches price the same traces
    _, candidates, _ = search_tensor_modes(config_for, layouts, *settings, slow, None, None, 4, tracer=tracer)
    by_size = {c.tensor_mode.options["parallel.expert.size"]: c for c in candidates}
    assert [size for size in sorted(by_size, key=lambda e: by_size[e].step_s)] == [1, 2, 4]
    assert by_size[1].estimated_device > by_size[2].estimated_device > by_size[4].estimated_device
    budget = (by_size[1].estimated_device + by_size[2].estimated_device) // 2
    chosen, candidates, refused = search_tensor_modes(
        config_for, layouts, *settings, slow, budget, None, 4, tracer=tracer
    )
    assert not refused and chosen is not None, [(c.name, c.verdict) for c in candidates]
    assert chosen.tensor_mode.options == {"parallel.expert.size": 2}, [(c.name, c.verdict) for c in candidates]
    assert chosen.memory.device_peak_bytes <= budget


def test_under_isp_the_expert_dims_are_carved_from_every_rank() -> None:
    """isp at tensor size 2 on 4 ranks: each rank routes its own sequence chunk, so EP=2 leaves 2 expert-data ranks
    (not 1): under FSDP2 a rank keeps a quarter of the experts' weights; "auto" searches sizes up to all 4 ranks."""
    from internlm_offload.planner.knobs import expert_size_settings

    options = {"parallel.mode": "fsdp2", "parallel.expert.size": 2, "parallel.tensor.mode": "isp"}
    cfg = moe(4, **options, **{"parallel.tensor.size": 2})
    expert_bytes = 3 * cfg.model.num_experts * cfg.model.hidden_size * 128 * 4 * cfg.model.num_layers
    assert trace_step(cfg, 4).components["expert_params"] == expert_bytes // 4
    auto = moe(
        4, **{**options, "parallel.expert.size": "auto", "memory_budget.device": "1GiB", "parallel.tensor.size": 2}
    )
    assert [s.name for s in expert_size_settings(auto, 4)] == ["ep 1", "ep 2", "ep 4"]


def test_expert_size_auto_searches_only_the_sizes_expert_weight_groups_can_take() -> None:
    """`parallel.expert_weight.size=2` beside `parallel.expert.size="auto"` on 8 ranks, 8 experts: the config
    resolves (the placeholder size 1 is not held against it) and the layouts are the sizes leaving expert-data ranks
    that 2 divides (EP 2: 4 left, EP 4: 2 left), not EP 1 (no experts to group) or EP 8 (1 left)."""
    from internlm_offload.planner.knobs import LAYOUT, Space, settings_on
    from internlm_offload.planner.search import candidate_configs

    options = {**MOE, "parallel.mode": "fsdp2", "parallel.expert.size": "auto", "parallel.expert_weight.size": 2}
    options.update({"model.num_experts": 8, "memory_budget.device": "1GiB"})
    config_for = candidate_configs(load_config_file(CONFIGS / "internlm2_tiny.py", options), world_size=8)
    cfg = config_for({})
    space = Space(cfg, frozenset(cfg.auto_knobs), num_layers=cfg.model.num_layers, world_size=8)
    layouts = settings_on(LAYOUT, space)
    assert [s.name for s in layouts] == ["ep 2", "ep 4"]
    for layout in layouts:  # each a config that resolves
        assert config_for(layout.options).parallel.expert_weight.size == 2


def test_fsdp2_cpu_offload_holds_the_expert_shards_on_the_host_and_is_offered_under_expert_parallel() -> None:
    """FSDP2's CPU offload policy takes the experts' FSDP2 units too: at EP=2 x expert-data 2 every parameter shard,
    the experts' included, is on the host (none on the device), and the optimizer axis offers the policy where the
    config has expert parallel or leaves its size "auto"."""
    from internlm_offload.planner.knobs import optimizer_settings

    options = {"parallel.mode": "fsdp2", "parallel.expert.size": 2}
    plain, offloaded = trace_step(moe(4, **options), 4), trace_step(moe(4, **options, **{PARAMS_ON_HOST: True}), 4)
    assert plain.components["model_params"] > plain.components["expert_params"] > 0
    assert offloaded.components["model_params"] == 0
    assert offloaded.components["host_params"] == plain.components["model_params"]
    for size in (2, "auto"):
        cfg = (
            ep(wrapper="fsdp2")
            if size == 2
            else moe(2, **{"parallel.mode": "fsdp2", "parallel.expert.size": "auto", "memory_budget.device": "1GiB"})
        )
        assert "params on host (FSDP2)" in [s.name for s in optimizer_settings(cfg)], size

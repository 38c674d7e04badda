"""The planner under a pipeline (planner/pipeline.py, planner/trace.py): micro-batches in flight and the bubble read
off torch's schedule order, each pipeline rank traced on meta tensors with its own stages."""

import re
from pathlib import Path

import pytest

from internlm_offload.config import ConfigError, load_config_file, resolve_config
from internlm_offload.planner.compose import Tracer
from internlm_offload.planner.cost import HARDWARE, StepWork, step_time
from internlm_offload.planner.knobs import (
    LAYOUT,
    MICRO_BATCH,
    OPTIMIZER,
    Setting,
    Space,
    activation_settings,
    activations_for,
    fewest_blocks,
    pipeline_settings,
    settings_on,
)
from internlm_offload.planner.pipeline import (
    StageMemory,
    bubble_fraction,
    pipeline_step_time,
    planned_step_time,
    rank_in_flight,
    schedule_order,
)
from internlm_offload.planner.search import candidate_configs, search_tensor_modes
from internlm_offload.planner.trace import trace_step

PP2 = Path(__file__).resolve().parents[2] / "configs" / "internlm2_tiny_pp2.py"
# the e2e check's shape (tests/e2e/test_pipeline_e2e.py): 4 micro-batches of 2 sequences of 256 per step
SHAPE = {"data.seq_len": 256, "data.micro_bsz": 2, "data.micro_num": 4}


def in_flight(mode: str, num_chunks: int, size: int, micro_num: int) -> list[int]:
    order = schedule_order(mode, num_chunks, size, micro_num)
    return [rank_in_flight(order, rank) for rank in range(size)]


def test_in_flight_micro_batches_are_read_off_torchs_schedule_order() -> None:
    """1F1B: stage s of P holds min(P - s, m); interleaved 1F1B over v chunks: (v - 1) m/rounds + 2 (P - 1 - r) + 1
    chunk-micro-batches (torch's warm-up plus one, docs' reference); ZBV the same on every rank. Red with the count
    off by one (started at 1)."""
    assert in_flight("1F1B", 1, 4, 8) == [4, 3, 2, 1]
    assert in_flight("1F1B", 1, 4, 4) == [4, 3, 2, 1]
    assert in_flight("1F1B", 2, 4, 8) == [(2 - 1) * 4 + 2 * (4 - 1 - r) + 1 for r in range(4)]
    assert in_flight("1F1B", 2, 2, 4) == [5, 3]
    zbv = in_flight("ZBV", 2, 4, 8)
    assert len(set(zbv)) == 1, zbv


@pytest.mark.parametrize("size, micro_num", [(2, 4), (4, 8), (4, 16)])
def test_the_bubble_is_the_schedules_theory(size: int, micro_num: int) -> None:
    """Simulated over torch's order, backward twice a forward: 1F1B idles (P - 1) / (m + P - 1) of the step,
    interleaved 1F1B over 2 chunks (P - 1) / (2 m + P - 1), ZBH1 a third of 1F1B's bubble time (Qi et al.'s ZB-H1
    with F = B = W). Red with a backward costed as a forward, and with torch's micro-batch ids taken as they are
    (torch's 1F1B numbers its last rank's forwards from 1: the simulation then waits on forwards never run)."""
    one_f_one_b = bubble_fraction(schedule_order("1F1B", 1, size, micro_num), micro_num)
    assert one_f_one_b == pytest.approx((size - 1) / (micro_num + size - 1), abs=1e-12)
    interleaved = bubble_fraction(schedule_order("1F1B", 2, size, micro_num), micro_num)
    assert interleaved == pytest.approx((size - 1) / (2 * micro_num + size - 1), abs=1e-12)
    zbh1 = bubble_fraction(schedule_order("ZBH1", 1, size, micro_num), micro_num)
    assert zbh1 / (1 - zbh1) == pytest.approx((size - 1) / (3 * micro_num), abs=1e-12)
    assert bubble_fraction(schedule_order("ZBV", 2, size, micro_num), micro_num) < zbh1


def stages(**options: object):
    cfg = resolve_config(load_config_file(PP2, {**SHAPE, **options}), world_size=2)
    return trace_step(cfg, 2, count_work=False)


def test_each_pipeline_rank_is_traced_with_its_micro_batches_in_flight() -> None:
    """The first stage holds 2 of the 4 micro-batches' activations at its peak, the last 1: each rank's peak lies
    between its at-rest bytes plus that many micro-batches' activations and one more; the reported peak is the
    worst rank's; pipeline-aware offload of one of each stage's 2 blocks lowers the first stage's peak by at least
    half a micro-batch's offloaded block. Red with the backward of each micro-batch right after its forward (one in
    flight on stage 0: its peak 11 MiB lower)."""
    base = stages()
    assert [s.in_flight for s in base.stages] == [2, 1]
    for stage in base.stages:
        traced = stage.device_peak_bytes - stage.in_flight * stage.activation_bytes
        assert 0 < traced < stage.activation_bytes, stage  # at rest plus the backward's transients
    assert base.device_peak_bytes == max(s.device_peak_bytes for s in base.stages) == base.stages[0].device_peak_bytes
    offloaded = stages(**{"cpu_offloading.enable": True, "cpu_offloading.num_layers": 1})
    saved = base.stages[0].device_peak_bytes - offloaded.stages[0].device_peak_bytes
    assert saved > base.stages[0].activation_bytes / 4, (saved, base.stages[0].activation_bytes)
    assert offloaded.as_dict()["stages"][0]["in_flight"] == 2


def test_the_step_time_prices_the_bubble() -> None:
    """Two equal stages under 1F1B over 4 micro-batches: the step is 4 micro-batches' time over 1 - 1/5 (the
    bubble's share (P - 1) / (m + P - 1)) plus the optimizer's; a last stage twice as slow sets the pace (its
    4 micro-batches plus the first stage's forward and backward of one ahead of and behind it). Red with the
    step priced as m micro-batches, as without a pipeline."""
    cfg = resolve_config(load_config_file(PP2, SHAPE), world_size=2)
    hw = HARDWARE["h100"]
    work = StepWork(flops=int(hw.flops_per_s))  # one second a micro-batch
    optimizer = StepWork(device_adamw_elements=10**9)
    optimizer_s = step_time(StepWork(), optimizer, 0, hw).optimizer_s
    equal = pipeline_step_time(cfg, [stage(work), stage(work)], optimizer, hw)
    assert equal.bubble_fraction == pytest.approx(1 / 5, abs=1e-9)
    assert equal.step_s == pytest.approx(4 / (1 - 1 / 5) + optimizer_s, rel=1e-9)
    slow_last = pipeline_step_time(cfg, [stage(work), stage(work.scaled(2))], optimizer, hw)
    assert slow_last.micro_batch_s == pytest.approx(2.0, rel=1e-6)
    assert slow_last.step_s == pytest.approx(4 * 2 + 1 + optimizer_s, rel=1e-6)


def stage(work: StepWork) -> StageMemory:
    return StageMemory(0, 0, 0, 0, 1, 0, work)


def test_plan_prints_each_pipeline_ranks_peak(capsys: pytest.CaptureFixture[str]) -> None:
    """tools.plan on a pipeline config: a line per pipeline rank with its micro-batches in flight and its device
    peak, and the step time's bubble (`--check-only`: the config as given). Red without the table."""
    from internlm_offload.tools.plan import main

    options = [f"{key}={value}" for key, value in SHAPE.items()]
    argv = ["--config", str(PP2), "--world-size", "2", "--device-memory", "1GiB", "--check-only", "--cfg-options"]
    assert main([*argv, *options]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:1] in "01" and len(line.split()) == 4]
    assert [(row[0], row[1]) for row in rows] == [("0", "2"), ("1", "1")], out
    assert float(rows[0][3]) > float(rows[1][3])
    assert "of it the pipeline's bubble" in out


def test_zero_bubble_keeps_what_its_input_pass_saves_for_the_weight_pass() -> None:
    """ZBH1 at P = 2: the last stage runs torch's input pass (I) of a micro-batch before its weight pass (W), with
    two micro-batches between I and W at its peak; what I keeps for W (the intermediates' gradients) more than
    doubles the last stage's 1F1B peak (45.7 against 20.9 MiB; measured on torchrun 46.3, docs/planner.md). Red
    with the I/W pair run as one whole backward at W (32.3 MiB: -30 % against the measured run)."""
    one_f_one_b, zbh1 = stages(), stages(**{"parallel.pipeline.mode": "ZBH1"})
    assert [s.in_flight for s in zbh1.stages] == [2, 2]
    assert zbh1.stages[1].device_peak_bytes > 2 * one_f_one_b.stages[1].device_peak_bytes, zbh1.stages


def test_the_pipeline_is_a_layout_of_the_search() -> None:
    """`parallel.pipeline.size="auto"` (`.mode`, `model.num_chunks` likewise): each size dividing the world size, each
    schedule with the chunks it runs, one layout each; activation offload counts the rank's own blocks."""
    budget = {"memory_budget.device": "1GiB", "parallel.mode": "ddp"}
    auto = {"parallel.pipeline.size": "auto", "parallel.pipeline.mode": "auto", "model.num_chunks": "auto"}
    cfg = resolve_config(load_config_file(PP2, {**SHAPE, **budget, **auto}), world_size=2)
    names = [s.name for s in pipeline_settings(cfg, 2)]
    assert names == ["no pipeline", "pp 2 1F1B", "pp 2 1F1B x 2 chunks", "pp 2 ZBH1", "pp 2 ZBV"]
    fixed = resolve_config(load_config_file(PP2, SHAPE), world_size=2)
    assert pipeline_settings(fixed, 2) == [Setting("", {})]  # only the config's own "auto" searches it
    assert fewest_blocks(fixed) == 2 and fewest_blocks(resolve_config(load_config_file(PP2, {
        **SHAPE, "model.num_layers": 5}), world_size=2)) == 2  # fmt: skip
    # a fixed offload count counts each rank's own blocks: layouts leaving a rank that many or fewer are not offered
    offload = {"cpu_offloading.enable": True, "cpu_offloading.num_layers": 1}
    fixed_offload = resolve_config(load_config_file(PP2, {**SHAPE, **budget, **auto, **offload}), world_size=4)
    # 4 blocks: 2 a rank at 2 ranks (two chunks of 1 too); at 4 ranks 1, unless 2 chunks, which no split holds (the
    # search's refusal line says so)
    assert [s.name for s in pipeline_settings(fixed_offload, 4)] == [
        "no pipeline", "pp 2 1F1B", "pp 2 1F1B x 2 chunks", "pp 2 ZBH1", "pp 2 ZBV", "pp 4 1F1B x 2 chunks", "pp 4 ZBV",
    ]  # fmt: skip
    # and the search offers no offload of a rank's only block (the last is never offloaded)
    assert [s.name for s in activation_settings(1, {"cpu_offloading.num_layers"})] == ["no recompute"]
    # a pipeline is traced whole: its figures are exact with the swap optimizer too (no composition's margin)
    assert Tracer(2).exact(resolve_config(load_config_file(PP2, {**SHAPE, "swap_optimizer": True}), world_size=2))


def test_the_search_chooses_a_pipeline_where_one_rank_cannot_hold_the_model() -> None:
    """At a device budget below the leanest setting without a pipeline, the search's choice is the 2-stage pipeline,
    traced whole (every rank within the budget) and priced with its bubble from each rank's work."""
    options = {**SHAPE, "data.seq_len": 32, "parallel.mode": "ddp", "parallel.pipeline.size": "auto",
               "model.checkpoint": 1.0, "memory_budget.device": "1GiB"}  # fmt: skip
    raw = load_config_file(PP2, options)
    config_for, tracer = candidate_configs(raw, world_size=2), Tracer(2)
    space = Space(config_for({}), frozenset(config_for({}).auto_knobs), num_layers=4, world_size=2)
    leanest = tracer.whole(config_for({"parallel.pipeline.size": 1}), count_work=True)
    budget = leanest.device_peak_bytes - 1
    chosen, candidates, refused = search_tensor_modes(
        config_for, settings_on(LAYOUT, space), settings_on(MICRO_BATCH, space), settings_on(OPTIMIZER, space),
        HARDWARE["h100"], budget, None, 2, tracer=tracer, activations_for=activations_for(space),
    )  # fmt: skip
    assert refused == [] and {c.tensor_mode.name for c in candidates} == {"no pipeline", "pp 2 1F1B"}
    assert chosen is not None and chosen.tensor_mode.name == "pp 2 1F1B", [(c.name, c.verdict) for c in candidates]
    assert max(s.device_peak_bytes for s in chosen.memory.stages) <= budget
    timing = planned_step_time(
        config_for(chosen.options), chosen.memory.stages, StepWork(), StepWork(), HARDWARE["h100"]
    )
    assert timing.bubble_fraction > 0
    assert chosen.step_s == pytest.approx(
        timing.step_s + step_time(StepWork(), chosen.memory.optimizer_work, 0, HARDWARE["h100"]).optimizer_s, rel=1e-9
    )


def test_ddp_buckets_are_counted_only_where_the_builder_wraps_ddp() -> None:
    """DDP's buckets (a second copy of the gradients) are counted where the builder wraps the model in DDP: fp32
    stages over 2 data-parallel ranks; not stages with fp32 masters (they reduce the gradients themselves,
    builder/pipeline.py), nor gradient offload without a pipeline (builder/model.py). Red with the buckets counted
    whenever parallel.mode is 'ddp' (the 70B pipeline at P = 8 read 17.9 GiB too high a rank)."""
    small = {**SHAPE, "data.seq_len": 32, "parallel.mode": "ddp"}

    def buckets(config, world_size, **options):
        cfg = resolve_config(load_config_file(config, {**small, **options}), world_size=world_size)
        return trace_step(cfg, world_size, count_work=False).components.get("ddp_buckets", 0)

    assert buckets(PP2, 4) > 0
    assert buckets(PP2, 4, **{"model.dtype": "torch.bfloat16"}) == 0
    tiny = PP2.parent / "internlm2_tiny.py"
    assert buckets(tiny, 2, swap_optimizer=True) > 0
    assert buckets(tiny, 2, swap_optimizer=True, grad_offload=True) == 0


def test_offload_per_pipeline_rank_is_the_fewest_blocks_each_rank_fits_with() -> None:
    """`cpu_offloading.num_layers` left "auto" under 2-stage 1F1B: the search's uniform count (1 of each rank's 2
    blocks) lowered per rank to the fewest offered blocks whose traced peak fits, so the last stage, with one
    micro-batch in flight, offloads none: its traced peak is that of no offload, the first stage's that of the
    uniform count, the choice's device peak within the budget (planner/stage_offload.py)."""
    options = {**SHAPE, "data.seq_len": 64, "cpu_offloading.enable": "auto", "cpu_offloading.num_layers": "auto",
               "memory_budget.device": "1GiB"}  # fmt: skip
    config_for, tracer = candidate_configs(load_config_file(PP2, options), world_size=2), Tracer(2)
    space = Space(config_for({}), frozenset(config_for({}).auto_knobs), num_layers=4, world_size=2)
    uniform = {n: tracer.whole(config_for({"cpu_offloading.enable": n > 0, "cpu_offloading.num_layers": n}), True)
               for n in (0, 1)}  # fmt: skip
    peaks = {n: [s.device_peak_bytes for s in memory.stages] for n, memory in uniform.items()}
    budget = peaks[0][0] - 1  # rank 0 needs the offload, rank 1 not
    assert peaks[1][0] <= budget and peaks[0][1] <= budget, peaks
    chosen, candidates, _ = search_tensor_modes(
        config_for, settings_on(LAYOUT, space), settings_on(MICRO_BATCH, space), settings_on(OPTIMIZER, space),
        HARDWARE["h100"], budget, None, 2, tracer=tracer, activations_for=activations_for(space),
    )  # fmt: skip
    assert chosen is not None and chosen.options["cpu_offloading.num_layers"] == [1, 0], chosen.name
    assert chosen.name == "offload 1/0 blocks per pipeline rank + optimizer as configured"
    assert [s.device_peak_bytes for s in chosen.memory.stages] == [peaks[1][0], peaks[0][1]]
    assert chosen.memory.device_peak_bytes <= budget
    uniform_choice = next(c for c in candidates if c.activation.name == "offload 1 blocks")
    assert uniform_choice.verdict == "fits; offload 1/0 blocks per pipeline rank offloads less"
    assert tracer.traces == 3  # the search reads the two uniform traces above, and traces the choice


def test_without_a_pipeline_the_offload_choice_stays_one_count() -> None:
    """One rank: the search's offload choice is taken as it is (a crash once: the per-rank pass made an empty list)."""
    options = {**SHAPE, "data.seq_len": 64, "parallel.pipeline.size": 1, "cpu_offloading.enable": "auto",
               "cpu_offloading.num_layers": "auto", "memory_budget.device": "1GiB"}  # fmt: skip
    config_for, tracer = candidate_configs(load_config_file(PP2, options), world_size=1), Tracer(1)
    space = Space(config_for({}), frozenset(config_for({}).auto_knobs), num_layers=4, world_size=1)
    plain = tracer.whole(config_for({"cpu_offloading.enable": False, "cpu_offloading.num_layers": 0}), True)
    chosen, _, _ = search_tensor_modes(
        config_for, settings_on(LAYOUT, space), settings_on(MICRO_BATCH, space), settings_on(OPTIMIZER, space),
        HARDWARE["h100"], plain.device_peak_bytes - 1, None, 1, tracer=tracer, activations_for=activations_for(space),
    )  # fmt: skip
    assert chosen is not None and isinstance(chosen.options["cpu_offloading.num_layers"], int), chosen
    assert chosen.options["cpu_offloading.num_layers"] > 0


@pytest.mark.parametrize(
    "num_layers, pipeline, error",
    [
        (
            [1, 0],
            1,
            "cpu_offloading.num_layers=[1, 0] has 2 entries: a list gives each pipeline rank its count, and "
            "parallel.pipeline.size=1; give 1 entries (one count without a pipeline: an int)",
        ),
        ([1, 0, 0], 2, "cpu_offloading.num_layers=[1, 0, 0] has 3 entries"),
        ([1, -1], 2, "cpu_offloading.num_layers=[1, -1]: give a block count >= 0, or one per pipeline rank"),
        ([4, 0], 2, "cpu_offloading.num_layers=[4, 0] must be < model.num_layers=4"),
    ],
)
def test_offload_counts_per_rank_are_checked(num_layers: list[int], pipeline: int, error: str) -> None:
    options = {"cpu_offloading.enable": True, "cpu_offloading.num_layers": num_layers,
               "parallel.pipeline.size": pipeline}  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(error)):
        resolve_config(load_config_file(PP2, options), world_size=2)

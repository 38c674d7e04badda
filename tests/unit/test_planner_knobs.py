"""The planner's search space as a list of knobs (`planner/knobs.py`): the axes it builds, and a knob added
as one entry that the search takes without any change to its loop."""

from pathlib import Path

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner.cost import HARDWARE
from internlm_offload.planner.knobs import (
    KNOBS,
    LAYOUT,
    MICRO_BATCH,
    OPTIMIZER,
    Knob,
    Setting,
    Space,
    activation_settings,
    batch_settings,
    settings_on,
)
from internlm_offload.planner.search import candidate_configs, search

TINY = Path(__file__).resolve().parents[2] / "configs" / "internlm2_tiny.py"
FAST = {"data.seq_len": 32, "data.micro_bsz": 4, "data.micro_num": 2}


def tiny(**overrides):
    raw = load_config_file(TINY, {**FAST, **overrides})
    return raw, resolve_config(raw)


def test_micro_batch_axis_is_every_activation_setting_at_every_shape_configured_shape_first():
    _, cfg = tiny()
    space = Space(cfg, num_layers=4, shapes=True)
    settings = settings_on(MICRO_BATCH, space)
    activations, shapes = activation_settings(4), batch_settings(cfg)
    assert [s.name for s in shapes] == ["micro_bsz 4 x 2", "micro_bsz 2 x 4", "micro_bsz 1 x 8"]
    assert len(settings) == len(activations) * len(shapes)
    assert [s.name for s in settings[: len(activations)]] == [a.name for a in activations]
    assert settings[len(activations)].name == f"{activations[0].name}, micro_bsz 2 x 4"
    assert settings[-1].options == {**activations[-1].options, **shapes[-1].options}
    # without shapes (a config's "auto" knobs at start-up) the axis is the activation settings alone
    assert settings_on(MICRO_BATCH, Space(cfg, num_layers=4)) == activations


def test_optimizer_axis_adds_gradient_offload_where_it_applies_and_layout_is_one_setting_on_one_rank():
    _, cfg = tiny()
    names = [s.name for s in settings_on(OPTIMIZER, Space(cfg))]
    assert names == ["AdamW", "hybrid 0.5", "hybrid 1.0", "swap", "hybrid 1.0 + grad offload", "swap + grad offload"]
    assert settings_on(LAYOUT, Space(cfg)) == [Setting("", {})]
    # the knobs a config fixes stay fixed: only swap is left to the planner here
    assert [s.name for s in settings_on(OPTIMIZER, Space(cfg, frozenset({"swap_optimizer"})))] == ["AdamW", "swap"]


def _swap_chunks(settings: list[Setting], space: Space) -> list[Setting]:
    """A knob for the test: the swap optimizer's chunk count, for the settings that swap."""
    out = list(settings)
    for s in settings:
        if s.options.get("swap_optimizer"):
            out.append(Setting(f"{s.name} in 1 chunk", {**s.options, "swap_optimizer_times": 1}))
    return out


def test_a_knob_added_to_the_list_is_searched_without_touching_the_search():
    raw, cfg = tiny()
    knobs = (*KNOBS, Knob("swap chunks", OPTIMIZER, _swap_chunks))
    space = Space(cfg, frozenset({"swap_optimizer"}), num_layers=4)
    optimizers = settings_on(OPTIMIZER, space, knobs)
    assert [o.name for o in optimizers] == ["AdamW", "swap", "swap in 1 chunk"]
    activations = settings_on(MICRO_BATCH, space, knobs)
    chosen, candidates = search(candidate_configs(raw), activations, optimizers, HARDWARE["h100"], None, None)
    assert {c.optimizer.name for c in candidates} == {"AdamW", "swap", "swap in 1 chunk"}
    # AdamW keeps no copies: the fastest, so the choice; the new knob's candidates were priced like any other
    assert chosen is not None and chosen.optimizer.name == "AdamW"
    one_chunk = next(c for c in candidates if c.optimizer.name == "swap in 1 chunk")
    assert one_chunk.step_s > chosen.step_s and one_chunk.options["swap_optimizer_times"] == 1


def test_the_wrapper_left_auto_is_searched_on_several_ranks_and_every_rank_takes_rank_zeros_choice(monkeypatch):
    """`parallel.mode="auto"` on 2 ranks resolves (DDP holds the place until the planner chose: 'none' cannot hold 2
    data-parallel ranks), DDP and FSDP2 are layouts of the search (none and FSDP2 on one rank), FSDP2's CPU offload
    policy an optimizer setting that names no wrapper (FSDP2's layout alone takes it). At a budget between FSDP2's
    peak and DDP's the search train.py runs (`search_space`, planner/auto.py) chooses FSDP2, and under torchrun a rank
    whose own choice was DDP takes rank 0's."""
    from types import SimpleNamespace

    from internlm_offload import launch
    from internlm_offload.engine import runtime
    from internlm_offload.planner.compose import Tracer
    from internlm_offload.planner.search import search_space

    options = {"parallel.mode": "auto", "memory_budget.device": "1GiB", "model.num_layers": 2}  # 2 blocks: CI time
    raw = load_config_file(TINY, {**FAST, **options})
    assert resolve_config(raw).parallel.mode == "none"
    config_for = candidate_configs(raw, world_size=2)
    cfg = config_for({})
    assert cfg.parallel.mode == "ddp" and "parallel.mode" in cfg.auto_knobs
    space = Space(cfg, frozenset(cfg.auto_knobs), num_layers=2, world_size=2)
    assert [s.options for s in settings_on(LAYOUT, space)] == [{"parallel.mode": "ddp"}, {"parallel.mode": "fsdp2"}]
    one_rank = Space(resolve_config(raw), frozenset(cfg.auto_knobs), num_layers=2)
    assert [s.name for s in settings_on(LAYOUT, one_rank)] == ["none", "fsdp2"]
    every_knob = Space(cfg, num_layers=2, world_size=2)  # tools.plan's
    hosted = [s.options for s in settings_on(OPTIMIZER, every_knob) if s.name == "params on host (FSDP2)"]
    assert hosted and hosted[0]["parallel.fsdp_cpu_offload"] and "parallel.mode" not in hosted[0]
    tracer, row = Tracer(2), HARDWARE["h100"]
    _, priced, _ = search_space(config_for, space, row, None, None, tracer=tracer)
    peaks = {c.tensor_mode.name: c.estimated_device for c in priced}
    assert peaks["ddp"] > peaks["fsdp2"], peaks
    chosen, tried, _ = search_space(config_for, space, row, sum(peaks.values()) // 2, None, tracer=tracer)
    assert chosen is not None and chosen.options == {"parallel.mode": "fsdp2"}, [(c.name, c.verdict) for c in tried]
    monkeypatch.setattr(runtime, "all_gather_object", lambda ctx, obj: [chosen.options, obj])
    mine = launch.agree_on_auto_knobs(cfg, raw, SimpleNamespace(world_size=2), {"parallel.mode": "ddp"})
    assert mine.parallel.mode == "fsdp2"

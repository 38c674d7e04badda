"""Unit tests for the per-layer plan (InternEvo's offload / checkpoint / plain rule)."""

import re

import pytest

from internlm_offload.config import resolve_config
from internlm_offload.offload import LayerMode, LayerPlan, make_layer_plan

CODES = {"O": LayerMode.OFFLOAD, "C": LayerMode.CHECKPOINT, "S": LayerMode.SELECTIVE}
CODES |= {"X": LayerMode.SELECTIVE_OFFLOAD, "P": LayerMode.PLAIN}

# (num_layers, offload_layers, checkpoint_ratio, selective, selective_offload, expected modes, one letter a block)
RULES = {
    "L4 r0.5 offload1": (4, 1, 0.5, False, False, "OCPP"),
    "L8 r1.0 offload3": (8, 3, 1.0, False, False, "OOOCCCCC"),
    "L4 r0": (4, 0, 0.0, False, False, "PPPP"),
    "L4 r0 offload2": (4, 2, 0.0, False, False, "OOPP"),
    "L4 r1.0": (4, 0, 1.0, False, False, "CCCC"),
    "L5 r0.5 floors": (5, 0, 0.5, False, False, "CCPPP"),
    "L6 r0.5 offload covers checkpoint": (6, 3, 0.5, False, False, "OOOPPP"),
    "L1 r1.0": (1, 0, 1.0, False, False, "C"),
    "L4 r0.75 selective": (4, 0, 0.75, True, False, "SSSP"),
    "L4 r1.0 offload1 selective": (4, 1, 1.0, True, False, "OSSS"),
    "L4 r1.0 offload1 selective+offload": (4, 1, 1.0, True, True, "OXXX"),
    "L4 r0 selective+offload": (4, 0, 0.0, True, True, "PPPP"),
}


@pytest.mark.parametrize("num_layers, offload, ratio, selective, sel_offload, expected", RULES.values(), ids=RULES)
def test_internevo_rule(
    num_layers: int, offload: int, ratio: float, selective: bool, sel_offload: bool, expected: str
) -> None:
    plan = make_layer_plan(
        num_layers, offload_layers=offload, checkpoint_ratio=ratio, selective=selective, selective_offload=sel_offload
    )
    assert plan.modes == tuple(CODES[c] for c in expected)


def test_defaults_leave_every_block_plain() -> None:
    assert make_layer_plan(3).modes == (LayerMode.PLAIN,) * 3


def test_layers_with() -> None:
    plan = make_layer_plan(8, offload_layers=2, checkpoint_ratio=0.75)
    assert plan.layers_with(LayerMode.OFFLOAD) == [0, 1]
    assert plan.layers_with(LayerMode.CHECKPOINT) == [2, 3, 4, 5]
    assert plan.layers_with(LayerMode.PLAIN) == [6, 7]
    assert plan.layers_with(LayerMode.OFFLOAD, LayerMode.PLAIN) == [0, 1, 6, 7]
    assert plan.layers_with(LayerMode.SELECTIVE) == []


@pytest.mark.parametrize("num_layers, ratio", [(4, 0.5), (5, 0.5), (7, 0.3), (8, 1.0), (3, 0.0), (6, 0.99)])
def test_checkpoint_count_matches_config(num_layers: int, ratio: float) -> None:
    cfg = resolve_config({"model": dict(num_layers=num_layers, checkpoint=ratio)})
    plan = make_layer_plan(num_layers, checkpoint_ratio=ratio)
    assert len(plan.layers_with(LayerMode.CHECKPOINT)) == cfg.checkpointed_layers()


ERRORS = {
    "negative offload": (dict(offload_layers=-1), r"cpu_offloading\.num_layers=-1 must be in \[0, 4\)"),
    "offload every block": (dict(offload_layers=4), r"cpu_offloading\.num_layers=4 must be in \[0, 4\)"),
    "offload more than all": (dict(offload_layers=9), r"cpu_offloading\.num_layers=9"),
    "ratio above 1": (dict(checkpoint_ratio=1.1), r"model\.checkpoint=1\.1 must be in \[0, 1\]"),
    "ratio below 0": (dict(checkpoint_ratio=-0.1), r"model\.checkpoint=-0\.1 must be in \[0, 1\]"),
    "selective offload alone": (dict(selective_offload=True), r"selective_checkpoint_offload=True needs selective_"),
}


@pytest.mark.parametrize("kwargs, pattern", ERRORS.values(), ids=ERRORS)
def test_value_errors_name_the_key(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        make_layer_plan(4, **kwargs)


def test_table_lists_every_layer() -> None:
    plan = make_layer_plan(6, offload_layers=1, checkpoint_ratio=0.5, selective=True, selective_offload=True)
    lines = plan.table().splitlines()
    assert lines[0].split() == ["layer", "mode"]
    rows = [re.fullmatch(r"\s*layer\s+(\d+)\s+(\S+)", line) for line in lines[1:]]
    assert all(rows), lines
    assert [(int(m.group(1)), m.group(2)) for m in rows] == [
        (0, "offload"),
        (1, "selective+offload"),
        (2, "selective+offload"),
        (3, "plain"),
        (4, "plain"),
        (5, "plain"),
    ]


def test_plan_is_immutable() -> None:
    plan = LayerPlan((LayerMode.PLAIN,))
    with pytest.raises(AttributeError):
        plan.modes = ()  # type: ignore[misc]

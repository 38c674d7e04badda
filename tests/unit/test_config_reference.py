"""Unit tests for the config reference generator; fails when docs/config_reference.md is stale."""

from pathlib import Path
from typing import Iterator, Literal, Optional

import pytest
from pydantic import BaseModel

from internlm_offload.config import RunConfig
from internlm_offload.tools.config_reference import DOC_PATH, PROG, main, render, type_name

OFFLOAD_KEYS = (
    "cpu_offloading",
    "selective_checkpoint",
    "selective_checkpoint_offload",
    "swap_optimizer",
    "swap_optimizer_times",
    "use_pinned_optimizer_offload",
    "hybrid_optimizer",
)


def schema_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every leaf key of the schema, dotted."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from schema_keys(field.annotation, f"{prefix}{name}.")
            continue
        yield prefix + name
        optional = [arg for arg in getattr(field.annotation, "__args__", ()) if arg is not type(None)]
        if len(optional) == 1 and isinstance(optional[0], type) and issubclass(optional[0], BaseModel):
            yield from schema_keys(optional[0], f"{prefix}{name}.")  # an optional section: its row and its keys


def test_doc_is_up_to_date(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--check"])
    assert code == 0, f"{DOC_PATH} is stale: run `{PROG}` and commit the result\n{capsys.readouterr().err}"


def test_render_is_deterministic() -> None:
    assert render() == render()
    assert render().endswith("\n") and not render().endswith("\n\n")


def test_every_schema_key_has_a_row() -> None:
    rows = [line for line in render().splitlines() if line.startswith("| `")]
    keys = [row.split("`")[1] for row in rows]
    assert sorted(keys) == sorted(schema_keys(RunConfig))  # each key once, none missing
    assert all(row.count(" | ") == 3 for row in rows)  # four cells: no unescaped pipe inside a cell


def test_row_content() -> None:
    text = render()
    assert "| `model.checkpoint` | float, >= 0.0, <= 1.0 | `0.0` | Activation checkpointing:" in text
    assert "| `parallel.mode` | one of `'none'`, `'ddp'`, `'fsdp2'` | `'none'` |" in text
    assert "| `data.global_bsz` | int or None, >= 1 | `None` |" in text


def test_intro_covers_syntax_and_the_offload_keys() -> None:
    intro = render().split("## Top-level keys")[0]
    for phrase in ("literals only", "`_base_`", "`--cfg-options", "UPPER_CASE", "each pipeline rank's own blocks"):
        assert phrase in intro
    for key in OFFLOAD_KEYS:
        assert f"`{key}" in intro


@pytest.mark.parametrize(
    "annotation, expected",
    [
        (int, "int"),
        (Optional[int], "int or None"),
        (int | None, "int or None"),
        (list[str], "list[str]"),
        (Literal["a", "b"], "one of `'a'`, `'b'`"),
    ],
)
def test_type_name(annotation: object, expected: str) -> None:
    assert type_name(annotation) == expected


def test_check_detects_stale_and_missing(tmp_path: Path) -> None:
    doc = tmp_path / "reference.md"
    assert main(["--check", "--output", str(doc)]) == 1  # missing
    assert not doc.exists()  # --check writes nothing
    assert main(["--output", str(doc)]) == 0
    assert doc.read_text() == render()
    assert main(["--check", "--output", str(doc)]) == 0
    doc.write_text(render().replace("Peak learning rate.", "Peak LR."))
    assert main(["--check", "--output", str(doc)]) == 1
    assert "Peak LR." in doc.read_text()

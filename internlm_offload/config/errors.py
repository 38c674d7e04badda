"""Config problems as the user reads them: one line each, naming the key, the bad value and what is allowed."""

import difflib
from typing import Any

from pydantic import BaseModel


def report_problems(problems: list[str]) -> str:
    """One problem: one line. Several: a count, then one indented line each."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in problems)


def validation_problem(err: dict[str, Any], schema: type[BaseModel]) -> str:
    """One of pydantic's validation errors against `schema` as one line (an unknown key gets a suggestion)."""
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = sorted(schema_at(schema, loc[:-1]).model_fields)
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"; did you mean {'.'.join(loc[:-1] + close)!r}?" if close else f"; allowed keys: {', '.join(allowed)}"
        return f"unknown config key {key!r}{hint}"
    if kind == "value_error":
        return str(err["ctx"]["error"])
    message = err["msg"][0].lower() + err["msg"][1:]
    return f"{key or 'config'}={err['input']!r}: {message}"


def schema_at(schema: type[BaseModel], path: list[str]) -> type[BaseModel]:
    """The section model at `path` (e.g. ["cpu_offloading"]) below `schema`."""
    for name in path:
        schema = section_type(schema.model_fields[name].annotation)  # type: ignore[assignment]
    return schema


def section_type(annotation: Any) -> Any:
    """The section model of a field's annotation, an optional one (`model.lora`) included; else the annotation."""
    args = [arg for arg in getattr(annotation, "__args__", ()) if arg is not type(None)]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return annotation

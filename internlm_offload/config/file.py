"""Config files: parse a Python config file with mmengine (`_base_` merged), apply `--cfg-options`.

The result is a plain dict of the file's keys; the schema (`config.py`, `resolve_config`) checks and
completes it. Config files hold literals only: imports are refused before mmengine sees the file.
"""

import argparse
import ast
import copy
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config file or override is invalid; the message is one line meant for the user."""


def load_config_file(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse a config file with mmengine (`_base_` merged) and apply `--cfg-options` overrides."""
    from mmengine.config import Config  # deferred: importing mmengine costs ~0.1 s

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: file not found: {path}")
    if path.suffix != ".py":
        raise ConfigError(f"--config: {path} is not a Python config file (.py)")
    _reject_imports(path)
    try:
        cfg = Config.fromfile(str(path))
    except Exception as exc:  # mmengine raises many types; all mean "this file does not parse"
        raise ConfigError(f"--config {path}: cannot parse: {_one_line(exc)}") from exc
    if overrides:
        _merge(cfg, overrides)
    return _without_delete_markers(cfg.to_dict())


def _without_delete_markers(value: Any) -> Any:
    """`_delete_=True` replaces a base's dict; mmengine keeps the marker where the bases hold no such dict, and it
    means nothing there: drop it (a section written for a base that sets it, e.g. `parallel`, loads either way)."""
    if isinstance(value, dict):
        return {key: _without_delete_markers(item) for key, item in value.items() if key != "_delete_"}
    if isinstance(value, list):
        return [_without_delete_markers(item) for item in value]
    return value


def merge_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A loaded config (`load_config_file`) with more `--cfg-options` merged in, as a new dict: the same
    result as loading the file with both sets of overrides, without reading it again."""
    from mmengine.config import Config

    cfg = Config(copy.deepcopy(raw))  # the caller's dict stays as it was: every candidate starts from it
    if overrides:
        _merge(cfg, overrides)
    return cfg.to_dict()


def add_cfg_options(parser: argparse.ArgumentParser, help: str) -> None:
    """`--cfg-options key=value ...` on `parser`, parsed by mmengine's `DictAction`. An item it cannot parse
    (no `=`, unbalanced brackets: mmengine asserts) raises `ConfigError` naming it, out of `parse_args`."""
    from mmengine.config import DictAction  # deferred, as in load_config_file

    class CfgOptions(DictAction):
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 (argparse's signature)
            for item in values or ():  # one at a time: the message names the item that fails
                try:
                    super().__call__(parser, namespace, [item], option_string)
                except (AssertionError, ValueError, RecursionError) as exc:
                    raise ConfigError(f"--cfg-options {item}: {_option_problem(item, exc)}") from None

    parser.add_argument("--cfg-options", nargs="+", action=CfgOptions, default={}, metavar="KEY=VALUE", help=help)


def _option_problem(item: str, exc: BaseException) -> str:
    if "=" not in item:
        return "expected key=value, e.g. model.checkpoint=0.5"
    return (
        f"cannot parse the value ({_one_line(exc)}); lists are written [a,b] or (a,b) with balanced brackets, "
        'and a string holding brackets is quoted: key="[a"'
    )


def _merge(cfg: Any, overrides: dict[str, Any]) -> None:
    """mmengine's merge of dotted `--cfg-options` keys into `cfg` (a `Config`), its errors as one line."""
    try:
        cfg.merge_from_dict(overrides, allow_list_keys=True)
    except (TypeError, KeyError, ValueError) as exc:  # e.g. `a.b=1` where `a` is not a dict
        raise ConfigError(f"--cfg-options: {_one_line(exc)}") from None


def _reject_imports(path: Path) -> None:
    """Imports switch mmengine to its lazy mode, which breaks classic configs: forbid them up front.

    Checks the file and, recursively, its `_base_` files, so a broken base is named as such.
    """
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:  # also raised for a file that is not valid UTF-8
        raise ConfigError(f"--config {path}: syntax error at line {exc.lineno}: {exc.msg}") from exc
    xtuner = next((node for node in ast.walk(tree) if _imports_xtuner(node)), None)
    if xtuner is not None:
        raise ConfigError(
            f"{path} is an XTuner config (line {xtuner.lineno} imports xtuner): translate it with "
            f"`python -m internlm_offload.tools.from_xtuner {path} --out new_config.py` and train that"
        )
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            raise ConfigError(
                f"{path} line {node.lineno}: import statements are not allowed in config files; "
                'write values as literals (dtypes as strings, e.g. "torch.bfloat16")'
            )
    for base in _base_files(tree, path):
        if not base.is_file():
            raise ConfigError(f"{path}: _base_ file not found: {base}")
        _reject_imports(base)


def _imports_xtuner(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "xtuner"
    return isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "xtuner" for alias in node.names)


def _base_files(tree: ast.Module, path: Path) -> list[Path]:
    """The `_base_` paths a config names (str or list), relative to the config file."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_base_" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return []  # computed bases: leave them to mmengine
            names = [value] if isinstance(value, str) else list(value)
            return [path.parent / name for name in names if "::" not in name]
    return []


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) < 300 else text[:297] + "..."

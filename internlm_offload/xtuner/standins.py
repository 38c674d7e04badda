"""Run an XTuner v1 config file and return its `trainer`, with recorders standing in for `xtuner` imports.

An XTuner v1 config is Python: it imports config classes from `xtuner.v1` (`TrainerConfig`, `AdamWConfig`,
`FSDPConfig`, ...), calls them with keywords, may mutate their attributes and read environment variables,
and leaves one global, `trainer`. Without XTuner installed, every name imported from `xtuner` here is a
`StandIn`: calling it gives a `Recorded` that keeps the class name and keywords, reads them back as
attributes and records attribute writes. With a real XTuner importable, it is used and its objects are read
the same way (`field`). The stand-ins live only while the file runs: `sys.modules` is restored after.
"""

import ast
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import runpy
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = "xtuner"
# What XTuner's classic (mmengine) configs import besides torch: only names used as `type=` in dicts, never run.
CLASSIC_ROOTS = (ROOT, "mmengine", "transformers", "peft", "datasets", "bitsandbytes", "deepspeed")


class Recorded:
    """A call of an `xtuner` name: `name`, positional `args`, keywords (read back as attributes)."""

    def __init__(self, name: str, args: tuple, kwargs: dict[str, Any], implicit: bool = False) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", dict(kwargs))
        # made by reading an attribute the file never gave (not by a call in the file): unset until written to
        object.__setattr__(self, "implicit", implicit)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        # an attribute never given: a nested config the file may go on to mutate (`model_cfg.text_config.x = 1`)
        return self.kwargs.setdefault(attr, Recorded(f"{self.name}.{attr}", (), {}, implicit=True))

    def __setattr__(self, attr: str, value: Any) -> None:
        self.kwargs[attr] = value

    def __call__(self, *args: Any, **kwargs: Any) -> "Recorded":
        return Recorded(f"{self.name}()", args, kwargs)

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"


class StandIn:
    """An `xtuner` class or function: calling it records the call."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Recorded:
        return Recorded(self.name, args, kwargs)

    def __getattr__(self, attr: str) -> "StandIn":  # classmethods such as `Config.from_hf(...)`
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self.name}.{attr}")

    # Annotations such as `-> Float8Config | None` are evaluated when the file defines the function.
    def __or__(self, other: Any) -> "StandIn":
        return StandIn(f"{self.name} | {_type_name(other)}")

    def __ror__(self, other: Any) -> "StandIn":
        return StandIn(f"{_type_name(other)} | {self.name}")

    def __repr__(self) -> str:
        return self.name


def _type_name(annotation: Any) -> str:
    if annotation is None or annotation is type(None):
        return "None"
    return getattr(annotation, "name", None) or getattr(annotation, "__name__", None) or repr(annotation)


def field(obj: Any, name: str, default: Any = None) -> Any:
    """A config object's field: a recorded keyword, or a real XTuner object's attribute; `default` if the
    file did not set it (a pydantic object's `model_fields_set`: constructor keywords and assignments)."""
    if isinstance(obj, Recorded):
        value = obj.kwargs.get(name, default)
        # an attribute only read, never written, is unset; a call in the file (`Qwen3Dense4BConfig()`) is a value
        return default if isinstance(value, Recorded) and value.implicit and not value.kwargs else value
    if isinstance(obj, dict):
        return obj.get(name, default)
    fields_set = getattr(obj, "model_fields_set", None)  # a real XTuner (pydantic) config object
    if fields_set is not None and name not in fields_set:
        # XTuner's default, not the user's choice: read as a recorder reads an unset keyword, so the report
        # names only what the file set
        return default
    return getattr(obj, name, default)


def kind(obj: Any) -> str:
    """The XTuner class name of a config object (`AdamWConfig`, ...)."""
    return obj.name if isinstance(obj, Recorded) else type(obj).__name__


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> StandIn:
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn(name)


def _under(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds each root (`xtuner`, ...) and its submodules as empty packages whose names are stand-ins."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if _under(fullname, self.roots):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []  # a package: submodules import through this finder too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def real_xtuner_available() -> bool:
    try:
        return importlib.util.find_spec("xtuner.v1") is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _stand_ins(roots: tuple[str, ...] = (ROOT,)) -> Iterator[None]:
    saved = {name: module for name, module in sys.modules.items() if _under(name, roots)}
    for name in saved:
        del sys.modules[name]
    finder = _StandInFinder(roots)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if _under(n, roots)]:
            del sys.modules[name]
        sys.modules.update(saved)


def is_classic(path: Path) -> bool:
    """Whether the file is an XTuner classic (mmengine) config: it assigns no top-level `trainer` (v1's contract)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    targets = [
        t
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
    ]
    return not any(isinstance(t, ast.Name) and t.id == "trainer" for t in targets)


def load_classic(path: Path) -> dict[str, Any]:
    """Run an XTuner classic config with stand-ins for xtuner, mmengine, transformers, peft, datasets (its
    `type=` names, never called) and return its globals; torch is the real one (`torch.float16`, `AdamW`)."""
    with _stand_ins(CLASSIC_ROOTS):
        names = runpy.run_path(str(path), run_name="__xtuner_config__")
    if not isinstance(names.get("model"), dict):
        raise ValueError(f"{path}: no `model = dict(type=SupervisedFinetune, ...)` global (an XTuner classic config)")
    return {name: value for name, value in names.items() if not name.startswith("__")}


def type_name(value: Any) -> str:
    """The name a `type=` entry of a classic config stands for: `AdamW`, `AutoModelForCausalLM.from_pretrained`."""
    if isinstance(value, StandIn):
        return value.name
    if isinstance(value, str):
        return value
    return getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)


def load_trainer(path: Path) -> Any:
    """Run the XTuner config at `path` and return its `trainer` (a `Recorded`, or XTuner's own object)."""
    context = contextlib.nullcontext() if real_xtuner_available() else _stand_ins()
    with context:
        names = runpy.run_path(str(path), run_name="__xtuner_config__")
    if "trainer" not in names:
        raise ValueError(f"{path}: no `trainer = TrainerConfig(...)` global (an XTuner v1 config defines one)")
    return names["trainer"]

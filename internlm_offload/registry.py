"""The registries that turn a config's `type="..."` into objects.

Built on mmengine's `Registry` in a scope of our own ("internlm_offload"), so our names never collide
with mmengine's root registries (which already hold torch.optim's `AdamW`, `Muon`, ...). Each registry
lists the modules that register into it (`locations`); mmengine imports them on the first lookup, so no
caller has to import a module only for its side effect.
"""

import importlib
from typing import Any

from mmengine.registry import Registry

SCOPE = "internlm_offload"

# Each registry's name -> the modules that register into it.
LOCATIONS = {
    "model": ["internlm_offload.model.families"],  # family.FamilySpec, one per model family
    "dataset": ["internlm_offload.data"],
    "parallel": ["internlm_offload.engine.parallel"],
}
MODELS = Registry("model", scope=SCOPE, locations=LOCATIONS["model"])
DATASETS = Registry("dataset", scope=SCOPE, locations=LOCATIONS["dataset"])
PARALLEL = Registry("parallel", scope=SCOPE, locations=LOCATIONS["parallel"])


def import_locations(registry: Registry) -> None:
    """Import the modules that register into `registry` (mmengine's `import_from_location` without its logger, which
    imports torch: the config checks read model families before anything heavy is imported)."""
    for location in LOCATIONS[registry.name]:
        importlib.import_module(location)


class UnknownTypeError(KeyError):
    """A config named a `type` that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; we want the plain line
        return str(self.args[0])


def lookup(registry: Registry, type_name: str, key: str) -> Any:
    """Return the object registered as `type_name`, or raise naming `key` and the registered names."""
    import_locations(registry)
    # Not `registry.get`: it falls back to importing any dotted path, so "json" would build a module.
    obj = registry.module_dict.get(type_name)
    if obj is None:
        names = ", ".join(sorted(registry.module_dict))
        raise UnknownTypeError(f"{key}: unknown type {type_name!r}; registered {registry.name} types: {names}")
    return obj


def build(registry: Registry, type_name: str, key: str, /, *args: Any, **kwargs: Any) -> Any:
    """Call the object registered as `type_name` (a class or a builder function) with the arguments."""
    return lookup(registry, type_name, key)(*args, **kwargs)

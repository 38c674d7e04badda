"""Pickles read as data, never as code: the one place this trainer unpickles a file it did not just write.

A pickle can name any callable, so a checkpoint or model file from elsewhere could run code on load. Two
readers build nothing but data:
- `load_data`: `torch.load(weights_only=True)` (tensors, plain containers and values), its refusals turned
  into `UnsafeCheckpointError` naming what the file would have loaded;
- `AllowListUnpickler`: a plain unpickler that resolves only the names it is given (DCP's `.metadata`,
  whose classes torch's weights-only unpickler does not know).

It sits with the weights, the lowest layer that reads files, so that both the foreign-weights readers here and
the engine's checkpoint reader (`engine.checkpoint_reader`) import it downward.
"""

import pickle
from collections.abc import Callable, Mapping
from typing import IO, Any

import torch


class UnsafeCheckpointError(ValueError):
    """A checkpoint file would load something other than data (a callable, a foreign class)."""


class AllowListUnpickler(pickle.Unpickler):
    """Resolves only the globals in `allowed` (module -> names) or accepted by `also`; anything else is refused
    with `UnsafeCheckpointError(refusal(module, name))` before it is built."""

    def __init__(
        self,
        file: IO[bytes],
        allowed: Mapping[str, set[str]],
        refusal: Callable[[str, str], str],
        also: Callable[[str, str], Any | None] = lambda module, name: None,
    ) -> None:
        super().__init__(file)
        self.allowed, self.refusal, self.also = allowed, refusal, also

    def find_class(self, module: str, name: str) -> Any:
        if name in self.allowed.get(module, ()):
            return super().find_class(module, name)
        found = self.also(module, name)
        if found is not None:
            return found
        raise UnsafeCheckpointError(self.refusal(module, name))


def torch_dtype(module: str, name: str) -> torch.dtype | None:
    """torch's dtype named `torch.<name>`, or None (an `also` for `AllowListUnpickler`)."""
    value = getattr(torch, name, None) if module == "torch" else None
    return value if isinstance(value, torch.dtype) else None


def load_data(file: Any, refusal: Callable[[str], str], **torch_load: Any) -> Any:
    """`torch.load(file, weights_only=True, **torch_load)`; a refused global raises
    `UnsafeCheckpointError(refusal(what))` (`what`: the global's dotted name, e.g. "posix.system")."""
    try:
        return torch.load(file, weights_only=True, **torch_load)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(refusal(refused_global(exc))) from None


def refused_global(exc: Exception) -> str:
    """What torch's weights-only unpickler refused, from its message ("... GLOBAL posix.system whose ...")."""
    words = str(exc).split()
    if "GLOBAL" in words[:-1]:
        return words[words.index("GLOBAL") + 1]
    return "something other than data"

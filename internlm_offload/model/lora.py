"""LoRA adapters on a built model, through PEFT's own layers (`peft.inject_adapter_in_model`).

PEFT's `lora.Linear` wraps each targeted `nn.Linear` in place: the base weight moves to `<module>.base_layer.weight`
and the adapters are `<module>.lora_A.default.weight` [r, in] and `<module>.lora_B.default.weight` [out, r]; forward
is base(x) + (lora_alpha / r) * B(A(dropout(x))), with B zero at init so the adapted model starts as the base.
PEFT freezes every other parameter. Its layers are plain modules over autograd ops, so the trainer's hooks
(checkpointing, activation offload's saved tensors) and wrappers (DDP, FSDP2) see ordinary parameters.
"""

from collections.abc import Iterable, Iterator

import torch
from torch import nn

ADAPTER_NAME = "default"
_BASE_LAYER = ".base_layer"
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")


def adapter_root(model: nn.Module) -> nn.Module:
    """The module PEFT wraps: a Hugging Face wrapper's `hf_model` (so target names are the HF model's), else the
    model itself."""
    return getattr(model, "hf_model", model)


def apply_lora(model: nn.Module, *, r: int, lora_alpha: float, lora_dropout: float, target_modules: list[str]) -> None:
    """Wrap the `target_modules` linears of `model` with PEFT LoRA layers and freeze everything else.

    ValueError (one line) when no module matches. The adapters' A is drawn from the torch RNG (PEFT's
    kaiming-uniform), B is zero.
    """
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules, bias="none"
    )
    root = adapter_root(model)
    try:
        inject_adapter_in_model(config, root, adapter_name=ADAPTER_NAME)
    except ValueError as exc:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in root.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"model.lora.target_modules={target_modules}: no linear of {type(root).__name__} matches "
            f"({' '.join(str(exc).split())[:120]}); its linears: {', '.join(names)}"
        ) from None
    for name, param in model.named_parameters():  # the wrapper's own parameters (none today) stay frozen too
        if not is_adapter_name(name):
            param.requires_grad_(False)


def draw_adapters(skeleton: nn.Module, **lora: object) -> dict[str, torch.Tensor]:
    """The adapters' initial values as `apply_lora(model, **lora)` draws them from the torch RNG, for a model
    built on meta (`skeleton`: the run's structure without adapters; it is consumed). PEFT draws A on the host and
    then moves it to its base weight's device, so on meta the values would be lost: here each linear of the
    skeleton gets stride-0 host tensors of its shapes (no memory), so the draws stay. Same modules, same order,
    same generator: the values and the generator's state after them are those of the whole build's injection."""
    for module in adapter_root(skeleton).modules():
        if isinstance(module, nn.Linear):
            for name, param in list(module.named_parameters(recurse=False)):
                host = torch.zeros((), dtype=param.dtype).expand(param.shape)
                setattr(module, name, nn.Parameter(host, requires_grad=param.requires_grad))
    apply_lora(skeleton, **lora)  # type: ignore[arg-type]
    return {name: param.detach() for name, param in adapter_parameters(skeleton)}


def is_adapter_name(name: str) -> bool:
    """Whether a parameter (or state-dict key) name is a LoRA adapter's."""
    return any(part in name for part in _ADAPTER_PARTS)


def base_name(name: str) -> str:
    """The name a base weight has without adapters: `wq.base_layer.weight` -> `wq.weight`."""
    return name.replace(_BASE_LAYER, "")


def base_keys(keys: Iterable[str]) -> dict[str, str]:
    """The base weights of a state dict with adapters: {name without adapters: key}; the adapters left out."""
    return {base_name(key): key for key in keys if not is_adapter_name(key)}


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter_name(name) for name, _ in model.named_parameters())


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The adapters' (name, parameter) pairs."""
    return ((name, p) for name, p in model.named_parameters() if is_adapter_name(name))

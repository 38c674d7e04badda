"""Unit tests for internlm_offload.registry: lookups, unknown-type errors, isolation from mmengine's registries."""

from typing import Any

import pytest
import torch
from mmengine.registry import Registry

from internlm_offload.data.packed import build_builtin_dataset, build_text_dataset
from internlm_offload.engine.parallel import apply_ddp, apply_fsdp2, apply_none
from internlm_offload.model import HFCausalLM, InternLM2
from internlm_offload.optim import build_adamw
from internlm_offload.registry import DATASETS, MODELS, OPTIMIZERS, PARALLEL, SCOPE, UnknownTypeError, build, lookup

LOOKUPS = [
    (MODELS, "internlm2", InternLM2),
    (MODELS, "hf_causal_lm", HFCausalLM),
    (DATASETS, "builtin", build_builtin_dataset),
    (DATASETS, "text", build_text_dataset),
    (OPTIMIZERS, "adamw", build_adamw),
    (PARALLEL, "none", apply_none),
    (PARALLEL, "ddp", apply_ddp),
    (PARALLEL, "fsdp2", apply_fsdp2),
]


@pytest.mark.parametrize("registry, name, expected", LOOKUPS, ids=[f"{r.name}:{n}" for r, n, _ in LOOKUPS])
def test_lookup_returns_registered_object(registry: Registry, name: str, expected: Any) -> None:
    assert lookup(registry, name, "key") is expected


UNKNOWN = [
    (MODELS, "model.type", "llama", "model types: hf_causal_lm, internlm2"),
    (DATASETS, "data.type", "parquet", "dataset types: builtin, internevo, text"),
    (OPTIMIZERS, "optimizer.type", "sgd", "optimizer types: adamw, hybrid_adamw, swap_adamw"),
    (PARALLEL, "parallel.mode", "tp", "parallel types: ddp, fsdp2, none"),
]


@pytest.mark.parametrize("registry, key, bad, listing", UNKNOWN, ids=[u[1] for u in UNKNOWN])
def test_unknown_type_names_key_value_and_registered(registry: Registry, key: str, bad: str, listing: str) -> None:
    with pytest.raises(UnknownTypeError) as info:
        lookup(registry, bad, key)
    message = str(info.value)
    assert message == f"{key}: unknown type {bad!r}; registered {listing}"
    assert isinstance(info.value, KeyError)  # callers catching KeyError still work


@pytest.mark.parametrize(
    "registry, key, bad",
    [(DATASETS, "data.type", "json"), (MODELS, "model.type", "torch.nn.Linear"), (OPTIMIZERS, "optimizer", "os.path")],
)
def test_importable_name_is_not_a_registered_type(registry: Registry, key: str, bad: str) -> None:
    with pytest.raises(UnknownTypeError, match=f"{key}: unknown type {bad!r}"):
        lookup(registry, bad, key)


def test_unknown_type_through_build() -> None:
    with pytest.raises(UnknownTypeError, match=r"^model\.type: unknown type 'InternLM2'"):
        build(MODELS, "InternLM2", "model.type")  # names are case-sensitive


def test_build_calls_the_registered_object() -> None:
    model = torch.nn.Linear(2, 2)
    assert build(PARALLEL, "none", "parallel.mode", model, ctx=None) is model


def test_registries_live_in_our_scope() -> None:
    for registry in (MODELS, DATASETS, OPTIMIZERS, PARALLEL):
        assert registry.scope == SCOPE == "internlm_offload"
        assert registry.parent is None  # no fallback into mmengine's root registries


def test_no_collision_with_mmengine_root_optimizers() -> None:
    import mmengine.optim  # noqa: F401  (registers every torch.optim class into mmengine's root OPTIMIZERS)
    from mmengine.registry import OPTIMIZERS as ROOT_OPTIMIZERS

    assert ROOT_OPTIMIZERS.get("AdamW") is torch.optim.AdamW
    assert ROOT_OPTIMIZERS.get("adamw") is None  # our name did not leak into the root
    assert OPTIMIZERS.get("AdamW") is None  # and the root's names do not leak into ours
    with pytest.raises(UnknownTypeError, match="registered optimizer types: adamw, hybrid_adamw, swap_adamw$"):
        lookup(OPTIMIZERS, "AdamW", "optimizer.type")


def test_registering_a_root_name_in_our_registry_does_not_collide() -> None:
    import mmengine.optim  # noqa: F401

    def fake_adamw() -> None:
        """A stand-in registered under torch's name."""

    try:
        OPTIMIZERS.register_module(name="AdamW", module=fake_adamw)  # raises KeyError in mmengine's root
        assert lookup(OPTIMIZERS, "AdamW", "optimizer.type") is fake_adamw
    finally:
        OPTIMIZERS._module_dict.pop("AdamW", None)
    assert OPTIMIZERS.get("AdamW") is None


@pytest.mark.parametrize("wrapper, stray", [(apply_none, "bucket_cap_mb"), (apply_ddp, "layers"),
                                            (apply_fsdp2, "bucket_cap_mb")])  # fmt: skip
def test_parallel_wrappers_take_exact_arguments(wrapper, stray):
    """An argument meant for another mode is an error, not silently dropped."""
    with pytest.raises(TypeError, match=stray):
        wrapper(torch.nn.Linear(2, 2), ctx=None, **{stray: 1})

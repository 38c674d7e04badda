"""Unit tests for internlm_offload.registry: lookups, unknown-type errors, isolation from mmengine's registries."""

from typing import Any

import pytest
import torch
from mmengine.registry import Registry

from internlm_offload.data.packed import build_builtin_dataset, build_text_dataset
from internlm_offload.engine.parallel import apply_ddp, apply_fsdp2, apply_none
from internlm_offload.model.families import hf_causal_lm, internlm2
from internlm_offload.registry import DATASETS, MODELS, PARALLEL, SCOPE, UnknownTypeError, build, lookup

LOOKUPS = [
    (MODELS, "internlm2", internlm2.FAMILY),
    (MODELS, "hf_causal_lm", hf_causal_lm.FAMILY),
    (DATASETS, "builtin", build_builtin_dataset),
    (DATASETS, "text", build_text_dataset),
    (PARALLEL, "none", apply_none),
    (PARALLEL, "ddp", apply_ddp),
    (PARALLEL, "fsdp2", apply_fsdp2),
]


@pytest.mark.parametrize("registry, name, expected", LOOKUPS, ids=[f"{r.name}:{n}" for r, n, _ in LOOKUPS])
def test_lookup_returns_registered_object(registry: Registry, name: str, expected: Any) -> None:
    assert lookup(registry, name, "key") is expected


UNKNOWN = [
    (MODELS, "model.type", "llama", "model types: deepseek_v3, gpt_oss, hf_causal_lm, internlm2, qwen3_next"),
    (DATASETS, "data.type", "parquet", "dataset types: builtin, chat, internevo, text"),
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
    [
        (DATASETS, "data.type", "json"),
        (MODELS, "model.type", "torch.nn.Linear"),
        (PARALLEL, "parallel.mode", "os.path"),
    ],
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
    import mmengine.dataset  # noqa: F401  registers ConcatDataset in mmengine's root DATASETS

    for registry in (MODELS, DATASETS, PARALLEL):
        assert registry.scope == SCOPE == "internlm_offload"
    assert DATASETS.get("ConcatDataset") is None  # the root's names do not leak into ours
    with pytest.raises(UnknownTypeError, match="registered dataset types: builtin, chat, internevo, text$"):
        lookup(DATASETS, "ConcatDataset", "data.type")


def test_registering_a_root_name_in_our_registry_does_not_collide() -> None:
    import mmengine.dataset  # noqa: F401

    def fake_concat() -> None:
        """A stand-in registered under a name mmengine's root registry holds."""

    try:
        DATASETS.register_module(name="ConcatDataset", module=fake_concat)  # a KeyError in mmengine's root
        assert lookup(DATASETS, "ConcatDataset", "data.type") is fake_concat
    finally:
        DATASETS._module_dict.pop("ConcatDataset", None)
    assert DATASETS.get("ConcatDataset") is None


@pytest.mark.parametrize(
    "wrapper, stray", [(apply_none, "bucket_cap_mb"), (apply_ddp, "layers"), (apply_fsdp2, "bucket_cap_mb")]
)
def test_parallel_wrappers_take_exact_arguments(wrapper, stray):
    """An argument meant for another mode is an error, not silently dropped."""
    with pytest.raises(TypeError, match=stray):
        wrapper(torch.nn.Linear(2, 2), ctx=None, **{stray: 1})

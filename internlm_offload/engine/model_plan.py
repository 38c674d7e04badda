"""Where the parallel features find a model's modules: through its tensor plan (model/tensor_plan.py), each module
checked for the hook the feature needs (model/hooks.py).

Every check refuses in one line (a `ConfigError`, exit 2 at start-up) naming the feature as the config asks for it,
the block and the module's class: a feature is never skipped for a module that cannot take it. The checks run
before a feature changes anything, so a refused model is left as it was.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from internlm_offload.config import ConfigError
from internlm_offload.model.hooks import DispatchesExperts, ExchangesSequence, HasTensorPlan, ShardsSequence
from internlm_offload.model.tensor_plan import BlockPlan, TensorPlan


def tensor_plan(model: nn.Module, feature: str) -> TensorPlan:
    """`model`'s plan, one `BlockPlan` per entry of `model.layers`; refused without one."""
    if not isinstance(model, HasTensorPlan):
        raise ConfigError(
            f"{feature}: the model {type(model).__name__} has no tensor plan (model/hooks.py HasTensorPlan)"
        )
    plan = model.tensor_plan()
    if len(plan.blocks) != len(model.layers):
        raise ConfigError(
            f"{feature}: the tensor plan of {type(model).__name__} has {len(plan.blocks)} blocks, the model "
            f"{len(model.layers)} (model/tensor_plan.py)"
        )
    return plan


def planned_blocks(
    model: nn.Module, plan: TensorPlan, feature: str = "the tensor plan"
) -> Iterator[tuple[int, nn.Module, BlockPlan]]:
    """(index, block, its plan) for every block of `model`, in depth order: `model.layers`, then the side blocks
    (multi-token prediction's) numbered on from them."""
    for index, (block, block_plan) in enumerate(zip(model.layers, plan.blocks, strict=True)):
        yield index, block, block_plan
    for index, side in enumerate(plan.side_blocks, start=len(plan.blocks)):
        yield index, _model_module(model, side.block, feature), side.plan


def planned_module(block: nn.Module, index: int, name: str, feature: str) -> nn.Module:
    """The module the plan names `name` in block `index`; refused where the block has none."""
    try:
        return block.get_submodule(name)
    except AttributeError:
        raise ConfigError(
            f"{feature}: block {index} ({type(block).__name__}) has no module {name!r}, which its tensor plan names "
            "(model/tensor_plan.py)"
        ) from None


def check_names(block: nn.Module, index: int, names: list[str], feature: str) -> None:
    """Every module the plan names in block `index` exists (torch's `parallelize_module` skips a missing one)."""
    for name in names:
        planned_module(block, index, name, feature)


def check_model_names(model: nn.Module, plan: TensorPlan, feature: str) -> None:
    """The model-level modules the plan names exist (the side blocks' included)."""
    sides = [name for side in plan.side_blocks for name in (side.block, *side.norms, *side.projections)]
    for name in (plan.embedding, plan.final_norm, plan.head, *sides):
        _model_module(model, name, feature)


def _model_module(model: nn.Module, name: str, feature: str) -> nn.Module:
    """The model-level module the plan names `name`; refused where the model has none."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ConfigError(
            f"{feature}: the model {type(model).__name__} has no module {name!r}, which its tensor plan names "
            "(model/tensor_plan.py)"
        ) from None


def sequence_exchangers(model: nn.Module, feature: str) -> list[ExchangesSequence]:
    """isp: every block's attention, each an `ExchangesSequence`; the model itself must be a `ShardsSequence`."""
    if not isinstance(model, ShardsSequence):
        raise ConfigError(
            f"{feature}: the model {type(model).__name__} does not take a sequence shard (model/hooks.py ShardsSequence)"
        )
    attentions = []
    for index, block, block_plan in planned_blocks(model, tensor_plan(model, feature), feature):
        attention = planned_module(block, index, block_plan.attention.module, feature)
        if not isinstance(attention, ExchangesSequence):
            raise ConfigError(
                f"{feature}: block {index}'s attention {type(attention).__name__} does not take a sequence exchange "
                "(model/hooks.py ExchangesSequence)"
            )
        attentions.append(attention)
    return attentions


def sparse_blocks(model: nn.Module, feature: str) -> list[DispatchesExperts]:
    """Expert parallel: the blocks the plan says are sparse, each a `DispatchesExperts` (a sparse block alone, as a
    test or a benchmark builds it, is its own)."""
    if isinstance(model, DispatchesExperts):
        return [model]
    found = []
    for index, block, block_plan in planned_blocks(model, tensor_plan(model, feature), feature):
        if not block_plan.sparse:
            continue
        sparse = planned_module(block, index, block_plan.feed_forward.module, feature)
        if not isinstance(sparse, DispatchesExperts):
            raise ConfigError(
                f"{feature}: block {index}'s sparse block {type(sparse).__name__} does not take an expert dispatch "
                "(model/hooks.py DispatchesExperts)"
            )
        found.append(sparse)
    return found

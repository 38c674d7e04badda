"""The `optimizer` section: keys shared by every update rule, and which rule steps which parameter."""

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from internlm_offload.config.base import Section

UpdateRuleName = Literal["adamw"]  # the rules a config can name (optim/rules.py; Muon comes with its issue)


class OptimizerConfig(Section):
    lr: Optional[float] = Field(
        None,
        gt=0,
        description="Peak learning rate of every update rule; the same key as `adam.lr` (InternEvo's spelling, "
        "which keeps working): give one of the two, or both equal.",
    )
    rules: list[tuple[str, UpdateRuleName]] = Field(
        [],
        description="`(pattern, rule)` pairs choosing each trainable parameter's update rule by its name "
        "(fnmatch, e.g. `('*.experts.*', 'adamw')`): the first match wins; parameters no pattern matches take "
        "`adamw`. Rules: `adamw`.",
    )

    @field_validator("rules", mode="before")
    @classmethod
    def _pairs_as_tuples(cls, value: Any) -> Any:
        # config files and --cfg-options give lists; a pair is a tuple here
        if isinstance(value, (list, tuple)):
            return [tuple(pair) if isinstance(pair, list) else pair for pair in value]
        return value


def shared_lr_problem(optimizer: OptimizerConfig, adam_lr: float, adam_lr_set: bool) -> str | None:
    """Why `optimizer.lr` and `adam.lr` cannot both stand (None when they agree or one is unset)."""
    if optimizer.lr is None or not adam_lr_set or optimizer.lr == adam_lr:
        return None
    return f"optimizer.lr={optimizer.lr} and adam.lr={adam_lr} are one learning rate spelled twice; give one of them"

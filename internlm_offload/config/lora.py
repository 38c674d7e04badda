"""The `model.lora` section: PEFT's `LoraConfig` names and defaults, and the target names each model accepts."""

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from internlm_offload.config.base import Section
from internlm_offload.family import capabilities, families_with, family_spec, routed_experts

# PEFT's default for llama-like models (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
DEFAULT_TARGETS = ("q_proj", "v_proj")


class LoraConfig(Section):
    r: int = Field(8, ge=1, description="Rank of each adapter (PEFT's `r`).")
    lora_alpha: float = Field(
        8, gt=0, description="Scaling numerator: the adapter's output is scaled by `lora_alpha / r` (PEFT's)."
    )
    lora_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input only (the base path never drops)."
    )
    target_modules: Optional[list[str]] = Field(
        None,
        description="Linear modules that get an adapter, matched by name suffix as in PEFT. `internlm2`: "
        "q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj/down_proj or the native wq/wk/wv/wo/w1/w3/w2; "
        "`gpt_oss`: its attention's q_proj/k_proj/v_proj/o_proj or wq/wk/wv/wo; "
        "`hf_causal_lm`: the Hugging Face model's own module names. Default: PEFT's llama default, "
        "`['q_proj', 'v_proj']`. On a mixture of experts the MLP names adapt the dense blocks' and the shared "
        "experts' linears; the router and the routed experts stay frozen.",
    )
    bias: Literal["none"] = Field(
        "none", description="PEFT's `bias`: only `none` (biases stay frozen, so the adapter off is the base model)."
    )
    base_on_host: bool = Field(
        False,
        description="Hold the frozen base's block linears in host memory (pinned where the accelerator pins) and "
        "bring them to the device a block at a time for forward and again for backward, the next block copied "
        "while the current one computes. `parallel.mode` none or ddp (`internlm2` builds it there from meta; "
        '`hf_causal_lm` on the device first); under fsdp2 use `parallel.fsdp_cpu_offload`. `"auto"` (with '
        "`memory_budget`): the planner's search decides.",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _list_targets(cls, value: Any) -> Any:
        if isinstance(value, str):  # PEFT reads a str as a regex; one name is the common intent
            raise ValueError(f"model.lora.target_modules={value!r}: give a list of module names, e.g. [{value!r}]")
        return list(value) if isinstance(value, tuple) else value

    @model_validator(mode="after")
    def _targets(self) -> "LoraConfig":
        if self.target_modules is not None and not self.target_modules:
            raise ValueError("model.lora.target_modules=[]: name at least one module, or leave it unset")
        return self


def resolved_targets(lora: LoraConfig) -> list[str]:
    """The target names as given, or PEFT's default."""
    return list(lora.target_modules or DEFAULT_TARGETS)


def native_targets(lora: LoraConfig, family: str) -> list[str]:
    """The targets as `family` names its modules (Hugging Face names translated by its `FamilySpec.module_names`);
    ValueError naming a bad one."""
    module_names = family_spec(family).module_names
    own = tuple(module_names.values())
    names = []
    for name in resolved_targets(lora):
        native = module_names.get(name, name)
        if native not in own:
            allowed = ", ".join([*module_names, *own])
            raise ValueError(
                f"model.lora.target_modules: {name!r} is not a linear of model.type={family!r}; allowed: {allowed}"
            )
        if native not in names:
            names.append(native)
    return names


def check_lora(model: Any) -> None:
    """The checks of `model.lora` against the rest of the model section (a `ModelConfig`)."""
    if model.lora is None:
        return
    if not capabilities(model.type).lora:
        raise ValueError(f"model.lora is built for model.type={families_with('lora')}; not {model.type!r}")
    if family_spec(model.type).module_names:
        native_targets(model.lora, model.type)  # raises naming a target the decoder does not have
    if model.num_experts and model.quantization_config is not None:
        raise ValueError(
            f"model.quantization_config with model.num_experts={model.num_experts}: the stacked experts are not "
            "held in 4 bits yet; drop quantization_config (LoRA on a mixture of experts keeps its base in model.dtype)"
        )


def base_on_host_problem(cfg: Any) -> str | None:
    """Why `model.lora.base_on_host` does not compose with the rest of a `RunConfig`, or None."""
    lora = cfg.model.lora
    if lora is None or not lora.base_on_host:
        return None
    where = "model.lora.base_on_host=True"
    if cfg.parallel.mode == "fsdp2":
        return f"{where} with parallel.mode='fsdp2': use parallel.fsdp_cpu_offload=True (FSDP2's host shards)"
    return base_on_host_layout_problem(cfg)


def base_on_host_layout_problem(cfg: Any) -> str | None:
    """What of the layout, the wrapper apart, keeps `model.lora.base_on_host` from being built: pipeline stages, a
    mixture of experts spread over ranks; None if nothing (the planner offers the knob where this is None)."""
    where = "model.lora.base_on_host=True"
    if cfg.parallel.pipeline.size > 1:
        return f"{where} with parallel.pipeline.size={cfg.parallel.pipeline.size}: not built for pipeline stages; use 1"
    if cfg.parallel.expert.size != 1 and routed_experts(cfg.model):
        return (
            f"{where} with parallel.expert.size={cfg.parallel.expert.size}: the experts are hosted on one rank's "
            "blocks only, not dispatched over ranks yet; set parallel.expert.size=1"
        )
    return None

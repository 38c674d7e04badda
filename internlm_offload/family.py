"""Model families: what a config's `model.type` names, what each family can do, and where its code lives.

A family is one package under `internlm_offload/model/families/` (or anywhere a config's `custom_imports` reaches)
whose `__init__` registers one `FamilySpec` in `registry.MODELS`. The spec is plain data and imports no torch, so
the config checks ask a family's `Capabilities` before anything heavy is imported; the family's `entry` module
(the builder, imported on first use) does the work. Every check of what a feature allows reads a capability, never
a family's name: a new family states what it can do in its spec and touches no engine, planner or config code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

from internlm_offload.registry import MODELS, import_locations, lookup


@dataclass(frozen=True)
class Capabilities:
    """What a family's model offers the rest of the trainer; False: the feature refuses the family in one line."""

    # The `model.num_experts` / `top_k` / `moe_*` keys build its mixture of experts (config/moe.py).
    native_experts: bool = False
    # `parallel.tensor`: its blocks carry a tensor plan (engine/tensor_parallel.py).
    tensor_parallel: bool = False
    # `parallel.pipeline`: it splits into stages (tok_embeddings, layers, norm, output; engine/pipeline_split.py).
    pipeline: bool = False
    # `init_weights(apply=)` draws one whole parameter at a time: FSDP2's meta build and a LoRA base drawn on the host.
    init_per_param: bool = False
    # `model.num_layers=1` builds one of its blocks alone, and every block is that block: the kernel probe before
    # the run (engine/runtime_memory.py) and the planner's per-block trace (planner/compose.py).
    one_block_copy: bool = False
    # Its parameters carry this trainer's names (wq, w1, ...): other formats' names come from name tables
    # (weights/names.py, the native family's hf_names.py), LoRA targets are named as the native decoder names its
    # modules, exports map names out.
    native_names: bool = False
    # `ckpt.load_ckpt_info.ckpt_type` "hf" / "hf_llama" / "llama" load other trainers' files into it.
    foreign_weights: bool = False
    # `model.vocab_size` is the config's (checked against the tokenizer before the build); else the model's own.
    config_vocab: bool = False
    # Its modules are transformers': the planner's meta trace stands in for their packed-sequence masks and grouped
    # matmuls, which read tensor values (planner/standins.py).
    transformers_modules: bool = False
    # `tools.export --hf` writes its folder back: config.json from its module's `folder_config(cfg)`, the tensors under
    # its `folder_format` names (the names `model.hf_path` is read by).
    folder_export: bool = False
    # `model.lora`: PEFT's adapters on the modules its entry's `lora_targets(cfg)` names (config/lora.py refuses the
    # section for the others).
    lora: bool = False
    # `model.balancing_loss`: its model returns the bias router's balancing loss (model/balancing.py) as `moe_aux`.
    balancing_loss: bool = False
    # `model.mtp_config`: multi-token prediction blocks after its stack (model/mtp.py), their loss added by the engine;
    # the depth its own config asks for is `FamilySpec.mtp_layers`.
    multi_token_prediction: bool = False


@dataclass(frozen=True)
class FamilySpec:
    """One registered family: its `model.type` name, its capabilities, and the module that builds it.

    `entry` names a module with `build_model(cfg: ModelConfig, device) -> nn.Module` (the bare fp32 model) and
    `folder_format(model) -> FolderFormat | None` (how `model.hf_path`'s tensors are named, which the builder reads
    them by; None: the family reads its folder otherwise); with `Capabilities.folder_export`,
    `folder_config(cfg: ModelConfig)` (the transformers config its `--hf` export writes as config.json); with
    `Capabilities.lora`, `lora_targets(cfg: ModelConfig) -> list[str]` (PEFT's target names on its modules). Optional
    (left out where there is nothing to say; `check_run` / `aux_loss_coefficients` below stand in): `aux_loss_coefficients(cfg: RunConfig, model) ->
    dict[str, float]` (the weight of each auxiliary loss its model returns; none: {}) and `check_run(cfg: RunConfig)
    -> None` (what the run asks that the schema cannot see, as a ConfigError; none: nothing to check).
    """

    name: str
    entry: str
    capabilities: Capabilities
    summary: str = ""  # one line for messages and the config reference
    # The checks of its `model` section (a ModelConfig) the schema runs, torch-free: ValueError naming the key.
    check_section: Callable[[Any], None] | None = None
    # Hugging Face's names of its LoRA-targetable modules -> its own (`model.lora.target_modules` takes either).
    module_names: Mapping[str, str] = field(default_factory=dict)
    # The routed experts per sparse block of its `model` section (a ModelConfig), torch-free, where the section's
    # `model.num_experts` does not hold them (read off `model.hf_config` or the folder's config.json): what the
    # expert-parallel and tensor-parallel checks count. None: `model.num_experts`.
    routed_experts: Callable[[Any], int] | None = None
    # The experts each token is routed to, likewise (None: `model.top_k`); with `routed_experts`, what the planner's
    # routing line states.
    experts_per_token: Callable[[Any], int] | None = None
    # Its decoder blocks, counted off its config (a family whose architecture is config.json's); None: `model.num_layers`.
    blocks: Callable[[Any], int] | None = None
    # The multi-token-prediction depth its config asks for (config.json's `num_nextn_predict_layers`), torch-free: what
    # an unset `model.mtp_config` follows (config/mtp.py). None: 0.
    mtp_layers: Callable[[Any], int] | None = None
    # A family whose blocks are of several kinds (dense-first blocks before sparse ones), torch-free: the kind of each
    # block of its `model` section (`block_kinds`), and its section with exactly the given kinds of blocks in order
    # (`with_blocks`; None where it cannot build that order). The planner composes a step from such reduced models
    # (planner/compose.py) and the kernel probe runs one block of each kind (engine/runtime_memory.py).
    block_kinds: Callable[[Any], tuple[str, ...]] | None = None
    with_blocks: Callable[[Any, Sequence[str]], Any] | None = None
    # With `Capabilities.balancing_loss`: the `model.balancing_loss` values its model computes (model/balancing.py);
    # by default the bias router's (DeepSeek-V3's).
    balancing_losses: tuple[str, ...] = ("global_batch", "micro_batch", "sequence")

    def module(self) -> ModuleType:
        """The family's builder module, imported on first use (it imports torch)."""
        return importlib.import_module(self.entry)

    def entry_function(self, name: str) -> Callable[..., Any] | None:
        """The entry module's function `name`; None where the family leaves that optional piece out."""
        return getattr(self.module(), name, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`build_model`: a registry entry is something to call (mmengine's `Registry` holds callables)."""
        return self.module().build_model(*args, **kwargs)


def check_run(cfg: Any) -> None:
    """The run's family's own refusals (its entry's `check_run`, a ConfigError) of a RunConfig; none where it has none."""
    check = family_spec(cfg.model.type).entry_function("check_run")
    if check is not None:
        check(cfg)


def aux_loss_coefficients(cfg: Any, model: Any) -> dict[str, float]:
    """The weight of each auxiliary loss the run's (bare) model returns, by name: its family's
    `aux_loss_coefficients`; {} where it has none (its model returns no auxiliary loss)."""
    weights = family_spec(cfg.model.type).entry_function("aux_loss_coefficients")
    return {} if weights is None else dict(weights(cfg, model))


def register_family(spec: FamilySpec) -> FamilySpec:
    """Register `spec` under its name (once: a second family of the same name is an error)."""
    MODELS.register_module(name=spec.name, module=spec)
    return spec


def family_spec(name: str, key: str = "model.type") -> FamilySpec:
    """The family registered as `name`; an unknown one raises naming `key` and the registered names."""
    return lookup(MODELS, name, key)


def known_family(model: Any) -> FamilySpec | None:
    """The family of the `model` section's `model.type`; None for an unknown one (its own check reports it)."""
    try:
        return family_spec(model.type)
    except KeyError:
        return None


def check_model_section(model: Any) -> None:
    """The family's own checks of its `model` section (`FamilySpec.check_section`); an unknown `model.type` is
    reported where the model is built."""
    spec = known_family(model)
    if spec is not None and spec.check_section is not None:
        spec.check_section(model)


def routed_experts(model: Any) -> int:
    """The routed experts per sparse block of the `model` section's model (0: dense): its family's `routed_experts`,
    else `model.num_experts`."""
    spec = known_family(model)
    return model.num_experts if spec is None or spec.routed_experts is None else spec.routed_experts(model)


def experts_per_token(model: Any) -> int:
    """The experts each token is routed to in the `model` section's model: its family's `experts_per_token`, else
    `model.top_k`."""
    spec = known_family(model)
    return model.top_k if spec is None or spec.experts_per_token is None else spec.experts_per_token(model)


def block_count(model: Any) -> int:
    """The decoder blocks of the `model` section's model: its family's `blocks`, else `model.num_layers`."""
    spec = known_family(model)
    return model.num_layers if spec is None or spec.blocks is None else spec.blocks(model)


def block_kinds(model: Any) -> tuple[str, ...] | None:
    """The kind of each decoder block of the `model` section's model, where its family names them (`block_kinds`);
    None for a family that does not (its blocks are one module, `one_block_copy`, or unknown)."""
    spec = known_family(model)
    return None if spec is None or spec.block_kinds is None else spec.block_kinds(model)


def with_blocks(model: Any, kinds: Sequence[str]) -> Any | None:
    """The `model` section of the same model with exactly these kinds of blocks, in order (`FamilySpec.with_blocks`);
    None where the family cannot build them."""
    spec = known_family(model)
    return None if spec is None or spec.with_blocks is None else spec.with_blocks(model, kinds)


def blocks_key(model: Any) -> str:
    """Where `block_count(model)` comes from, as a message names it."""
    spec = known_family(model)
    return "model.num_layers" if spec is None or spec.blocks is None else "the config's num_hidden_layers"


def experts_key(model: Any) -> str:
    """Where `routed_experts(model)` comes from, as a message names it."""
    spec = known_family(model)
    return "model.num_experts" if spec is None or spec.routed_experts is None else "the config's n_routed_experts"


def config_mtp_layers(model: Any) -> int:
    """The multi-token-prediction depth the `model` section's own config asks for (0: none, or a family without)."""
    spec = known_family(model)
    return 0 if spec is None or spec.mtp_layers is None else spec.mtp_layers(model)


def capabilities(name: str) -> Capabilities:
    """`family_spec(name).capabilities`; an unknown name has none (its `model.type` check reports it)."""
    try:
        return family_spec(name).capabilities
    except KeyError:
        return Capabilities()


def families_with(capability: str) -> str:
    """The registered families that have `capability` (a `Capabilities` field), as a message names them:
    "'internlm2'" or "'a' / 'b'"."""
    if capability not in {f.name for f in fields(Capabilities)}:
        raise ValueError(f"unknown capability {capability!r}")
    import_locations(MODELS)
    names = sorted(name for name, spec in MODELS.module_dict.items() if getattr(spec.capabilities, capability))
    return " / ".join(map(repr, names)) or "none"

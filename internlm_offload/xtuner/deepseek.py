"""XTuner v1's DeepSeek-V3 lineage as the native family, `model.type='deepseek_v3'` (model/families/deepseek_v3).

Mapped: `DeepSeekV3Config(...)` with `load_from` a folder of the lineage, and `get_model_config_from_hf(folder)` of
a DeepSeek-V3 / Kimi-K2 / GLM-4.5 / GLM-4.7-Flash folder (config.json's model_type one of the family's). With
`load_from` the model is that folder (`model.hf_path`: its architecture and weights; XTuner's class values give way
to config.json, as for every folder here); without it, config.json's architecture initialised at random
(`model.hf_config`), as XTuner initialises a model config without weights. XTuner's router bias update carries
(`model.router_bias_update_speed`), and so does its balancing loss (`BalancingLossConfig`, on by default in
`DeepSeekV3Config`, whose `from_hf` sets it too; off in GLM's): `balancing_loss_global_average` True / False ->
`model.balancing_loss` 'global_batch' / 'micro_batch', `balancing_loss_alpha` -> `loss.moe_loss_coeff`; and its
multi-token prediction: `model_cfg.mtp_config = MTPConfig(...)` onto `model.mtp_config` with the same names, and none
set onto `num_layers=0` (XTuner's `DeepSeekV3Config` and its `from_hf` build no MTP, whatever the folder's
`num_nextn_predict_layers`). What XTuner adds that the family does not compute is reported, one line each: a z-loss,
an MTP option other than those names; and so are its GPU-only kernel choices (FP8, the token dispatcher, the
sparse-attention backends, torch.compile), which change how a GPU computes the model, not what is trained.
"""

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.deepseek_v3 import MODEL_TYPES
from internlm_offload.weights.hf_folder import read_config
from internlm_offload.xtuner.models import FROM_HF, ModelClassError
from internlm_offload.xtuner.standins import field, kind

CLASS = "DeepSeekV3Config"
ROUTER_BIAS_UPDATE_SPEED = 0.001  # NoAuxRouterConfig's router_bias_update_speed
BALANCING_ALPHA = 0.001  # BalancingLossConfig's balancing_loss_alpha
# XTuner's MTPConfig fields, the same names under model.mtp_config (config/mtp.py)
MTP_FIELDS = ("num_layers", "share_weights", "loss_scaling_factor", "detach_mtp_inputs", "detach_mtp_lm_head_weight")
# MTPConfig fields that change nothing about the training here at these values (`name`: XTuner's label of the config)
MTP_NEUTRAL = {"mask_type": None, "loss_type": "ce"}
# config.json's model_types whose `get_model_config_from_hf` is XTuner's DeepSeekV3Config.from_hf, which sets
# BalancingLossConfig() (Kimi-K2's architecture is DeepSeek-V3's; XTuner trains it with that class).
BALANCED_BY_DEFAULT = ("deepseek_v3", "kimi_k2")
_UNSET = object()


@dataclass
class FamilyModel:
    """The `model` section, and the report's lines."""

    model: dict[str, Any]
    loss: dict[str, Any] = dataclass_field(default_factory=dict)  # the `loss` section's keys it sets
    carried: list[str] = dataclass_field(default_factory=list)
    dropped: list[str] = dataclass_field(default_factory=list)


def names_the_family(model_cfg: Any, load_from: Any) -> bool:
    """Whether XTuner's model config is the lineage's: `DeepSeekV3Config` with `load_from`, or
    `get_model_config_from_hf` of a folder of the family's model_types (a folder not readable is not)."""
    if kind(model_cfg) == CLASS:
        return load_from is not None
    return kind(model_cfg) == FROM_HF and _folder_type(model_cfg) in MODEL_TYPES


def family_model(model_cfg: Any, load_from: Any) -> FamilyModel:
    """The `model` section of an XTuner config that `names_the_family`; ModelClassError (or CheckpointError for an
    unreadable folder): the one report line."""
    name = kind(model_cfg)
    if load_from is not None:
        hf = read_config(Path(str(load_from)))
        if hf.get("model_type") not in MODEL_TYPES:
            raise ModelClassError(
                f"load_from={str(load_from)!r}: model_type={hf.get('model_type')!r}; model_cfg={name} maps onto "
                f"model.type='deepseek_v3', which builds {', '.join(MODEL_TYPES)}"
            )
        out = FamilyModel({"type": "deepseek_v3", "hf_path": str(load_from)})
        out.carried.append(
            f"model_cfg={name}, load_from -> model.type='deepseek_v3', model.hf_path (model_type="
            f"{hf['model_type']!r}: the folder's architecture and weights)"
        )
    else:
        folder = _folder(model_cfg)
        hf = read_config(folder)
        out = FamilyModel({"type": "deepseek_v3", "hf_config": hf})
        out.carried.append(
            f"model_cfg={FROM_HF}({str(folder)!r}) -> model.type='deepseek_v3', model.hf_config (model_type="
            f"{hf['model_type']!r}), initialised at random"
        )
    speed, source = bias_speed(model_cfg)
    out.model["router_bias_update_speed"] = speed
    out.carried.append(f"{source} -> model.router_bias_update_speed={speed:g} (the router bias, once a step)")
    _carry_balancing(out, model_cfg, hf.get("model_type"))
    out.model["mtp_config"], carried, dropped = mtp_section(field(model_cfg, "mtp_config"))
    out.carried.append(carried)
    out.dropped.extend(dropped)
    out.dropped.extend(_not_computed(model_cfg))
    return out


def mtp_section(mtp: Any, depth_key: str = "num_nextn_predict_layers") -> tuple[dict[str, Any], str, list[str]]:
    """`model.mtp_config` of XTuner's `mtp_config` (None: unset, no MTP), the carried line, and a dropped line for each
    MTPConfig option not built here; ModelClassError for one without `num_layers` (XTuner requires it). `depth_key`:
    config.json's MTP depth, which an unset one does not follow."""
    if mtp is None:
        unset = (
            "model_cfg.mtp_config unset -> model.mtp_config=dict(num_layers=0) (XTuner trains no multi-token "
            f"prediction without one, whatever the folder's {depth_key})"
        )
        return {"num_layers": 0}, unset, []
    section = {name: field(mtp, name) for name in MTP_FIELDS if field(mtp, name) is not None}
    if "num_layers" not in section:
        raise ModelClassError(f"model_cfg.mtp_config={_short(mtp)}: no num_layers (XTuner's MTPConfig requires it)")
    dropped = [
        f"model_cfg.mtp_config.{name}={value!r}: not built here (each depth's cross-entropy, as MTPConfig's defaults)"
        for name in _set_fields(mtp)
        if name not in (*MTP_FIELDS, "name", *_cross_entropy_only(mtp))
        and (value := field(mtp, name)) != MTP_NEUTRAL.get(name, _UNSET)
    ]
    return section, f"model_cfg.mtp_config={_short(mtp)} -> model.mtp_config={section}", dropped


def _cross_entropy_only(mtp: Any) -> tuple[str, ...]:
    """MTPConfig fields that change nothing while its loss is the cross-entropy (the TV objective's chunk size)."""
    return ("tv_loss_chunk_size",) if field(mtp, "loss_type") in (None, "ce") else ()


def _set_fields(obj: Any) -> list[str]:
    """The fields a config object was given: a recorded call's keywords, a real XTuner object's `model_fields_set`."""
    kwargs = getattr(obj, "kwargs", None)
    return list(kwargs) if isinstance(kwargs, dict) else sorted(getattr(obj, "model_fields_set", ()))


def bias_speed(model_cfg: Any) -> tuple[float, str]:
    """XTuner v1's bias update speed (`NoAuxRouterConfig.router_bias_update_speed`, 0.001 unless set; 0 with
    `freeze_routers`) and the field it came from."""
    if field(model_cfg, "freeze_routers", False):
        return 0.0, "model_cfg.freeze_routers=True"
    speed = field(field(model_cfg, "router"), "router_bias_update_speed")
    if speed is None:
        return ROUTER_BIAS_UPDATE_SPEED, "model_cfg.router.router_bias_update_speed (XTuner's default)"
    return float(speed), "model_cfg.router.router_bias_update_speed"


def balancing_cfg(model_cfg: Any, model_type: str | None) -> tuple[Any, str] | None:
    """XTuner's `BalancingLossConfig` of the model (the file's `balancing_loss_cfg`, else its class's default: on in
    DeepSeekV3Config, which `get_model_config_from_hf` of a DeepSeek-V3 folder returns) and where it comes from;
    None when XTuner adds no balancing loss. The class's default is returned as {} (every field XTuner's default)."""
    balancing = field(model_cfg, "balancing_loss_cfg", _UNSET)
    if balancing is not _UNSET:
        return None if balancing is None else (balancing, "model_cfg.balancing_loss_cfg")
    if kind(model_cfg) == CLASS or (kind(model_cfg) == FROM_HF and model_type in BALANCED_BY_DEFAULT):
        return {}, f"model_cfg.balancing_loss_cfg (unset: {kind(model_cfg)}'s default)"
    return None


def _carry_balancing(out: FamilyModel, model_cfg: Any, model_type: str | None) -> None:
    """XTuner's balancing loss onto `model.balancing_loss` and `loss.moe_loss_coeff` (alpha 0: no loss, as XTuner
    returns 0)."""
    found = balancing_cfg(model_cfg, model_type)
    if found is not None:
        carry_balancing(out, *found)


def carry_balancing(out: FamilyModel, balancing: Any, source: str) -> None:
    """XTuner's `BalancingLossConfig` `balancing` (read from `source`) onto `model.balancing_loss` and
    `loss.moe_loss_coeff`: `balancing_loss_global_average` True / False -> 'global_batch' / 'micro_batch',
    `balancing_loss_alpha` -> the coefficient (0: no loss, as XTuner returns 0)."""
    alpha = field(balancing, "balancing_loss_alpha")
    alpha = BALANCING_ALPHA if alpha is None else float(alpha)
    global_average = field(balancing, "balancing_loss_global_average")
    kind_name = "micro_batch" if global_average is False else "global_batch"
    if alpha == 0:
        out.carried.append(f"{source}: balancing_loss_alpha=0 -> no model.balancing_loss (XTuner adds 0)")
        return
    out.model["balancing_loss"] = kind_name
    out.loss["moe_loss_coeff"] = alpha
    out.carried.append(
        f"{source} (balancing_loss_alpha={alpha:g}, balancing_loss_global_average={global_average is not False}) -> "
        f"model.balancing_loss={kind_name!r}, loss.moe_loss_coeff={alpha:g}"
    )


def _not_computed(model_cfg: Any) -> list[str]:
    """What XTuner's model config adds to the training that the native family does not compute, one line each;
    then its GPU-only kernels (`gpu_only_kernels`)."""
    lines = []
    if field(model_cfg, "z_loss_cfg") is not None:
        lines.append("model_cfg.z_loss_cfg: XTuner's router z-loss is not computed by model.type='deepseek_v3'")
    return lines + gpu_only_kernels(model_cfg)


def gpu_only_kernels(model_cfg: Any) -> list[str]:
    """XTuner's kernel choices on the model config, one line each: they pick how a GPU computes the same model
    (FP8 GEMMs, DeepEP's dispatch, tilelang's sparse attention, torch.compile), not what is trained."""
    lines = []
    float8 = field(model_cfg, "float8_cfg")
    if float8 is not None:
        lines.append(
            f"model_cfg.float8_cfg={_short(float8)}: FP8 GEMMs are GPU-only (Hopper and newer); this trainer computes "
            "in model.dtype (bf16) with fp32 masters"
        )
    dispatcher = field(model_cfg, "dispatcher")
    if dispatcher is not None:
        lines.append(
            f"model_cfg.dispatcher={dispatcher!r}: XTuner's token dispatch backends (DeepEP, its all2all kernels) are "
            "GPU-only; expert parallel here sends tokens with torch's all_to_all_single over parallel.expert.size"
        )
    if field(model_cfg, "compile_cfg") not in (None, False):
        lines.append("model_cfg.compile_cfg: XTuner's torch.compile of its model does not apply to the native model")
    attention = field(model_cfg, "attention")
    for name in ("sparse_mla_backend", "indexer_backend", "indexer_topk_query_chunk_size"):
        value = field(attention, name) if attention is not None else None
        if value is not None and not getattr(value, "implicit", False):
            lines.append(
                f"model_cfg.attention.{name}={_short(value)}: XTuner's sparse-attention kernels (tilelang, "
                "DeepGEMM, FlashMLA) are GPU-only; sparse attention here is torch's, in query chunks"
            )
    return lines


def _folder(model_cfg: Any) -> Path:
    """get_model_config_from_hf's folder (its first argument, or `model_path=`)."""
    return Path(str(model_cfg.args[0] if model_cfg.args else field(model_cfg, "model_path")))


def _folder_type(model_cfg: Any) -> str | None:
    try:
        return read_config(_folder(model_cfg)).get("model_type")
    except (CheckpointError, AttributeError, TypeError):  # no folder, no config.json, not a recorded call
        return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

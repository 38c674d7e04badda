"""XTuner v1's Qwen3.5 models as the native family, `model.type='qwen3_next'` (model/families/qwen3_next).

Mapped: XTuner's Qwen3.5 text config classes (`Qwen3_5_VLTextMoE35BA3BConfig`, `Qwen3_5_VLTextMoEConfig`) and its
vision-language class `Qwen3_5_VLMoE35BA3Config` (its `text_config` is the text class; `only_llm_forward` trains the
text model alone) with `load_from` a folder of the family (config.json's model_type `qwen3_5_moe_text`,
`qwen3_5_text`, `qwen3_next`, or the released vision-language `qwen3_5_moe` / `qwen3_5`, whose text model the family
builds), and `get_model_config_from_hf(folder)` of such a folder. With `load_from` the model is that folder
(`model.hf_path`; XTuner's class values give way to config.json, as for every folder here; a vision-language folder's
vision tower not read, copied through on export); without it, config.json's text model initialised at random
(`model.hf_config`: a vision-language folder's `text_config`).

XTuner's balancing loss (`BalancingLossConfig`, on by default in the Qwen3.5 MoE classes) carries as for the DeepSeek
lineage: `balancing_loss_global_average` True / False -> `model.balancing_loss` 'global_batch' / 'micro_batch',
`balancing_loss_alpha` -> `loss.moe_loss_coeff` (XTuner's formula over the softmax router: model/balancing.py). What
XTuner adds that the family does not compute is reported: a z-loss. Multi-token prediction (`mtp_config`) carries onto
`model.mtp_config` as the DeepSeek lineage's does (`mtp_section`: unset, none); more than one physical MTP layer
(`num_layers` > 1 without `share_weights`) stops in one line, as the family builds one (the folder's `mtp.fc` and
`mtp.layers.0`). Its GPU-only kernel choices (FP8, the token dispatcher, torch.compile) are reported as for the
DeepSeek lineage.
"""

from pathlib import Path
from typing import Any

from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.qwen3_next import CAUSAL_LMS, MTP_LAYERS_KEY, VISION_LANGUAGE, text_config
from internlm_offload.weights.hf_folder import read_config
from internlm_offload.xtuner.deepseek import FamilyModel, carry_balancing, gpu_only_kernels, mtp_section
from internlm_offload.xtuner.models import FROM_HF, ModelClassError
from internlm_offload.xtuner.standins import field, kind

TEXT_CLASSES = ("Qwen3_5_VLTextMoE35BA3BConfig", "Qwen3_5_VLTextMoEConfig")
VISION_CLASSES = ("Qwen3_5_VLMoE35BA3Config",)  # a vision tower around one of TEXT_CLASSES (`text_config`)
MODEL_TYPES = tuple(CAUSAL_LMS)  # what model.type='qwen3_next' builds
TYPE = "qwen3_next"
_UNSET = object()


def names_the_family(model_cfg: Any, load_from: Any) -> bool:
    """Whether XTuner's model config is a Qwen3.5 one: a Qwen3.5 class with `load_from`, or `get_model_config_from_hf`
    of a folder of the family's model_types (a Qwen3.5 vision-language folder among them: its text model)."""
    if kind(model_cfg) in (*TEXT_CLASSES, *VISION_CLASSES):
        return load_from is not None
    return kind(model_cfg) == FROM_HF and _folder_type(model_cfg) in (*MODEL_TYPES, *VISION_LANGUAGE)


def family_model(model_cfg: Any, load_from: Any) -> FamilyModel:
    """The `model` section of an XTuner config that `names_the_family`; ModelClassError (or CheckpointError for an
    unreadable folder): the one report line."""
    name = kind(model_cfg)
    text_cfg = field(model_cfg, "text_config") if name in VISION_CLASSES else model_cfg
    if load_from is not None:
        hf = _text_folder(Path(str(load_from)), f"load_from={str(load_from)!r}", name)
        out = FamilyModel({"type": TYPE, "hf_path": str(load_from)})
        tower = (
            "; its text model trains, the vision tower is not read and an --hf export copies it through"
            if hf["model_type"] in VISION_LANGUAGE
            else ""
        )
        out.carried.append(
            f"model_cfg={name}, load_from -> model.type={TYPE!r}, model.hf_path (model_type={hf['model_type']!r}: "
            f"the folder's architecture and weights{tower})"
        )
    else:
        folder = Path(str(model_cfg.args[0] if model_cfg.args else field(model_cfg, "model_path")))
        raw = _text_folder(folder, f"{FROM_HF}({str(folder)!r})", name)
        hf = text_config(raw)
        out = FamilyModel({"type": TYPE, "hf_config": hf})
        of = f": the text_config of its {raw['model_type']!r}" if hf is not raw else ""
        out.carried.append(
            f"model_cfg={FROM_HF}({str(folder)!r}) -> model.type={TYPE!r}, model.hf_config (model_type="
            f"{hf['model_type']!r}{of}), initialised at random"
        )
    if name in VISION_CLASSES:
        out.carried.append(_only_llm(model_cfg))
    _carry_mtp(text_cfg, out)
    if hf.get("model_type") == "qwen3_5_text":  # dense: no router to balance
        out.carried.append("model_cfg.balancing_loss_cfg: the folder (qwen3_5_text) has no experts: no balancing loss")
    else:
        _carry_balancing(text_cfg, name, out)
    out.dropped.extend(_not_computed(text_cfg))
    out.dropped.extend(gpu_only_kernels(text_cfg))
    if text_cfg is not model_cfg and field(model_cfg, "compile_cfg") not in (None, False):
        out.dropped.append(
            "model_cfg.compile_cfg: XTuner's torch.compile of its model does not apply to the native model"
        )
    return out


def _text_folder(folder: Path, where: str, name: str) -> dict[str, Any]:
    """config.json of a folder of the family (a vision-language folder's: its text model is what builds);
    ModelClassError naming what is built for any other."""
    hf = read_config(folder)
    model_type = hf.get("model_type")
    if model_type in (*MODEL_TYPES, *VISION_LANGUAGE):
        return hf
    raise ModelClassError(
        f"{where}: model_type={model_type!r}; model_cfg={name} maps onto model.type={TYPE!r}, which builds the "
        f"folders {', '.join((*MODEL_TYPES, *VISION_LANGUAGE))} (of a vision-language one, its text model)"
    )


def _only_llm(model_cfg: Any) -> str:
    """The vision-language class's `only_llm_forward`: the text model alone either way here."""
    only_llm = field(model_cfg, "only_llm_forward")
    return (
        f"model_cfg.only_llm_forward={only_llm!r}: the text model (text_config) alone trains here (no vision tower is "
        "built; a vision-language folder's is copied through on --hf export)"
    )


def _carry_mtp(text_cfg: Any, out: FamilyModel) -> None:
    """XTuner's multi-token prediction onto `model.mtp_config` (`mtp_section`: unset, none); ModelClassError for more
    than one physical layer (the family builds the folder's one)."""
    section, carried, dropped = mtp_section(field(text_cfg, "mtp_config"), MTP_LAYERS_KEY)
    layers = section["num_layers"]
    if layers > 1 and not section.get("share_weights", False):
        raise ModelClassError(
            f"model_cfg.mtp_config.num_layers={layers} with share_weights=False: {layers} MTP layers, but "
            f"model.type={TYPE!r} builds one (a Qwen3.5 folder holds one mtp.fc and mtp.layers.0); set "
            "share_weights=True (one layer at every depth) or num_layers=1"
        )
    out.model["mtp_config"] = section
    out.carried.append(carried)
    out.dropped.extend(dropped)


def _carry_balancing(text_cfg: Any, name: str, out: FamilyModel) -> None:
    """XTuner's balancing loss (`BalancingLossConfig`, the Qwen3.5 MoE classes' default; set in the file for
    `get_model_config_from_hf`) onto `model.balancing_loss` / `loss.moe_loss_coeff` (XTuner's formula over a softmax
    router: model/balancing.py)."""
    balancing = field(text_cfg, "balancing_loss_cfg", _UNSET)
    if balancing is _UNSET and name != FROM_HF:
        carry_balancing(out, {}, "model_cfg.balancing_loss_cfg (unset: the class's default BalancingLossConfig())")
    elif balancing not in (None, _UNSET):
        carry_balancing(out, balancing, "model_cfg.balancing_loss_cfg")


def _not_computed(text_cfg: Any) -> list[str]:
    """XTuner's losses the family does not compute, one line each (as the DeepSeek lineage reports a z-loss)."""
    if field(text_cfg, "z_loss_cfg") is not None:
        return [f"model_cfg.z_loss_cfg: XTuner's router z-loss is not computed by model.type={TYPE!r}"]
    return []


def _folder_type(model_cfg: Any) -> str | None:
    """config.json's model_type of get_model_config_from_hf's folder; None where there is none to read."""
    try:
        folder = model_cfg.args[0] if model_cfg.args else field(model_cfg, "model_path")
        return read_config(Path(str(folder))).get("model_type")
    except (CheckpointError, AttributeError, TypeError, IndexError):
        return None

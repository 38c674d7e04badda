"""An XTuner v1 `TrainerConfig` mapped onto this trainer's config schema, with a report of what did not carry.

Every field of the trainer has one of three fates, as in `internevo.py`: carried (same meaning under this
trainer's key), dropped (no counterpart here; the report says why and what changes), or fatal (the run would
not be the same training: another optimizer, no data, no steps, a model only XTuner can build); any fatal
problem makes the translation fail. XTuner's defaults (`xtuner/v1/config/*.py`) fill what a config leaves out.
The model comes from `load_from`'s Hugging Face folder: InternLM2, InternLM and Llama folders load into the
native model, others train as `hf_causal_lm` (experts balanced by a router bias with the bias moved as XTuner moves
it, `model.router_bias_update_speed`), except families XTuner trains in a way not built here (vision-language models,
multi-token prediction outside the `deepseek_v3` family): those are fatal, named. XTuner's DeepSeek-V3 lineage (`DeepSeekV3Config` with `load_from`,
or `get_model_config_from_hf` of a DeepSeek-V3 / Kimi-K2 / GLM-4.5 / GLM-4.7-Flash folder) maps onto the native
`deepseek_v3` family (`deepseek.py`), XTuner's GPT-OSS configs onto the native `gpt_oss` family (`gpt_oss.py`), XTuner's
Qwen3.5 classes (and `get_model_config_from_hf` of a Qwen3.5 / Qwen3-Next text folder) onto `qwen3_next` (`qwen3_5.py`).
Without `load_from`, XTuner's Qwen3 / Qwen3-MoE model classes and
`get_model_config_from_hf` map onto the native model, initialised at random (`models.py`).
"""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from internlm_offload.config import ConfigError, resolve_config
from internlm_offload.errors import CheckpointError, DataError
from internlm_offload.family import check_run
from internlm_offload.model.families.internlm2.hf_config import native_model_values
from internlm_offload.model.families.internlm2.hf_names import DENSE_TABLES
from internlm_offload.weights.hf_folder import read_config
from internlm_offload.xtuner import qwen3_5
from internlm_offload.xtuner.deepseek import bias_speed, family_model, names_the_family
from internlm_offload.xtuner.gpt_oss import gpt_oss_model, names_gpt_oss
from internlm_offload.xtuner.models import ModelClassError, model_from_xtuner
from internlm_offload.xtuner.standins import Recorded, field, kind

# XTuner v1's defaults for the fields read here (xtuner/v1/config/optim.py, fsdp.py, loss; datasets/config.py).
ADAMW_DEFAULTS = {"lr": 1e-5, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01, "max_grad_norm": 1.0}
# xtuner/v1/config/optim.py MuonConfig's (docs/optimizer_offload.md, Muon); its adjust_lr -> torch's adjust_lr_fn
MUON_DEFAULTS = {**ADAMW_DEFAULTS, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "adjust_lr": "rms_norm"}
MUON_ADJUST_LR = {"rms_norm": "match_rms_adamw", "spectral_norm": "original"}
MUON_NOT_CARRIED = {
    "flatten": "stacked experts [E, out, in] are orthogonalised per expert here, MLA's row blocks apart",
    "use_triton": "Newton-Schulz is torch's matmuls here",
    "enable_all2all": "Muon all-gathers each sharded matrix to every rank here (no owner-per-matrix all-to-all)",
}
LR_DEFAULTS = {"lr_type": "constant", "warmup_ratio": 0.03, "lr_min": 1e-6}
FSDP_DEFAULTS = {"recompute_ratio": 1.0, "cpu_offload": False, "tp_size": 1, "ep_size": 1}
PACK_MAX_LENGTH = 32768
_UNSET = object()
ACTIVATION_OFFLOAD_ENV = "XTUNER_ACTIVATION_OFFLOAD"

# TrainerConfig fields that change nothing about what is trained, and why they are not carried.
NOT_CARRIED = {
    "hf_interval": "export Hugging Face folders with `python -m internlm_offload.tools.export CKPT OUT --hf`",
    "hf_max_keep": "see hf_interval",
    "profile_time": "monitor.profile_step's trace has the times of every operator",
    "profile_memory": "metrics.jsonl has the memory of every step",
    "intra_layer_micro_batch": "no intra-layer micro-batching here",
    "hooks_config": "XTuner's hooks do not run here",
    "grad_norm_dtype": "the gradient norm is computed in fp32 here",
    "log_dir": "logs go to --work-dir",
    "resume_cfg": "resume with --resume or ckpt.auto_resume",
    "load_checkpoint_cfg": "resume with --resume or ckpt.auto_resume",
    "strict_load": "weights load strictly here",
}


# Values of those fields that change nothing even there (XTuner's defaults that turn a feature off).
NEUTRAL = {
    "intra_layer_micro_batch": 1,
    "profile_memory": False,
    "strict_load": True,
}


@dataclass
class Translation:
    """This trainer's config, and the report: carried fields, dropped ones with why, fatal problems."""

    config: dict[str, Any] = dataclass_field(default_factory=dict)
    carried: list[str] = dataclass_field(default_factory=list)
    dropped: list[str] = dataclass_field(default_factory=list)
    fatal: list[str] = dataclass_field(default_factory=list)

    def set(self, section: str, key: str, value: Any) -> None:
        (self.config.setdefault(section, {}) if section else self.config)[key] = value


def translate_trainer(trainer: Any, source: Path) -> Translation:
    """The whole mapping of one `TrainerConfig`."""
    t = Translation()
    _model(t, trainer)
    _optimizer(t, trainer)
    _schedule(t, trainer)
    _fsdp(t, trainer)
    _data(t, trainer)
    _loss(t, trainer)
    _sequence_parallel(t, trainer)
    _check_layout(t)
    _run(t, trainer, source)
    for name, why in NOT_CARRIED.items():
        value = field(trainer, name)
        if value not in (None, False, {}, []) and value != NEUTRAL.get(name):  # unset, off or XTuner's "off"
            t.dropped.append(f"{name}={short(value)}: {why}")
    return t


def _model(t: Translation, trainer: Any) -> None:
    load_from, model_cfg = field(trainer, "load_from"), field(trainer, "model_cfg")
    if names_the_family(model_cfg, load_from):
        _family_model(t, trainer, model_cfg, load_from)
        return
    if names_gpt_oss(model_cfg, load_from):
        _family_model(t, trainer, model_cfg, load_from, gpt_oss_model)
        return
    if qwen3_5.names_the_family(model_cfg, load_from):  # Qwen3.5 / Qwen3-Next (qwen3_5.py)
        _family_model(t, trainer, model_cfg, load_from, qwen3_5.family_model)
        return
    if load_from is None:
        _model_class(t, trainer)
        return
    hf = model_from_folder(t, str(load_from), "load_from", field(model_cfg, "mtp_config"), bias_speed(model_cfg))
    if hf is None:
        return
    if _router_bias(hf):
        _balancing_loss(t, model_cfg, hf)
    if field(trainer, "model_cfg") is not None:
        t.carried.append("model_cfg -> read from load_from's config.json (its class is XTuner's)")
    tokenizer = field(trainer, "tokenizer_path") or load_from
    t.set("data", "tokenizer", str(tokenizer))


def _family_model(
    t: Translation, trainer: Any, model_cfg: Any, load_from: Any, mapping: Callable[[Any, Any], Any] = family_model
) -> None:
    """XTuner's model config as a native family (`mapping`: the DeepSeek-V3 lineage's, `deepseek.py`, GPT-OSS's,
    `gpt_oss.py`, or Qwen3.5's, `qwen3_5.py`); the tokenizer as for any model."""
    try:
        mapped = mapping(model_cfg, load_from)
    except (ModelClassError, CheckpointError) as exc:
        t.fatal.append(f"model_cfg={short(model_cfg)}: {exc}")
        return
    t.config["model"] = {**mapped.model, **t.config.get("model", {})}
    if mapped.loss:
        t.config["loss"] = {**t.config.get("loss", {}), **mapped.loss}
    t.carried.extend(mapped.carried)
    t.dropped.extend(mapped.dropped)
    tokenizer = field(trainer, "tokenizer_path") or load_from
    if tokenizer is None:
        t.fatal.append("tokenizer_path: needed without load_from (a local Hugging Face tokenizer folder)")
    else:
        t.set("data", "tokenizer", str(tokenizer))


def model_from_folder(
    t: Translation, load_from: str, key: str, mtp: Any = None, bias_speed: tuple[float, str] = (0.0, "")
) -> dict[str, Any] | None:
    """The model of a local Hugging Face folder (`key` names where the config gave it): the native decoder with
    its weights via ckpt.load_ckpt_info, or hf_causal_lm; its config.json, or None (a fatal line added).
    `bias_speed`: for routers with a bias (DeepSeek-V3's noaux_tc), how fast the trainer moves it and where that
    comes from (model.router_bias_update_speed)."""
    folder = Path(load_from)
    try:
        hf = read_config(folder)
    except Exception as exc:  # a missing or broken folder: CheckpointError names it
        t.fatal.append(f"{key}={load_from!r}: {exc}")
        return None
    unbuilt = _not_built_here(hf, mtp)
    if unbuilt:
        t.fatal.append(f"{key}={load_from!r}: {unbuilt}")
        return None
    try:
        native = native_model_values(hf)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a config.json missing a size
        t.fatal.append(f"{key}={load_from!r}: config.json lacks a usable {exc}")
        return None
    if native is None:
        t.set("model", "type", "hf_causal_lm")
        t.set("model", "hf_path", str(folder))
        t.carried.append(f"{key} -> model.hf_path (model_type={hf.get('model_type')!r} trains as hf_causal_lm)")
        if _router_bias(hf):
            speed, source = bias_speed
            t.set("model", "router_bias_update_speed", speed)
            t.carried.append(f"{source} -> model.router_bias_update_speed={speed:g} (the router bias, once a step)")
    else:
        t.config["model"] = {"type": "internlm2", **native, **t.config.get("model", {})}
        t.set("ckpt", "load_ckpt_info", {"path": str(folder), "content": ("model",), "ckpt_type": "hf"})
        t.carried.append(f"{key} -> the native model ({hf.get('model_type')}), weights via ckpt.load_ckpt_info")
    return hf


def _model_class(t: Translation, trainer: Any) -> None:
    """No load_from: the architecture is XTuner's model config (a Qwen3 class or a folder's config.json), the
    weights initialised at random, as XTuner does."""
    model_cfg = field(trainer, "model_cfg")
    if model_cfg is None:
        t.fatal.append("neither model_cfg nor load_from: the run has no model")
        return
    try:
        model, loss, carried = model_from_xtuner(model_cfg)
    except (ModelClassError, CheckpointError) as exc:
        t.fatal.append(f"model_cfg={short(model_cfg)} without load_from: {exc}")
        return
    t.config["model"] = {**model, **t.config.get("model", {})}
    if loss:
        t.config["loss"] = {**t.config.get("loss", {}), **loss}
        carried.append(f"balancing_loss_cfg.balancing_loss_alpha -> loss.moe_loss_coeff={loss['moe_loss_coeff']}")
    t.carried.extend(carried)
    tokenizer = field(trainer, "tokenizer_path")
    if tokenizer is None:
        t.fatal.append("tokenizer_path: needed without load_from (a local Hugging Face tokenizer folder)")
    else:
        t.set("data", "tokenizer", str(tokenizer))


def _not_built_here(hf: dict[str, Any], mtp: Any) -> str | None:
    """Why XTuner's model of this config.json would not train the same here, naming the family; None if it would."""
    reasons = []
    if "vision_config" in hf:
        reasons.append("it is a vision-language model (only text models are built here)")
    if mtp is not None:
        reasons.append(
            "model_cfg.mtp_config trains multi-token prediction, built here for model.type='deepseek_v3' "
            "(DeepSeek-V3 / Kimi-K2 / GLM-4.5 / GLM-4.7-Flash folders) and 'qwen3_next' (Qwen3-Next / Qwen3.5 text "
            "folders) alone, not for this one"
        )
    if not reasons:
        return None
    family = f"model_type={hf.get('model_type')!r}" + "".join(f" ({a})" for a in (hf.get("architectures") or [])[:1])
    return (
        f"{family} is not built here: {'; '.join(reasons)}. Built here: {', '.join(DENSE_TABLES)} (native), and "
        "as hf_causal_lm dense causal LMs and mixtures of experts with a router aux loss (Mixtral, Qwen2/3-MoE) or a "
        "router bias (DeepSeek-V3, GLM-4.5/5)"
    )


def _router_bias(hf: dict[str, Any]) -> bool:
    """DeepSeek-V3's noaux_tc router (deepseek_v3, deepseek_v32, glm4_moe, glm4_moe_lite, glm_moe_dsa): experts
    picked with an `e_score_correction_bias` that XTuner moves each step."""
    return bool(hf.get("n_routed_experts")) and hf.get("topk_method", "noaux_tc") == "noaux_tc"


def _balancing_loss(t: Translation, model_cfg: Any, hf: dict[str, Any]) -> None:
    """XTuner adds its balancing loss to DeepSeekV3Config's routers by default; transformers' model has none."""
    balancing = field(model_cfg, "balancing_loss_cfg", _UNSET)
    if balancing is None or (balancing is _UNSET and kind(model_cfg) != "DeepSeekV3Config"):
        return
    t.dropped.append(
        f"model_cfg.balancing_loss_cfg: XTuner's balancing loss is not added to {hf.get('model_type')}'s routers "
        "here (transformers' model has none); the router bias alone balances the experts"
    )


def _optimizer(t: Translation, trainer: Any) -> None:
    optim = field(trainer, "optim_cfg")
    if optim is not None and kind(optim) == "MuonConfig":
        _muon(t, trainer, optim)
        return
    if optim is None or kind(optim) != "AdamWConfig":
        t.fatal.append(f"optim_cfg={short(optim)}: only AdamWConfig and MuonConfig map here")
        return
    lr, (beta1, beta2) = _get(optim, "lr", ADAMW_DEFAULTS), _get(optim, "betas", ADAMW_DEFAULTS)
    t.config["adam"] = {
        "lr": float(lr),
        "adam_beta1": float(beta1),
        "adam_beta2": float(beta2),
        "adam_eps": float(_get(optim, "eps", ADAMW_DEFAULTS)),
        "weight_decay": float(_get(optim, "weight_decay", ADAMW_DEFAULTS)),
    }
    clip = float(_get(optim, "max_grad_norm", ADAMW_DEFAULTS)) if field(trainer, "do_clip", True) else 0.0
    t.set("hybrid_zero_optimizer", "clip_grad_norm", clip)
    t.carried.append("optim_cfg (AdamWConfig: lr, betas, eps, weight_decay, max_grad_norm) -> adam, clip_grad_norm")
    if field(optim, "swap_optimizer", False):
        t.config["swap_optimizer"] = True
        t.carried.append("optim_cfg.swap_optimizer -> swap_optimizer (chunked and overlapped here)")
    if field(optim, "skip_grad_norm_threshold") is not None:
        t.dropped.append(
            f"optim_cfg.skip_grad_norm_threshold={field(optim, 'skip_grad_norm_threshold')}: steps are skipped "
            "here only when the gradient norm is not finite"
        )
    if field(optim, "foreach") is not None:
        t.dropped.append("optim_cfg.foreach: the AdamW kernel is chosen here (adam.fused)")


def _muon(t: Translation, trainer: Any, optim: Any) -> None:
    """MuonConfig: one lr and weight decay for Muon's matrices and AdamW's rest (XTuner's split is this trainer's
    `optimizer.type='muon'`), betas for AdamW, eps for both (XTuner's NS normalisation and AdamW)."""
    (beta1, beta2), eps = _get(optim, "betas", MUON_DEFAULTS), float(_get(optim, "eps", MUON_DEFAULTS))
    t.config["adam"] = {
        "lr": float(_get(optim, "lr", MUON_DEFAULTS)),
        "adam_beta1": float(beta1),
        "adam_beta2": float(beta2),
        "adam_eps": eps,
        "weight_decay": float(_get(optim, "weight_decay", MUON_DEFAULTS)),
    }
    adjust = _get(optim, "adjust_lr", MUON_DEFAULTS)
    if adjust not in MUON_ADJUST_LR:
        t.fatal.append(f"optim_cfg.adjust_lr={adjust!r}: Muon's lr adjustments here are {sorted(MUON_ADJUST_LR)}")
        return
    muon = {
        "momentum": float(_get(optim, "momentum", MUON_DEFAULTS)),
        "nesterov": bool(_get(optim, "nesterov", MUON_DEFAULTS)),
        "eps": eps,
        "adjust_lr_fn": MUON_ADJUST_LR[adjust],
        "clip_grad": False,  # XTuner's Muon groups carry clip_grad=False: counted in the norm, not scaled
    }
    t.config["optimizer"] = {"type": "muon", "muon": muon}
    clip = float(_get(optim, "max_grad_norm", MUON_DEFAULTS)) if field(trainer, "do_clip", True) else 0.0
    t.set("hybrid_zero_optimizer", "clip_grad_norm", clip)
    t.carried.append(
        "optim_cfg (MuonConfig: lr, weight_decay, betas, eps, momentum, nesterov, adjust_lr, max_grad_norm) -> "
        "optimizer.type='muon', optimizer.muon, adam, clip_grad_norm (XTuner's classic momentum mu*B + g is torch's "
        "EMA scaled by 1/(1 - mu): the same orthogonalised update; Muon's gradients counted in the clipping norm but "
        "not scaled, as XTuner: optimizer.muon.clip_grad=False)"
    )
    t.dropped.append(
        "optim_cfg (MuonConfig) Newton-Schulz: XTuner runs five distinct coefficient triples, here torch's one "
        "(3.4445, -4.775, 2.0315) five times (the same lr moves weights ~5-8 % less)"
    )
    if adjust == "spectral_norm":
        t.dropped.append("optim_cfg.adjust_lr='spectral_norm': sqrt(A / B) there, sqrt(max(1, A / B)) here")
    for name, why in MUON_NOT_CARRIED.items():
        if field(optim, name) is not None:
            t.dropped.append(f"optim_cfg.{name}={field(optim, name)!r}: {why}")


def _schedule(t: Translation, trainer: Any) -> None:
    lr = field(trainer, "lr_cfg")
    lr_type = _get(lr, "lr_type", LR_DEFAULTS)
    warmup, lr_min = float(_get(lr, "warmup_ratio", LR_DEFAULTS)), float(_get(lr, "lr_min", LR_DEFAULTS))
    t.config["lr_scheduler"] = {"type": lr_type, "eta_min": lr_min}
    t.config["lr_scheduler"]["warmup_ratio"] = warmup  # >= 1 (XTuner: steps) is resolved in _run
    t.carried.append("lr_cfg (lr_type, warmup_ratio, lr_min) -> lr_scheduler (type, warmup_ratio, eta_min)")


def _fsdp(t: Translation, trainer: Any) -> None:
    fsdp = field(trainer, "fsdp_cfg")
    ratio = float(_get(fsdp, "recompute_ratio", FSDP_DEFAULTS))
    t.set("model", "checkpoint", ratio)
    t.set("model", "dtype", "torch.bfloat16")  # XTuner computes in bf16 over fp32 sharded params (param_dtype)
    t.set("parallel", "mode", "fsdp2")
    t.carried.append(
        "fsdp_cfg.recompute_ratio -> model.checkpoint; FSDP with bf16 compute -> parallel.mode='fsdp2', "
        "model.dtype='torch.bfloat16' with fp32 masters"
    )
    if _get(fsdp, "cpu_offload", FSDP_DEFAULTS):
        t.set("parallel", "fsdp_cpu_offload", True)
        t.carried.append("fsdp_cfg.cpu_offload -> parallel.fsdp_cpu_offload (FSDP2's CPUOffloadPolicy)")
    tp, ep = int(_get(fsdp, "tp_size", FSDP_DEFAULTS)), int(_get(fsdp, "ep_size", FSDP_DEFAULTS))
    if tp > 1:
        t.set("parallel", "tensor", {"size": tp, "mode": "mtp"})
        t.carried.append(
            f"fsdp_cfg.tp_size={tp} -> parallel.tensor (size {tp}, mode 'mtp': Megatron's column/row split)"
        )
    if ep > 1:
        t.set("parallel", "expert", {"size": ep})
        t.carried.append(f"fsdp_cfg.ep_size={ep} -> parallel.expert.size={ep} (each rank holds 1/{ep} of the experts)")
    for name in ("torch_compile", "float8_cfg", "hsdp_sharding_size", "fp32_lm_head"):
        if field(fsdp, name) not in (None, False):
            t.dropped.append(f"fsdp_cfg.{name}={short(field(fsdp, name))}: not used here")
    if field(fsdp, "reshard_after_forward") is False:
        t.set("parallel", "reshard_after_forward", False)
    offload = os.environ.get(ACTIVATION_OFFLOAD_ENV, "0").lower() in ("1", "true", "yes")
    layers = _num_layers(t.config.get("model", {}))
    if offload and layers:
        t.config["cpu_offloading"] = {"enable": True, "num_layers": layers - 1}
        t.carried.append(
            f"{ACTIVATION_OFFLOAD_ENV}=1 -> cpu_offloading.num_layers={layers - 1}: here the first blocks offload all "
            "their saved activations (dense models too) instead of recomputing from an offloaded input"
        )
    elif offload and "model" in t.config:
        t.dropped.append(f"{ACTIVATION_OFFLOAD_ENV}=1: the model's block count is not known here; set cpu_offloading")


def _num_layers(model: dict[str, Any]) -> int | None:
    """The model's blocks: `num_layers`, or config.json's `num_hidden_layers` (`model.hf_config`'s or
    `model.hf_path`'s)."""
    if model.get("num_layers"):
        return model["num_layers"]
    try:
        hf = model.get("hf_config") or (read_config(Path(model["hf_path"])) if model.get("hf_path") else {})
    except CheckpointError:
        return None
    layers = hf.get("num_hidden_layers")
    return layers if isinstance(layers, int) else None


def _data(t: Translation, trainer: Any) -> None:
    loader = field(trainer, "dataloader_cfg")
    datasets = field(trainer, "dataset_cfg") or field(loader, "dataset_config_list") or []
    paths, max_lengths, chat = [], [], False
    for entry in datasets:
        dataset, tokenize = field(entry, "dataset"), field(entry, "tokenize_fn")
        anno = field(dataset, "anno_path")
        if anno is None:
            t.fatal.append(f"dataset {short(dataset)}: no anno_path")
            continue
        paths.append(str(anno))
        if field(dataset, "sample_ratio", 1.0) != 1.0:
            t.dropped.append(
                f"{anno}: sample_ratio={field(dataset, 'sample_ratio')}: every line is read once per epoch"
            )
        if kind(tokenize) == "OpenaiTokenizeFunctionConfig":
            chat = True
            max_lengths.append(field(tokenize, "max_length"))
            template = field(tokenize, "chat_template")
            if template is not None:
                t.dropped.append(
                    f"{anno}: chat_template={template!r}: the tokenizer's own chat template renders the messages "
                    "here (XTuner's string templates mask the separator after a reply; here it is trained with it)"
                )
        elif kind(tokenize) != "PretrainTokenizeFunctionConfig":
            t.fatal.append(f"{anno}: tokenize_fn={short(tokenize)}: chat (Openai) and pretrain data map here")
        elif field(tokenize, "add_bos_token", False) or not field(tokenize, "add_eos_token", True):
            t.dropped.append(f"{anno}: add_bos_token / add_eos_token: documents get eos and no bos here")
    if not paths:
        t.fatal.append("no dataset (dataset_cfg or dataloader_cfg.dataset_config_list)")
        return
    pack = int(field(loader, "pack_max_length", PACK_MAX_LENGTH))
    t.config["data"] = {**t.config.get("data", {}), "type": "chat" if chat else "text", "paths": paths}
    t.config["data"].update(seq_len=pack, micro_bsz=1)
    if chat and any(max_lengths):
        t.config["data"]["max_length"] = min(pack, max(m for m in max_lengths if m))
    t.carried.append(
        f"datasets -> data.type={t.config['data']['type']!r}, data.paths; dataloader_cfg.pack_max_length -> "
        "data.seq_len (one pack per micro-batch, conversations kept apart)"
    )
    batch = field(trainer, "global_batch_size")
    if batch is not None:
        t.config["data"]["global_bsz"] = int(batch)
        t.carried.append("global_batch_size (packs per step) -> data.global_bsz")


def _loss(t: Translation, trainer: Any) -> None:
    loss = field(trainer, "loss_cfg")
    if loss is None:
        return
    mode = field(loss, "mode")
    if mode == "chunk":
        t.carried.append(
            f"loss_cfg.mode='chunk' (chunk_size={field(loss, 'chunk_size', 1024)}): the loss here is chunked already "
            "(engine/loss.py: rows of up to 256 MiB of fp32 logits at a time, each chunk's log-softmax recomputed in "
            "backward), the chunk sized by bytes, not tokens"
        )
    elif mode not in (None, "eager"):
        t.dropped.append(f"loss_cfg.mode={mode!r}: the loss here is one chunked cross-entropy over the logits")
    if field(loss, "loss_reduction") not in (None, "token"):
        t.dropped.append(
            f"loss_cfg.loss_reduction={field(loss, 'loss_reduction')!r}: the mean over labelled tokens here"
        )


def _sequence_parallel(t: Translation, trainer: Any) -> None:
    """XTuner's `sp_size` (Ulysses: each rank a chunk of the sequence, heads exchanged around attention) is the isp
    tensor mode here (InternEvo's name for the same exchange)."""
    sp = int(field(trainer, "sp_size") or 1)
    if sp == 1:
        return
    tensor = t.config.get("parallel", {}).get("tensor")
    if tensor is not None:
        t.fatal.append(f"sp_size={sp} with fsdp_cfg.tp_size={tensor['size']}: one tensor group here; choose one")
        return
    t.set("parallel", "tensor", {"size": sp, "mode": "isp"})
    t.carried.append(f"sp_size={sp} -> parallel.tensor (size {sp}, mode 'isp': Ulysses' head exchange)")


def layout_world_size(config: dict[str, Any]) -> int:
    """The smallest world a translated config's layout fits: its tensor group times its expert group (expert
    parallel shards over the data-parallel ranks). torchrun chooses the real one."""
    parallel = config.get("parallel", {})
    return int(parallel.get("tensor", {}).get("size", 1)) * int(parallel.get("expert", {}).get("size", 1))


def validate(config: dict[str, Any]) -> None:
    """What train.py checks before it builds: the schema at the smallest world the layout fits, then the model
    family's own refusals (its `check_run`); ConfigError names the first problem."""
    cfg = resolve_config(config, world_size=layout_world_size(config))
    check_run(cfg)


def _check_layout(t: Translation) -> None:
    """Keep a carried tensor or expert group only where this trainer builds it for the translated model: a group
    the model cannot take (a dense model's experts, a tensor mode the model type does not split) is dropped with
    the validation's own line, and the run trains as XTuner's would on its FSDP shards alone."""
    parallel = t.config.get("parallel", {})
    if t.fatal or layout_world_size(t.config) == 1:
        return
    try:
        validate(t.config)
        return
    except ConfigError as exc:
        problem = " ".join(str(exc).split())
    for key in ("tensor", "expert"):
        if key in parallel:
            source = _layout_source(key, parallel.pop(key))
            t.carried = [line for line in t.carried if not line.startswith(source)]
            t.dropped.append(f"{source}: {problem}")


def _layout_source(key: str, group: dict[str, Any]) -> str:
    """The XTuner field a carried group came from."""
    if key == "expert":
        return f"fsdp_cfg.ep_size={group['size']}"
    return f"sp_size={group['size']}" if group["mode"] == "isp" else f"fsdp_cfg.tp_size={group['size']}"


def _run(t: Translation, trainer: Any, source: Path) -> None:
    steps, epochs = field(trainer, "total_step"), field(trainer, "total_epoch")
    if steps is not None:
        t.set("data", "total_steps", int(steps))
        t.carried.append("total_step -> data.total_steps")
    elif epochs is not None and ("data" not in t.config or t.fatal):
        pass  # the epochs cannot be counted without the data and model: the fatal problems above say why
    elif epochs is not None:
        try:
            packs = count_packs(t.config)
        except (DataError, OSError) as exc:
            t.fatal.append(f"total_epoch={epochs}: the data cannot be counted: {exc}")
            return
        batch = t.config["data"].get("global_bsz", 1)
        t.set("data", "total_steps", max(1, math.ceil(epochs * packs / batch)))
        t.carried.append(
            f"total_epoch={epochs} -> data.total_steps={t.config['data']['total_steps']} "
            f"({packs} packs of the data at {batch} per step)"
        )
    else:
        t.fatal.append("neither total_step nor total_epoch: the run has no length")
    total = t.config.get("data", {}).get("total_steps")
    warmup = t.config.get("lr_scheduler", {}).get("warmup_ratio", 0.0)
    if warmup >= 1 and total:  # XTuner reads warmup_ratio >= 1 as a step count
        t.config["lr_scheduler"]["warmup_ratio"] = min(1.0, warmup / total)
    tracker = field(trainer, "exp_tracker")
    if tracker == "tensorboard":
        t.set("monitor", "tensorboard", True)
        t.carried.append("exp_tracker='tensorboard' -> monitor.tensorboard (metrics.jsonl's numbers, same names)")
    elif tracker is not None:
        t.dropped.append(f"exp_tracker={tracker!r}: metrics.jsonl (and monitor.tensorboard) here")
    profile_step = field(trainer, "profile_step")
    if isinstance(profile_step, int) and not isinstance(profile_step, bool) and profile_step > 0:
        t.set("monitor", "profile_step", profile_step)
        t.carried.append("profile_step -> monitor.profile_step (a torch.profiler trace of that step)")
    work_dir = field(trainer, "work_dir")
    t.config["JOB_NAME"] = Path(str(work_dir)).name if work_dir else source.stem
    if work_dir:
        t.carried.append(f"work_dir -> train.py --work-dir {work_dir}")
    for name, section, key in (
        ("seed", "", "seed"),
        ("checkpoint_interval", "ckpt", "checkpoint_every"),
        ("checkpoint_maxkeep", "ckpt", "keep_last"),
        ("auto_resume", "ckpt", "auto_resume"),
    ):
        value = field(trainer, name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            value = 0  # XTuner's -1 (no interval, keep all) is 0 here
        if value is not None:
            t.set(section, key, value)
            t.carried.append(f"{name} -> {f'{section}.' if section else ''}{key}")


def count_packs(config: dict[str, Any]) -> int:
    """How many packs (micro-batches of one rank) the translated data makes: tokenizes it once, as the run will."""
    from internlm_offload.data import build_tokenizer
    from internlm_offload.data.chat import build_chat_dataset
    from internlm_offload.data.packed import build_text_dataset

    data = config["data"]
    tokenizer = build_tokenizer(data["tokenizer"])
    if data["type"] == "chat":
        dataset = build_chat_dataset(
            seq_len=data["seq_len"],
            micro_bsz=data.get("micro_bsz", 1),
            tokenizer=tokenizer,
            paths=data["paths"],
            max_length=data.get("max_length"),
            record_format=data.get("chat_format", "messages"),
        )
    else:
        dataset = build_text_dataset(seq_len=data["seq_len"], tokenizer=tokenizer, paths=data["paths"])
    return len(dataset)


def _get(obj: Any, name: str, defaults: dict[str, Any]) -> Any:
    return field(obj, name, defaults[name]) if obj is not None else defaults[name]


def short(value: Any) -> str:
    text = repr(value) if not isinstance(value, Recorded) else f"{value.name}(...)"
    return text if len(text) <= 80 else text[:77] + "..."

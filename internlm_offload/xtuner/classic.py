"""An XTuner classic (mmengine) LoRA config mapped onto this trainer's schema, with the same report as v1's.

XTuner's classic configs (`xtuner/configs/*/*.py`) are module-level dicts: `model = dict(type=SupervisedFinetune,
llm=dict(...), lora=dict(type=LoraConfig, ...))`, `train_dataset = dict(type=process_hf_dataset, ...)`,
`train_dataloader`, `optim_wrapper`, `param_scheduler`, `train_cfg`, `default_hooks`. The settings at the top of
such a file (`lr`, `batch_size`, ...) are plain Python variables: what mmengine builds is read from the dicts they
were put in, so a variable the file never used changes nothing. Each key is carried, dropped with why, or fatal
(`translate.Translation`), and every key of the dicts read here that no rule names is reported as dropped.
"""

import math
from pathlib import Path
from typing import Any

from internlm_offload.errors import DataError
from internlm_offload.family import capabilities, family_spec
from internlm_offload.xtuner.standins import type_name
from internlm_offload.xtuner.translate import Translation, count_packs, model_from_folder, short

# torch.optim.AdamW's defaults (XTuner's classic configs build torch's optimizer through mmengine).
TORCH_ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
# dataset_map_fn -> data.chat_format (data/chat_formats.py); openai_map_fn's `messages` lines are read as they are.
MAP_FNS = {"alpaca_map_fn": "alpaca", "oasst1_map_fn": "oasst1", "openai_map_fn": "messages"}
DTYPES = {"float16": "torch.float16", "bfloat16": "torch.bfloat16", "float32": "torch.float32"}
QUANT_KEYS = ("bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant", "llm_int8_skip_modules")
QUANT_8BIT = ("llm_int8_threshold", "llm_int8_has_fp16_weight", "llm_int8_enable_fp32_cpu_offload")
LORA_KEYS = ("r", "lora_alpha", "lora_dropout", "bias", "target_modules")
# PEFT options that train something else than plain LoRA: fatal unless at PEFT's default.
LORA_VARIANTS = {
    "use_rslora": False,
    "use_dora": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "init_lora_weights": True,
    "layers_to_transform": None,
}
# XTuner's find_all_linear_names leaves these heads out; every other nn.Linear's last name is a target.
NOT_TARGETED = ("lm_head", "output_layer")
# Top-level names that change nothing about what trains, and why they are not carried.
RUNTIME = {
    "custom_hooks": "XTuner's hooks (dataset info, chat evaluation) do not run here",
    "load_from": "start from a checkpoint with ckpt.load_ckpt_info",
    "resume": "resume with --resume or ckpt.auto_resume",
    "visualizer": "metrics.jsonl (and monitor.tensorboard) here",
}


def translate_classic(names: dict[str, Any], source: Path) -> Translation:
    """The whole mapping of one classic config's globals (`standins.load_classic`)."""
    t = Translation()
    model = names["model"]
    if not type_name(model.get("type")).endswith("SupervisedFinetune"):
        t.fatal.append(f"model.type={type_name(model.get('type'))}: only SupervisedFinetune (LoRA or full) maps here")
        return t
    hf = _llm(t, model, names)
    _lora(t, model, hf)
    _data(t, names)
    _optim(t, names.get("optim_wrapper") or {})
    _schedule_and_length(t, names)
    _runtime(t, names, source)
    return t


def _llm(t: Translation, model: dict[str, Any], names: dict[str, Any]) -> dict[str, Any] | None:
    llm = model.get("llm") or {}
    path = llm.get("pretrained_model_name_or_path")
    if path is None:
        t.fatal.append("model.llm.pretrained_model_name_or_path: not set (a local Hugging Face folder)")
        return None
    # XTuner's classic trainer trains transformers' (or the folder's own) modelling code, which never moves a router
    # bias: the run here keeps it too
    frozen = (0.0, "XTuner's classic trainer (transformers' model, whose router bias stays as loaded)")
    hf = model_from_folder(t, str(path), "model.llm.pretrained_model_name_or_path", bias_speed=frozen)
    if hf is None:
        return None
    dtype = str(llm.get("torch_dtype", "torch.float32")).removeprefix("torch.")
    amp = (names.get("optim_wrapper") or {}).get("dtype")
    if type_name((names.get("optim_wrapper") or {}).get("type")).endswith("AmpOptimWrapper"):
        dtype = str(amp or "float16").removeprefix("torch.")
    t.set("model", "dtype", DTYPES.get(dtype, "torch.float32"))
    t.carried.append(
        f"model.llm.torch_dtype / optim_wrapper's amp dtype -> model.dtype={DTYPES.get(dtype, 'torch.float32')!r} "
        "(fp32 adapter masters; XTuner's prepare_model_for_kbit_training upcasts the whole base to fp32 under "
        "autocast, here the frozen base is held in that dtype)"
    )
    checkpoint = model.get("use_activation_checkpointing", True)  # SupervisedFinetune's default
    t.set("model", "checkpoint", 1.0 if checkpoint else 0.0)
    t.carried.append(
        f"model.use_activation_checkpointing={checkpoint} -> model.checkpoint={1.0 if checkpoint else 0.0}"
    )
    if llm.get("quantization_config") is not None:
        _quantization(t, llm["quantization_config"])
    if model.get("use_varlen_attn"):
        t.carried.append("model.use_varlen_attn=True -> attention never crosses packed conversations (always so here)")
    elif "use_varlen_attn" in model:
        t.dropped.append(
            "model.use_varlen_attn=False: attention never crosses packed conversations here "
            "(XTuner's lets a packed sample attend to the one before it)"
        )
    _rest(t, "model", model, ("type", "llm", "lora", "use_activation_checkpointing", "use_varlen_attn"))
    _rest(
        t,
        "model.llm",
        llm,
        ("type", "pretrained_model_name_or_path", "torch_dtype", "quantization_config", "trust_remote_code"),
    )
    tokenizer = (names.get("tokenizer") or {}).get("pretrained_model_name_or_path") or path
    t.set("data", "tokenizer", str(tokenizer))
    t.carried.append("tokenizer.pretrained_model_name_or_path -> data.tokenizer")
    return hf


def _quantization(t: Translation, quant: Any) -> None:
    """`model.llm.quantization_config=dict(type=BitsAndBytesConfig, ...)` -> `model.quantization_config`."""
    key = "model.llm.quantization_config"
    if not isinstance(quant, dict) or not type_name(quant.get("type")).endswith("BitsAndBytesConfig"):
        t.fatal.append(f"{key}={short(_name(quant))}: only a dict(type=BitsAndBytesConfig, ...) maps here")
        return
    if quant.get("load_in_8bit"):
        t.fatal.append(f"{key}.load_in_8bit=True: the 8-bit base is not built here; QLoRA's load_in_4bit=True is")
        return
    if not quant.get("load_in_4bit"):
        t.dropped.append(f"{key}: neither load_in_4bit nor load_in_8bit set, nothing is quantized (as in transformers)")
        _rest(t, key, quant, ("type", *QUANT_KEYS, "load_in_4bit", "load_in_8bit", *QUANT_8BIT))
        return
    out: dict[str, Any] = {"load_in_4bit": True}
    for name in QUANT_KEYS:
        if quant.get(name) is not None:
            out[name] = quant[name]
    if "bnb_4bit_compute_dtype" in out:
        dtype = DTYPES.get(str(out["bnb_4bit_compute_dtype"]).removeprefix("torch."))
        if dtype is None:
            t.fatal.append(
                f"{key}.bnb_4bit_compute_dtype={out['bnb_4bit_compute_dtype']}: use float16, bfloat16 or float32"
            )
            return
        out["bnb_4bit_compute_dtype"] = dtype
    t.set("model", "quantization_config", out)
    t.carried.append(
        f"{key} ({', '.join(out)}) -> model.quantization_config: the frozen base's block linears in "
        "4 bits (bitsandbytes), BitsAndBytesConfig's names"
    )
    eight_bit = [name for name in QUANT_8BIT if name in quant]
    if eight_bit:
        t.dropped.append(
            f"{key} ({', '.join(eight_bit)}): 8-bit settings, not read by a 4-bit base (as in transformers)"
        )
    _rest(t, key, quant, ("type", "load_in_4bit", "load_in_8bit", *QUANT_KEYS, *QUANT_8BIT))


def _lora(t: Translation, model: dict[str, Any], hf: dict[str, Any] | None) -> None:
    lora = model.get("lora")
    if lora is None:
        t.carried.append("model.lora unset: a full fine-tune, every parameter trains")
        return
    if not type_name(lora.get("type")).endswith("LoraConfig"):
        t.fatal.append(f"model.lora.type={type_name(lora.get('type'))}: only peft's LoraConfig maps here")
        return
    out = {key: lora[key] for key in LORA_KEYS if key in lora}
    if isinstance(out.get("target_modules"), tuple):
        out["target_modules"] = list(out["target_modules"])
    t.set("model", "lora", out)
    t.carried.append(f"model.lora ({', '.join(k for k in LORA_KEYS if k in lora)}) -> model.lora, PEFT's names")
    if lora.get("task_type", "CAUSAL_LM") != "CAUSAL_LM":
        t.fatal.append(f"model.lora.task_type={lora['task_type']!r}: only CAUSAL_LM trains here")
    for key, default in LORA_VARIANTS.items():
        if key in lora and lora[key] != default:
            t.fatal.append(f"model.lora.{key}={short(lora[key])}: PEFT's LoRA variants are not built here")
    _rest(t, "model.lora", lora, ("type", "task_type", *LORA_KEYS, *LORA_VARIANTS))
    if "target_modules" not in lora and hf is not None:
        _all_linears(t, hf)


def _all_linears(t: Translation, hf: dict[str, Any]) -> None:
    """XTuner's rule without target_modules (find_all_linear_names): every nn.Linear but lm_head/output_layer."""
    if capabilities(t.config["model"]["type"]).transformers_modules:
        try:
            targets = _hf_linear_names(t.config["model"]["hf_path"])
        except (ImportError, OSError, KeyError, ValueError) as exc:  # a model_type transformers does not know
            t.fatal.append(
                f"model.lora.target_modules unset and the folder's linears cannot be listed ({exc}); "
                "name them in target_modules"
            )
            return
        t.config["model"]["lora"]["target_modules"] = targets
        head = " (InternLM2's head `output` included, as XTuner's rule does)" if "output" in targets else ""
        t.carried.append(f"model.lora.target_modules unset -> XTuner's every linear: {targets}{head}")
        return
    linears = list(family_spec(t.config["model"]["type"]).module_names)
    t.config["model"]["lora"]["target_modules"] = linears
    if hf.get("model_type") == "internlm2":
        t.dropped.append(
            "model.lora.target_modules unset: XTuner adapts every linear of InternLM2's remote code: wqkv, wo, w1, w2, "
            "w3 and the head `output` (its rule leaves out only lm_head/output_layer); here the native decoder adapts "
            f"{linears}: q, k and v get an adapter each (XTuner one over the fused wqkv) and the head none"
        )
    else:
        t.carried.append(f"model.lora.target_modules unset -> XTuner's every linear but lm_head: {linears}")


def _hf_linear_names(folder: str) -> list[str]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # names only: no memory, no weights read
        model = AutoModelForCausalLM.from_config(config)
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(names - set(NOT_TARGETED))


def _data(t: Translation, names: dict[str, Any]) -> None:
    loader = names.get("train_dataloader") or {}
    dataset = loader.get("dataset") or names.get("train_dataset") or {}
    if not type_name(dataset.get("type")).endswith("process_hf_dataset"):
        t.fatal.append(f"train_dataloader.dataset.type={type_name(dataset.get('type'))}: process_hf_dataset maps here")
        return
    paths = _jsonl_paths(t, dataset.get("dataset") or {})
    map_fn = type_name(dataset.get("dataset_map_fn"))
    if map_fn not in MAP_FNS:
        t.fatal.append(f"train_dataset.dataset_map_fn={map_fn}: one of {', '.join(MAP_FNS)} maps here")
        return
    max_length = int(dataset.get("max_length", 2048))
    data = {"type": "chat", "chat_format": MAP_FNS[map_fn], "paths": paths, "seq_len": max_length}
    data.update(max_length=max_length, micro_bsz=int(loader.get("batch_size", 1)))
    t.config["data"] = {**t.config.get("data", {}), **data}
    t.carried.append(f"train_dataset.dataset_map_fn={map_fn} -> data.type='chat', data.chat_format={MAP_FNS[map_fn]!r}")
    t.carried.append("train_dataset.max_length -> data.max_length and data.seq_len (one pack per sample)")
    t.carried.append("train_dataloader.batch_size -> data.micro_bsz (samples per micro-batch and rank)")
    if dataset.get("pack_to_max_length", True) is False:
        t.dropped.append(
            "train_dataset.pack_to_max_length=False: conversations are packed here (kept apart) into "
            "batch_size * max_length tokens a micro-batch instead of padded one by one"
        )
    else:
        t.carried.append("train_dataset.pack_to_max_length=True -> packs of max_length (conversations kept apart)")
    template = dataset.get("template_map_fn")
    if template is not None:
        template = _name(template.get("template") if isinstance(template, dict) else template)
        t.dropped.append(
            f"train_dataset.template_map_fn (template={template}): the tokenizer's own chat template "
            "renders the messages here"
        )
    sampler = loader.get("sampler") or {}
    if isinstance(sampler, dict) and sampler.get("shuffle") is False:
        t.set("data", "shuffle", False)
    t.carried.append("train_dataloader.sampler.shuffle -> data.shuffle")
    _rest(
        t,
        "train_dataset",
        dataset,
        (
            "type",
            "dataset",
            "tokenizer",
            "max_length",
            "dataset_map_fn",
            "template_map_fn",
            "pack_to_max_length",
            "remove_unused_columns",
            "shuffle_before_pack",
            "use_varlen_attn",
        ),
    )
    _rest(
        t,
        "train_dataloader",
        loader,
        ("batch_size", "num_workers", "dataset", "sampler", "collate_fn", "persistent_workers", "prefetch_factor"),
    )


def _jsonl_paths(t: Translation, source: dict[str, Any]) -> list[str]:
    """`dict(type=load_dataset, path="json", data_files=...)` -> the local files; a hub dataset is fatal."""
    path, files = source.get("path"), source.get("data_files")
    if path == "json" and files is not None:
        files = files.get("train", list(files.values())) if isinstance(files, dict) else files
        return [str(f) for f in ([files] if isinstance(files, str) else files)]
    if path is not None and Path(str(path)).exists():
        return [str(path)]
    t.fatal.append(
        f"train_dataset.dataset (path={path!r}): a local jsonl maps here, as "
        "dict(type=load_dataset, path='json', data_files=...) (a hub dataset is not downloaded)"
    )
    return []


def _optim(t: Translation, wrapper: dict[str, Any]) -> None:
    optimizer = wrapper.get("optimizer") or {}
    if type_name(optimizer.get("type")).rsplit(".", 1)[-1] != "AdamW":
        t.fatal.append(f"optim_wrapper.optimizer.type={type_name(optimizer.get('type'))}: only AdamW maps here")
        return
    beta1, beta2 = optimizer.get("betas", TORCH_ADAMW["betas"])
    t.config["adam"] = {
        "lr": float(optimizer.get("lr", TORCH_ADAMW["lr"])),
        "adam_beta1": float(beta1),
        "adam_beta2": float(beta2),
        "adam_eps": float(optimizer.get("eps", TORCH_ADAMW["eps"])),
        "weight_decay": float(optimizer.get("weight_decay", TORCH_ADAMW["weight_decay"])),
    }
    t.carried.append("optim_wrapper.optimizer (AdamW: lr, betas, eps, weight_decay; torch's defaults) -> adam")
    clip = wrapper.get("clip_grad")
    t.set("hybrid_zero_optimizer", "clip_grad_norm", float(clip.get("max_norm", 0.0)) if clip else 0.0)
    t.carried.append("optim_wrapper.clip_grad.max_norm -> hybrid_zero_optimizer.clip_grad_norm (unset: 0, no clip)")
    counts = int(wrapper.get("accumulative_counts", 1))
    t.set("data", "micro_num", counts)
    t.carried.append(f"optim_wrapper.accumulative_counts={counts} -> data.micro_num (micro-batches per step)")
    if clip and clip.get("error_if_nonfinite"):
        t.dropped.append("optim_wrapper.clip_grad.error_if_nonfinite: a non-finite step is skipped here, not raised")
    if wrapper.get("loss_scale") not in (None, "dynamic"):
        t.dropped.append(f"optim_wrapper.loss_scale={wrapper['loss_scale']!r}: fp16 uses a dynamic loss scale here")
    _rest(t, "optim_wrapper", wrapper, ("type", "optimizer", "clip_grad", "accumulative_counts", "loss_scale", "dtype"))
    _rest(t, "optim_wrapper.optimizer", optimizer, ("type", "lr", "betas", "eps", "weight_decay", "foreach", "fused"))


def _schedule_and_length(t: Translation, names: dict[str, Any]) -> None:
    """param_scheduler (LinearLR warm-up, CosineAnnealingLR) and train_cfg's length, in optimizer steps."""
    train_cfg = names.get("train_cfg") or {}
    epochs, iters = train_cfg.get("max_epochs"), train_cfg.get("max_iters")
    micro_num = t.config.get("data", {}).get("micro_num", 1)
    if iters is not None:
        t.set("data", "total_steps", max(1, int(iters) // micro_num))
        t.carried.append(f"train_cfg.max_iters={iters} -> data.total_steps (iterations / accumulative_counts)")
    elif epochs is None:
        t.fatal.append("train_cfg: neither max_epochs nor max_iters: the run has no length")
    elif "paths" in t.config.get("data", {}) and not t.fatal:
        try:
            batches = count_packs(t.config)
        except (DataError, OSError) as exc:
            t.fatal.append(f"train_cfg.max_epochs={epochs}: the data cannot be counted: {exc}")
        else:
            t.set("data", "total_steps", max(1, math.ceil(epochs * batches / micro_num)))
            t.carried.append(
                f"train_cfg.max_epochs={epochs} -> data.total_steps={t.config['data']['total_steps']} "
                f"({batches} micro-batches of the data on one rank, {micro_num} a step)"
            )
    _scheduler(t, names.get("param_scheduler"), epochs, t.config.get("data", {}).get("total_steps"), micro_num)


def _scheduler(t: Translation, entries: Any, epochs: Any, steps: int | None, micro_num: int) -> None:
    entries = [entries] if isinstance(entries, dict) else list(entries or [])
    kinds = [type_name(e.get("type")).rsplit(".", 1)[-1] for e in entries]
    if kinds not in (["LinearLR", "CosineAnnealingLR"], ["CosineAnnealingLR"], []):
        t.fatal.append(
            f"param_scheduler={kinds}: a LinearLR warm-up then CosineAnnealingLR (or either alone) maps here"
        )
        return
    scheduler = {"type": "cosine" if entries else "constant", "warmup_ratio": 0.0, "eta_min": 0.0}
    if kinds[:1] == ["LinearLR"]:
        warm = entries[0]
        length = float(warm.get("end", 0)) - float(warm.get("begin", 0))
        if warm.get("by_epoch", True):
            total = float(epochs or 1)
        else:  # mmengine counts iterations (micro-batches)
            total = float((steps or 1) * micro_num)
        scheduler["warmup_ratio"] = min(1.0, max(0.0, length / total))
        t.carried.append(
            f"param_scheduler LinearLR (begin, end) -> lr_scheduler.warmup_ratio={scheduler['warmup_ratio']:g}"
        )
        t.dropped.append(
            f"param_scheduler LinearLR.start_factor={warm.get('start_factor', 1 / 3)}: the warm-up here "
            "starts at lr / warm-up steps and rises linearly to lr"
        )
    if entries and kinds[-1] == "CosineAnnealingLR":
        scheduler["eta_min"] = float(entries[-1].get("eta_min", 0.0))
        t.carried.append("param_scheduler CosineAnnealingLR.eta_min -> lr_scheduler (type='cosine', eta_min)")
    t.config["lr_scheduler"] = scheduler


def _runtime(t: Translation, names: dict[str, Any], source: Path) -> None:
    hook = (names.get("default_hooks") or {}).get("checkpoint") or {}
    for key, target in (("interval", "checkpoint_every"), ("max_keep_ckpts", "keep_last")):
        if isinstance(hook.get(key), int):
            t.set("ckpt", target, max(0, hook[key]))  # mmengine's -1 (keep all) is 0 here
            t.carried.append(f"default_hooks.checkpoint.{key} -> ckpt.{target}")
    if hook.get("by_epoch"):
        t.dropped.append("default_hooks.checkpoint.by_epoch=True: checkpoint_every counts optimizer steps here")
    seed = (names.get("randomness") or {}).get("seed")
    if seed is not None:
        t.config["seed"] = int(seed)
        t.carried.append("randomness.seed -> seed")
    for name, why in RUNTIME.items():
        if names.get(name) not in (None, False, [], {}):
            t.dropped.append(f"{name}={short(_name(names[name]))}: {why}")
    work_dir = names.get("work_dir")
    t.config["JOB_NAME"] = Path(str(work_dir)).name if work_dir else source.stem
    if work_dir:
        t.carried.append(f"work_dir -> train.py --work-dir {work_dir}")


def _rest(t: Translation, prefix: str, section: dict[str, Any], known: tuple[str, ...]) -> None:
    """Report every key of a dict read here that no rule reads."""
    for key, value in section.items():
        if key not in known:
            t.dropped.append(f"{prefix}.{key}={short(_name(value))}: not read here")


def _name(value: Any) -> Any:
    """A config value for the report: `type=` entries by name, lists of dicts by their types."""
    if isinstance(value, dict) and "type" in value:
        return type_name(value["type"])
    if isinstance(value, list):
        return [_name(v) for v in value]
    return type_name(value) if callable(value) else value

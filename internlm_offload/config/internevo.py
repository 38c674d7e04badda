"""InternEvo config keys → this trainer's schema, applied to the raw config before validation.

Users bring InternEvo configs (`configs/7B_sft.py` and friends) as they are. Every InternEvo key has one
of three fates here, listed in docs/migrating.md:
- mapped: same semantics under this trainer's key (`model.layer_norm_epsilon` → `model.norm_eps`,
  `parallel.weight.size` → FSDP2, `local:` paths, ...);
- ignored: no effect on the run here (alerts, tensorboard, communication overlap flags, ...); listed
  in one info line at start;
- refused: honouring it would change the run (2D sequence parallel, boto3 storage, a beta2
  schedule, ...); every refusal of a config is reported together, naming the key and what to change.
Keys this trainer does not know at all are left alone: the schema refuses them as typos.

`config.py` stays the schema; this module only rewrites the raw dict.
"""

from __future__ import annotations

import copy
from typing import Any

from internlm_offload.config.internevo_moe import (
    MOE_MODEL_TYPES,
    apply_attention_bias_defaults,
    attention_bias_defaults,
    map_expert_parallel,
    map_moe_model,
)
from internlm_offload.config.translation import Translation

MISSING = object()

# model_type → this trainer's model (same architecture: RMSNorm, RoPE, GQA, SwiGLU; InternLM v1 adds biases
# on the attention projections).
MODEL_TYPES = {
    "INTERNLM": "internlm2",
    "INTERNLM2_PUBLIC": "internlm2",
    "INTERNLM2": "internlm2",
    "INTERNLM3": "internlm2",
    "LLAMA2": "internlm2",
}

# Keys that change nothing here, by section ("" is the top level).
IGNORED = {
    "": {"cudnn_deterministic", "cudnn_benchmark", "generation", "use_fp32_norm", "use_apex_adam", "metric_dtype"},
    "model": {
        "embed_split_hidden",
        "qk_interleaved",
        "enable_qkv_fusion",
        "use_flash_attn",
        "max_position_embeddings",
        "mlp_layer_fusion",
    },
    "data": {
        "empty_cache_and_diag_interval",
        "diag_outlier_ratio",
        "tokenizer_path",
        "use_shm",
        "shm_path",
        "packed_length",
    },
    "ckpt": {"async_upload", "async_upload_tmp_folder", "oss_snapshot_freq", "stop_file_path", "generate_meta_data"},
    "hybrid_zero_optimizer": {
        "overlap_sync_grad",
        "overlap_sync_param",
        "reduce_bucket_size",
        "use_split_tensor_optim",
        "all_gather_size",
    },
    "monitor": {"alert"},
    "loss": {"op_type"},
}


# InternEvo's knobs of when weight parallel's all-gathers are launched (develop, 2025).
WEIGHT_SCHEDULING = ("launch_allgather_before", "forward_overlap_per")


def translate(raw: dict[str, Any], world_size: int = 1) -> Translation:
    """Rewrite InternEvo keys of a raw config (not modified) onto this trainer's schema."""
    t = Translation(copy.deepcopy(raw))
    _ignore(t)
    _model(t)
    _data(t)
    _optimizer(t)
    _ckpt(t)
    _monitor(t)
    _parallel(t, world_size)
    return t


# ----------------------------------------------------------------------------- helpers


def _pop(t: Translation, section: str, key: str) -> Any:
    container = t.config if not section else t.config.get(section)
    if not isinstance(container, dict) or key not in container:
        return MISSING
    return container.pop(key)


def _set(t: Translation, section: str, key: str, value: Any) -> None:
    t.config.setdefault(section, {})[key] = value


def _ignore(t: Translation) -> None:
    for section, keys in IGNORED.items():
        for key in sorted(keys):
            if _pop(t, section, key) is not MISSING:
                t.ignored.append(f"{section}.{key}" if section else key)


def _internevo_only_keys(config: dict[str, Any]) -> bool:
    """Whether a config carries keys only InternEvo's configs have (this trainer's own never do)."""
    model, parallel = config.get("model"), config.get("parallel")
    model_keys = {"num_chunks", "layer_norm_epsilon", "no_bias", "embed_split_hidden"}
    return (isinstance(model, dict) and bool(model_keys & model.keys())) or (
        isinstance(parallel, dict) and "zero1" in parallel
    )


def _refuse_unless(t: Translation, name: str, value: Any, allowed: Any, fix: str) -> None:
    if value is not MISSING and value != allowed and not (isinstance(allowed, tuple) and value in allowed):
        t.refused.append(f"{name}={value!r}: {fix}")


# ----------------------------------------------------------------------------- sections


def _model(t: Translation) -> None:
    model_type = _pop(t, "", "model_type")
    given_type = isinstance(t.config.get("model"), dict) and "type" in t.config["model"]
    if model_type is MISSING and not given_type and _internevo_only_keys(t.config):
        # InternEvo's args_sanity_check: a config without model_type builds InternLM v1 (7B_sft.py has none)
        model_type = "INTERNLM"
        t.mapped.append("no model_type in an InternEvo config: InternEvo's default, 'INTERNLM' (v1)")
    if model_type in MOE_MODEL_TYPES:
        _set(t, "model", "type", "internlm2")
        t.mapped.append(f"model_type={model_type!r} -> model.type='internlm2' with mixture-of-experts blocks")
        map_moe_model(t, model_type)
    elif model_type is not MISSING:
        if model_type not in MODEL_TYPES:
            t.refused.append(f"model_type={model_type!r}: supported here: {', '.join(MODEL_TYPES)}")
        else:
            _set(t, "model", "type", MODEL_TYPES[model_type])
            t.mapped.append(f"model_type={model_type!r} -> model.type='internlm2'")
    model = t.config.get("model", {})
    if not isinstance(model, dict):
        return
    if model_type is not MISSING and "multiple_of" not in model:
        model["multiple_of"] = 256  # InternEvo's FeedForward rounds its width up to a multiple of 256
        t.mapped.append("model.multiple_of=256 (InternEvo's SwiGLU width rounding)")
    no_bias = _pop(t, "model", "no_bias")
    v1 = model_type in ("INTERNLM", "INTERNLM_MoE")
    if no_bias is not MISSING or v1:
        # InternEvo: the attention projections have biases unless no_bias; InternLM v1's always have them
        # (modeling_internlm.py passes bias=True whatever no_bias says; modeling_moe.py's MHA takes its default)
        model["attention_bias"] = no_bias is False or v1
        t.mapped.append(
            f"model.no_bias={no_bias if no_bias is not MISSING else 'unset'} -> model.attention_bias={model['attention_bias']}"
        )
    _refuse_unless(t, "model.norm_type", _pop(t, "model", "norm_type"), "rmsnorm", "only rmsnorm here")
    _refuse_unless(
        t, "model.norm_head", _pop(t, "model", "norm_head"), False, "the head is not normalised here; set False"
    )
    _refuse_unless(
        t,
        "model.use_sliding_window",
        _pop(t, "model", "use_sliding_window"),
        False,
        "sliding-window attention is not built here; set False",
    )
    _refuse_unless(
        t,
        "model.apply_post_layer_norm",
        _pop(t, "model", "apply_post_layer_norm"),
        False,
        "the decoder here is pre-norm; set False",
    )
    _refuse_unless(
        t,
        "model.embed_grad_scale",
        _pop(t, "model", "embed_grad_scale"),
        (1, 1.0),
        "embedding gradient scaling is not implemented; set 1",
    )
    bias_defaults = attention_bias_defaults(model_type, model)
    _model_shape(t, model)
    apply_attention_bias_defaults(t, model, bias_defaults)
    eps = _pop(t, "model", "layer_norm_epsilon")
    if eps is not MISSING:
        model["norm_eps"] = float(eps)
        t.mapped.append("model.layer_norm_epsilon -> model.norm_eps")
    dtype = model.get("dtype")
    if dtype in ("torch.half", "torch.tf32"):
        model["dtype"] = "torch.float16" if dtype == "torch.half" else "torch.float32"
        t.mapped.append(f"model.dtype={dtype!r} -> {model['dtype']!r}")
    for key in ("mlp_ratio", "rope_base"):
        if isinstance(model.get(key), int) and not isinstance(model.get(key), bool):
            model[key] = float(model[key])


def _model_shape(t: Translation, model: dict[str, Any]) -> None:
    """InternEvo's per-model switches of the decoder's shape (its llama and InternLM3 configs): the ones this
    decoder has are mapped or no-ops, the others refused."""
    biases = {key: _pop(t, "model", key) for key in ("qkv_bias", "o_bias")}
    given = {key: value for key, value in biases.items() if value is not MISSING}
    if len(set(given.values())) == 1 and len(given) == 2:
        model["attention_bias"] = bool(given["qkv_bias"])
        t.mapped.append(f"model.qkv_bias and model.o_bias -> model.attention_bias={model['attention_bias']}")
    else:  # apart, as Qwen2's biases on q, k, v without one on o
        for key, value in given.items():
            model[key] = bool(value)
            t.mapped.append(f"model.{key}={value!r} -> model.{key}={model[key]}")
    head_dim = _pop(t, "model", "head_dim")
    heads, hidden = model.get("num_attention_heads"), model.get("hidden_size")
    if head_dim is not MISSING and head_dim is not None:
        if isinstance(heads, int) and isinstance(hidden, int) and heads and head_dim * heads == hidden:
            t.ignored.append(f"model.head_dim={head_dim} (hidden_size / num_attention_heads)")
        else:  # Qwen3's: heads wider than hidden / heads
            model["head_dim"] = head_dim
            t.mapped.append(f"model.head_dim={head_dim!r} (apart from hidden_size / num_attention_heads)")
    switches = {
        "add_unit_offset": (False, "RMSNorm here scales by its weight, not 1 + weight; set False"),
        "use_swiglu": (True, "the MLP here is SwiGLU; set True"),
    }
    for key, (built, fix) in switches.items():
        value = _pop(t, "model", key)
        if value == built:
            t.ignored.append(f"model.{key}={built} (what the decoder here is)")
        _refuse_unless(t, f"model.{key}", value, built, fix)


def _data(t: Translation) -> None:
    data = t.config.get("data")
    if not isinstance(data, dict):
        return
    packed = _pop(t, "data", "use_packed_dataset")
    if packed is True:
        t.ignored.append("data.use_packed_dataset (samples are packed here, as InternEvo's default)")
    _refuse_unless(
        t,
        "data.use_packed_dataset",
        packed,
        True,
        "samples are packed into data.seq_len here (pack_sample_into_one=False keeps documents apart); set True",
    )
    if "train_folder" in data and data["train_folder"] is None:
        del data["train_folder"]
        data.setdefault("type", "builtin")
        t.warnings.append("data.train_folder=None: training on the builtin corpus (InternEvo would use random tokens)")
        if data.get("pack_sample_into_one") is False:
            del data["pack_sample_into_one"]
            t.warnings.append("data.pack_sample_into_one=False: the builtin corpus is packed into one stream")
    _refuse_unless(
        t,
        "data.rampup_batch_size",
        _pop(t, "data", "rampup_batch_size"),
        ("", None),
        "batch-size ramp-up is not supported here; remove it",
    )
    if data.get("skip_batches") is None:
        data.pop("skip_batches", None)
    if "valid_folder" in data and data["valid_folder"] is None:
        del data["valid_folder"]
        if data.pop("valid_every", 0):
            t.warnings.append("data.valid_folder=None: no validation (InternEvo would validate on random tokens)")


def _optimizer(t: Translation) -> None:
    beta2_c = _pop(t, "adam", "adam_beta2_c")
    scheduler = _pop(t, "", "beta2_scheduler")
    c = scheduler.get("c", 0) if isinstance(scheduler, dict) else (0 if scheduler is MISSING else scheduler)
    for name, value in (("adam.adam_beta2_c", beta2_c), ("beta2_scheduler.c", c)):
        _refuse_unless(t, name, value, (0, 0.0), "the beta2 schedule is not implemented; set 0 (constant beta2)")
    if scheduler is not MISSING:
        t.ignored.append("beta2_scheduler (c=0: constant beta2)")
    _refuse_unless(
        t,
        "lr_scheduler.init_steps",
        _pop(t, "lr_scheduler", "init_steps"),
        0,
        "a delayed schedule start is not implemented; set 0",
    )
    _refuse_unless(
        t,
        "lr_scheduler.last_epoch",
        _pop(t, "lr_scheduler", "last_epoch"),
        -1,
        "resume sets the schedule's position from the checkpoint; set -1",
    )
    sched, data = t.config.get("lr_scheduler", {}), t.config.get("data", {})
    if isinstance(sched, dict) and isinstance(data, dict):
        total, steps = sched.get("total_steps"), data.get("total_steps")
        if total is not None and steps is not None and total != steps:
            t.warnings.append(
                f"lr_scheduler.total_steps={total} != data.total_steps={steps}: the schedule "
                f"{'will not finish' if total > steps else 'ends early'} in this run"
            )


def _ckpt(t: Translation) -> None:
    ckpt = t.config.get("ckpt")
    if not isinstance(ckpt, dict):
        return
    for key in ("save_ckpt_folder", "load_ckpt_folder"):
        ckpt[key] = _storage_path(t, f"ckpt.{key}", ckpt.get(key))
    universal = ckpt.pop("universal_ckpt", None)
    if universal is not None:
        t.ignored.append("ckpt.universal_ckpt (DCP checkpoints here load at any world size)")
    _refuse_unless(
        t,
        "ckpt.enable_internevo2hf_ckpt",
        ckpt.pop("enable_internevo2hf_ckpt", MISSING),
        False,
        "export with `python -m internlm_offload.tools.export CKPT OUT --hf`",
    )
    info = ckpt.get("load_ckpt_info")
    if isinstance(info, dict) and info.get("path") is None:
        del ckpt["load_ckpt_info"]  # nothing to load (InternEvo's own "train from scratch" form)
        info = None
    if isinstance(info, dict):
        info["path"] = _storage_path(t, "ckpt.load_ckpt_info.path", info.get("path"))
    folder = ckpt.get("load_ckpt_folder")
    if isinstance(folder, dict):  # InternEvo's older dict form of load_ckpt_info
        ckpt["load_ckpt_info"] = ckpt.get("load_ckpt_info") or folder
        folder = None
    if ckpt.get("auto_resume") is True and (info or folder):
        # InternEvo: with auto_resume the latest checkpoint of save_ckpt_folder wins and these are not loaded.
        t.mapped.append("ckpt.auto_resume=True: ckpt.load_ckpt_info / load_ckpt_folder not loaded (InternEvo's rule)")
        ckpt.pop("load_ckpt_info", None)
        folder = None
    elif ckpt.get("load_ckpt_info") and folder:
        t.mapped.append("ckpt.load_ckpt_info given: the legacy ckpt.load_ckpt_folder is not loaded")
        folder = None
    ckpt["load_ckpt_folder"] = folder
    for key in [k for k, v in ckpt.items() if v is None]:
        del ckpt[key]


def _storage_path(t: Translation, name: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if value.startswith("local:"):
        return value.removeprefix("local:")
    if ":" in value.split("/")[0]:
        t.refused.append(f"{name}={value!r}: only local paths (optionally 'local:') are supported here")
    return value


def _monitor(t: Translation) -> None:
    """InternEvo's TensorBoard switches: `enable_tb`, and the `monitor.tensorboard` section (its queue settings)."""
    enable_tb = _pop(t, "", "enable_tb")
    if _pop(t, "", "tensorboard_folder") is not MISSING:
        t.ignored.append("tensorboard_folder (TensorBoard writes to <work_dir>/tensorboard)")
    section = t.config.get("monitor", {}).get("tensorboard") if isinstance(t.config.get("monitor"), dict) else None
    if isinstance(section, dict):
        t.config["monitor"]["tensorboard"] = True
        t.mapped.append("monitor.tensorboard=dict(...) -> monitor.tensorboard=True (queue settings have no effect)")
    if enable_tb is not MISSING:
        _set(t, "monitor", "tensorboard", bool(enable_tb))
        t.mapped.append(f"enable_tb={enable_tb} -> monitor.tensorboard={bool(enable_tb)}")


def _parallel(t: Translation, world_size: int) -> None:
    """InternEvo's parallel section: `tensor` and `weight` keep their meaning (checked by the schema), the
    data-parallel wrapper follows from zero1.fsdp / weight parallel / the data-parallel size."""
    parallel = t.config.get("parallel")
    if not isinstance(parallel, dict) or "mode" in parallel:
        return
    internevo_keys = {"zero1", "tensor", "pipeline", "weight", "sequence_2D", "expert", "expert_weight"}
    if not internevo_keys & parallel.keys():
        return
    tensor, pipeline, weight = (_size(parallel.get(key)) for key in ("tensor", "pipeline", "weight"))
    zero1 = parallel.pop("zero1", None)
    seq2d = parallel.pop("sequence_2D", None)
    map_expert_parallel(t, parallel)
    for key in ("tensor", "weight"):
        if isinstance(parallel.get(key), int):  # InternEvo also takes `tensor=2`
            parallel[key] = dict(size=parallel[key])
    if isinstance(parallel.get("weight"), dict):  # weight parallel's all-gather scheduling: no effect here
        for knob in WEIGHT_SCHEDULING:
            if parallel["weight"].pop(knob, MISSING) is not MISSING:
                t.ignored.append(f"parallel.weight.{knob}")
    if isinstance(seq2d, dict) and seq2d.get("enable"):
        t.refused.append(
            "parallel.sequence_2D.enable=True: 2D sequence parallel (ring attention over a context group) is not "
            "built here; set False (isp's Ulysses is parallel.tensor.mode='isp')"
        )
    if tensor == 1 and weight > 1:
        # isp over a tensor group of one: weight parallel alone is FSDP over `weight` ranks; here over all ranks
        if weight > world_size:
            t.refused.append(
                f"parallel.weight.size={weight} is larger than the world size {world_size}; set at most "
                f"{world_size} (weight parallelism maps onto FSDP2 over all ranks)"
            )
        parallel["weight"] = {**parallel["weight"], "size": 1}
        t.mapped.append(f"parallel.weight.size={weight} with tensor.size=1 -> parallel.mode='fsdp2' over all ranks")
    fsdp = isinstance(zero1, dict) and bool(zero1.get("fsdp"))
    data_parallel = max(1, world_size // (tensor * pipeline))  # pipeline stages read the same micro-batches
    isp = isinstance(parallel.get("tensor"), dict) and parallel["tensor"].get("mode") == "isp"
    expert_weight = _size(parallel.get("expert_weight"))
    if weight > 1 or expert_weight > 1 or fsdp or (tensor > 1 and data_parallel > 1 and not isp):
        # weight parallel (the experts' too) is FSDP2; other tensor modes take FSDP2 over the data-parallel dim (DDP
        # takes no DTensors)
        parallel["mode"] = "fsdp2"
    elif data_parallel > 1 or (isp and tensor > 1):
        # ZeRO-1 sharding of the optimizer states is not done here: all ranks hold them. isp: DDP sums the
        # gradients of the sequence chunks too.
        parallel["mode"] = "ddp"
    else:
        parallel["mode"] = "none"
    t.mapped.append(f"parallel (zero1/pipeline/weight) -> parallel.mode={parallel['mode']!r}")


def _size(section: Any) -> int:
    """A section's size; "auto" (the planner's: `parallel.pipeline.size`) counts as 1 here."""
    if isinstance(section, dict):
        size = section.get("size", 1)
        return 1 if size == "auto" else int(size)
    return int(section) if isinstance(section, int) else 1

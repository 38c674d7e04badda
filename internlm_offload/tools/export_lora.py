"""A LoRA run's exports (docs/lora.md): PEFT's adapter folder, the frozen base it started from, merged weights.

A LoRA checkpoint holds the adapters only; its config names the base: `model.hf_path` (a Hugging Face folder),
`ckpt.load_ckpt_info` (another run's checkpoint or another trainer's files) or, with neither, the run's seed. The
base is rebuilt from there as the run built it (in fp32 on the cpu: a seeded base is the run's bit for bit only
when the run drew it on the cpu too; a base from files always is).
"""

import json
from collections.abc import Callable
from pathlib import Path

import torch

from internlm_offload.builder.model import build_model, folder_layout
from internlm_offload.config import ModelConfig, RunConfig
from internlm_offload.config.lora import DEFAULT_TARGETS
from internlm_offload.device import Accelerator
from internlm_offload.engine.runtime import set_determinism
from internlm_offload.engine.start_plan import find_weights_source
from internlm_offload.errors import CheckpointError
from internlm_offload.family import capabilities, family_spec
from internlm_offload.model.families.internlm2.hf_export import export_family
from internlm_offload.model.families.internlm2.hf_names import TABLES as HF_TABLES
from internlm_offload.model.lora import ADAPTER_NAME
from internlm_offload.model.name_table import NameTable
from internlm_offload.weights.convert import Heads, to_format
from internlm_offload.weights.sources import load_weights as load_foreign_weights

HF_PREFIX = "hf_model."
PEFT_PREFIX = "base_model.model."
_PARTS = ("lora_A", "lora_B")


def is_lora_run(run: dict) -> bool:
    return run["model"].get("lora") is not None


def adapters_of(weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{module name: {"lora_A": [r, in], "lora_B": [out, r]}} from a checkpoint's tensors (PEFT's layer names)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights.items():
        for part in _PARTS:
            suffix = f".{part}.{ADAPTER_NAME}.weight"
            if name.endswith(suffix):
                found.setdefault(name.removesuffix(suffix), {})[part] = tensor
    if not found or any(len(pair) != 2 for pair in found.values()):
        raise CheckpointError("the checkpoint holds no complete LoRA adapters (lora_A and lora_B per module)")
    return found


def base_weights(run: dict, read_checkpoint: Callable[[Path], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The base the run started from, fp32, under its names without adapters (`hf_model.`-prefixed for
    hf_causal_lm). `read_checkpoint`: a DCP checkpoint's full model tensors (a base that is another run's)."""
    cfg = RunConfig.model_validate(run, strict=False)
    set_determinism(cfg.seed, False, Accelerator("cpu"))
    model = build_model(cfg.model.model_copy(update={"lora": None}), torch.device("cpu"))
    source = find_weights_source(cfg)
    if source is not None and source.kind == "dcp":
        model.load_state_dict(read_checkpoint(source.path))
    elif source is not None:
        load_foreign_weights(model, source, cfg.model)
    return {name: t.detach().float() for name, t in model.state_dict().items()}


def merged(base: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], run: dict) -> dict[str, torch.Tensor]:
    """The base with every adapter folded in: W + lora_alpha / r * B @ A, in fp32."""
    lora = run["model"]["lora"]
    scale = lora["lora_alpha"] / lora["r"]
    out = dict(base)
    for module, pair in adapters_of(weights).items():
        name = f"{module}.weight"
        if name not in out:
            raise CheckpointError(f"adapter on {module!r}, which the base has no weight for")
        delta = pair["lora_B"].double() @ pair["lora_A"].double()
        out[name] = (out[name].double() + scale * delta).float()
    return out


def peft_tensors(weights: dict[str, torch.Tensor], run: dict) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's saved names: `base_model.model.<HF module>.lora_A.weight` (adapter name dropped)."""
    table, heads = hf_table(run)
    out = {}
    for module, pair in adapters_of(weights).items():
        if table is not None:
            # the base weight's Hugging Face name; B's rows follow the base's rows (to_format reorders both alike)
            b = to_format({f"{module}.weight": pair["lora_B"]}, table, heads)
            ((hf_weight, lora_b),) = b.items()
            hf_module = hf_weight.removesuffix(".weight")
        else:
            hf_module, lora_b = module.removeprefix(HF_PREFIX), pair["lora_B"]
        out[f"{PEFT_PREFIX}{hf_module}.lora_A.weight"] = pair["lora_A"]
        out[f"{PEFT_PREFIX}{hf_module}.lora_B.weight"] = lora_b
    return out


def hf_table(run: dict) -> tuple[NameTable | None, Heads | None]:
    """The names (and heads) the run's `--hf` export writes: the native family's, or a family's that writes its
    folder back (`Capabilities.folder_export`: its `folder_format`); None for hf_causal_lm (transformers' own)."""
    model = run["model"]
    if capabilities(model["type"]).native_names:
        return hf_names(run), Heads(model["num_attention_heads"], model["num_kv_attention_heads"])
    if capabilities(model["type"]).folder_export:
        layout = folder_layout(ModelConfig.model_validate(model, strict=False))
        return layout.table, Heads(layout.n_heads, layout.n_kv_heads)
    return None, None


def hf_names(run: dict) -> NameTable:
    """The names a native run's `--hf` export writes: Llama's, or its mixture-of-experts family's (Qwen2-MoE's
    shared expert and Qwen3-MoE's dense blocks are where the MLP adapters sit)."""
    model = RunConfig.model_validate(run, strict=False).model
    return HF_TABLES[export_family(model)]


def adapter_config(run: dict, modules: list[str] | None = None) -> dict:
    """PEFT's adapter_config.json of the run's `model.lora` (HF target names; the base named where it is a path).
    `modules`: the Hugging Face names of the modules the adapters sit on (a family that writes its folder back)."""
    model, lora = run["model"], run["model"]["lora"]
    targets = list(lora["target_modules"] or DEFAULT_TARGETS)
    if capabilities(model["type"]).native_names:
        to_hf = {native: hf for hf, native in family_spec(model["type"]).module_names.items()}
        targets = [to_hf.get(name, name) for name in targets]
    elif modules is not None:  # its folder's names: the modules the adapters sit on there
        targets = [module.rsplit(".", 1)[-1] for module in modules]
    alpha = lora["lora_alpha"]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model.get("hf_path"),
        "r": lora["r"],
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": lora["lora_dropout"],
        "target_modules": sorted(set(targets)),
        "bias": lora["bias"],
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_folder(weights: dict[str, torch.Tensor], out: Path, dtype: torch.dtype, run: dict) -> None:
    """adapter_config.json + adapter_model.safetensors, as `PeftModel.save_pretrained` writes them."""
    from safetensors.torch import save_file

    tensors = {name: t.to(dtype).contiguous() for name, t in peft_tensors(weights, run).items()}
    modules = None
    if capabilities(run["model"]["type"]).folder_export:
        modules = [n.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") for n in tensors if "lora_A" in n]
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(run, modules), indent=2) + "\n")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})

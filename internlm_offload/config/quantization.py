"""The `model.quantization_config` section: QLoRA's 4-bit frozen base, with `transformers.BitsAndBytesConfig`'s
names (what XTuner's QLoRA configs and transformers users write)."""

import importlib.util
from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from internlm_offload.config.base import Section

COMPUTE_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")


class QuantizationConfig(Section):
    load_in_4bit: bool = Field(
        False, description="Hold the frozen base's block linears in 4 bits (bitsandbytes); must be True here."
    )
    load_in_8bit: bool = Field(False, description="bitsandbytes' 8-bit base: not built here (refused when True).")
    bnb_4bit_quant_type: Literal["fp4", "nf4"] = Field(
        "fp4", description="The 4-bit code: `nf4` (QLoRA's NormalFloat) or `fp4` (transformers' default)."
    )
    bnb_4bit_compute_dtype: Optional[Literal["torch.float32", "torch.bfloat16", "torch.float16"]] = Field(
        None,
        description="The dtype a 4-bit weight is dequantized to for its matmul. None: `model.dtype` (transformers' "
        "default is float32, the dtype its models load in; here the run's compute dtype).",
    )
    bnb_4bit_use_double_quant: bool = Field(
        False, description="Quantize the per-block scales too (QLoRA's double quantization, ~0.37 bit a weight less)."
    )
    llm_int8_skip_modules: Optional[list[str]] = Field(
        None,
        description="Linears (matched by name suffix) that stay in `model.dtype`. The embedding, the output layer and "
        "the norms always do; only the decoder blocks' linears are quantized.",
    )
    # 8-bit-only fields of BitsAndBytesConfig: accepted at their defaults (XTuner's QLoRA configs write them)
    llm_int8_threshold: float = Field(6.0, description="8-bit only; accepted at its default 6.0.")
    llm_int8_has_fp16_weight: bool = Field(False, description="8-bit only; accepted at its default False.")
    llm_int8_enable_fp32_cpu_offload: bool = Field(False, description="8-bit only; accepted at its default False.")
    bnb_4bit_quant_storage: Literal["torch.uint8"] = Field(
        "torch.uint8", description="The packed weights' dtype: `torch.uint8` only."
    )

    @model_validator(mode="after")
    def _built(self) -> "QuantizationConfig":
        if self.load_in_8bit:
            raise ValueError(
                "model.quantization_config.load_in_8bit=True: the 8-bit base is not built; use load_in_4bit=True"
            )
        if not self.load_in_4bit:
            raise ValueError(
                "model.quantization_config.load_in_4bit=False: set load_in_4bit=True (QLoRA's 4-bit base, the only "
                "quantization built) or leave quantization_config unset"
            )
        defaults = {"llm_int8_threshold": 6.0, "llm_int8_has_fp16_weight": False}
        for key, default in defaults.items():
            if getattr(self, key) != default:
                raise ValueError(
                    f"model.quantization_config.{key}={getattr(self, key)!r}: an 8-bit setting, not read by the 4-bit "
                    f"base; leave it at {default!r}"
                )
        if self.llm_int8_enable_fp32_cpu_offload:
            raise ValueError(
                "model.quantization_config.llm_int8_enable_fp32_cpu_offload=True: not built; leave it False"
            )
        return self


def check_quantization(model: Any) -> None:
    """The checks of `model.quantization_config` against the rest of the model section (a `ModelConfig`)."""
    if model.quantization_config is not None and model.lora is None:
        raise ValueError(
            "model.quantization_config without model.lora: a 4-bit base trains nothing; add model.lora=dict(...) "
            "(QLoRA) or drop quantization_config"
        )


def quantization_problem(cfg: Any) -> str | None:
    """Why `model.quantization_config` does not compose with the rest of a `RunConfig`, or None."""
    if cfg.model.quantization_config is None:
        return None
    where = "model.quantization_config"
    if cfg.parallel.mode == "fsdp2":
        return (
            f"{where} with parallel.mode='fsdp2': FSDP2 would shard the packed 4-bit weights, which bitsandbytes "
            "reads whole; use parallel.mode 'none' or 'ddp'"
        )
    if cfg.parallel.pipeline.size > 1:
        return f"{where} with parallel.pipeline.size={cfg.parallel.pipeline.size}: not built for pipeline stages"
    if importlib.util.find_spec("bitsandbytes") is None:
        return f'{where}: the 4-bit base needs bitsandbytes, which is not installed (pip install "internlm_offload[qlora]")'
    return None


def compute_dtype_name(model: Any) -> str:
    """The dtype the 4-bit weights are dequantized to: `bnb_4bit_compute_dtype`, else `model.dtype`."""
    return model.quantization_config.bnb_4bit_compute_dtype or model.dtype

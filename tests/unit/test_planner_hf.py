"""The planner on a Hugging Face decoder (`model.type="hf_causal_lm"`): transformers' own modules traced on meta
(planner/standins.py `packed_sequences_on_meta`), LoRA with the base on the host included."""

import pytest
from test_planner import SMALL

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner.trace import trace_step

pytest.importorskip("transformers")


def test_the_meta_trace_of_a_hugging_face_model_predicts_its_real_step():
    """transformers 5.x asks its position ids whether sequences are packed, which meta cannot answer: the trace of
    a LoRA run of transformers' Llama with its base on the host runs, and its peaks are the real cpu run's within
    0.1 %; the base's bytes are host memory."""
    options = {**SMALL, "model.lora.base_on_host": True}
    cfg = resolve_config(load_config_file("configs/hf_llama_tiny_lora.py", options))
    predicted, measured = trace_step(cfg), trace_step(cfg, measure=True)
    for key in ("device_peak_bytes", "host_peak_bytes", "first_step_device_peak_bytes"):
        assert predicted.as_dict()[key] == pytest.approx(measured.as_dict()[key], rel=1e-3, abs=64 << 10), key
    assert predicted.components["host_params"] > 0


def test_the_preflight_traces_a_local_fp32_mixture_of_experts_as_it_runs(tmp_path):
    """`model.hf_path` builds its folder's modules from config.json on meta (from_pretrained refuses a meta device),
    and transformers' experts run torch's grouped GEMM in fp32 as on cpu (torch's meta kernel takes bf16 only): the
    preflight's prediction for a folder of configs/hf_mixtral_tiny.py's model is that model's real cpu step within
    0.1 % (measured from its config dict: a measured load from a folder misses a tensor safetensors maps in)."""
    from transformers import AutoConfig

    from internlm_offload.planner.preflight import predict

    mixtral = "configs/hf_mixtral_tiny.py"
    built = resolve_config(load_config_file(mixtral, SMALL))
    AutoConfig.for_model(**built.model.hf_config).save_pretrained(str(tmp_path))
    cfg = resolve_config(load_config_file(mixtral, {**SMALL, "model.hf_config": None, "model.hf_path": str(tmp_path)}))
    predicted, measured = predict(cfg, world_size=1), trace_step(built, measure=True)
    assert predicted.device_peak == pytest.approx(measured.device_peak_bytes, rel=1e-3, abs=64 << 10)
    assert predicted.components["model_params"] == measured.components["model_params"] > 0


def test_tools_plan_plans_the_shipped_mixtral_config(capsys):
    """configs/hf_mixtral_tiny.py (fp32 experts through transformers' grouped GEMM) plans: exit 0 with its peak."""
    from internlm_offload.tools import plan

    options = [f"{key}={value}" for key, value in SMALL.items()]
    assert plan.main(["--config", "configs/hf_mixtral_tiny.py", "--cfg-options", *options]) == 0
    assert "configs/hf_mixtral_tiny.py on 1 rank(s): no budget given" in capsys.readouterr().out


def test_the_trace_of_a_latent_attention_model_predicts_its_real_step():
    """configs/hf_deepseek_v3_tiny.py: MLA's v head dim (16) is not q/k's (32), which cpu's flash kernel does not take,
    so sdpa runs its math path there and the trace follows it (the flash stand-in made a v of q's head dim: the trace
    failed in the output projection). Its peaks are the real cpu step's within 0.1 %, and tools.plan answers."""
    from internlm_offload.tools import plan

    cfg = resolve_config(load_config_file("configs/hf_deepseek_v3_tiny.py", SMALL))
    predicted, measured = trace_step(cfg), trace_step(cfg, measure=True)
    for key in ("device_peak_bytes", "first_step_device_peak_bytes"):
        assert predicted.as_dict()[key] == pytest.approx(measured.as_dict()[key], rel=1e-3, abs=64 << 10), key
    options = [f"{key}={value}" for key, value in SMALL.items()]
    assert plan.main(["--config", "configs/hf_deepseek_v3_tiny.py", "--cfg-options", *options]) == 0

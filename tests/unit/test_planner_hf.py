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

# QLoRA on the tiny InternLM2 (docs/lora.md "QLoRA"): internlm2_tiny_lora.py with the frozen block linears held in
# 4 bits (NF4, double-quantised scales) through bitsandbytes; the adapters train with fp32 masters as there.
# Needs `pip install "internlm_offload[qlora]"`. Add `model.lora.base_on_host=True` to keep the packed base in host
# memory, brought to the device a block at a time.
_base_ = ["./internlm2_tiny_lora.py"]
JOB_NAME = "internlm2_tiny_qlora"
model = dict(
    quantization_config=dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
)

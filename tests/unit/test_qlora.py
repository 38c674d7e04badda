"""QLoRA (docs/lora.md "QLoRA"): `model.quantization_config` with BitsAndBytesConfig's names holds the frozen base's
block linears in 4 bits through bitsandbytes; the adapters train on top. bitsandbytes on the cpu is slow: every
model here is 2 blocks of width 64 and 3 steps."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from internlm_offload.builder import Components, build_components, make_trainer
from internlm_offload.config import ConfigError, resolve_config
from internlm_offload.config.quantization import QuantizationConfig
from internlm_offload.model.lora import adapter_parameters, is_adapter_name
from internlm_offload.model.quantized import Linear4bit, full_weight_shapes, quantized_linears, scale_tensors

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from test_lora import CTX, LLAMA, SEQ  # noqa: E402  the LoRA tests' context and tiny Llama, here over a 4-bit base

NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def native(quant: dict | None = NF4, lora: dict | None = LORA, **model) -> dict:
    section = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_attention_heads": 2}
    section.update(dtype="torch.bfloat16", **model)
    if lora is not None:
        section["lora"] = lora
    if quant is not None:
        section["quantization_config"] = quant
    return {"model": section, "data": {"seq_len": SEQ}, "adam": {"lr": 1e-2}}


def hf(quant: dict | None = NF4) -> dict:
    model = {"type": "hf_causal_lm", "hf_config": LLAMA, "dtype": "torch.bfloat16", "lora": LORA}
    if quant is not None:
        model["quantization_config"] = quant
    return {"model": model, "data": {"seq_len": SEQ}, "adam": {"lr": 1e-2}}


def build(raw: dict, seed: int = 0) -> Components:
    torch.manual_seed(seed)
    return build_components(resolve_config(raw), CTX)


def batches(steps: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, vocab, (2, SEQ), generator=gen) for _ in range(steps)]
    return [(t, (t * 7 + 3) % vocab) for t in tokens]


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every frozen tensor: the packed 4-bit weights, their scales (buffers), norms, embedding and head."""
    state = {name: p.detach().clone() for name, p in model.named_parameters() if not is_adapter_name(name)}
    state.update({name: b.clone() for name, b in model.named_buffers()})
    return state


# ---------------------------------------------------------------------------------------------------- config


def test_defaults_are_transformers_bits_and_bytes_defaults():
    from transformers import BitsAndBytesConfig

    theirs = BitsAndBytesConfig(load_in_4bit=True)
    ours = QuantizationConfig(load_in_4bit=True)
    for key in ("load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "llm_int8_threshold",
                "llm_int8_has_fp16_weight", "llm_int8_skip_modules"):  # fmt: skip
        assert getattr(ours, key) == getattr(theirs, key), key


@pytest.mark.parametrize(
    "raw, message",
    [
        (native(lora=None), "model.quantization_config without model.lora: a 4-bit base trains nothing"),
        (native({"load_in_8bit": True}), "model.quantization_config.load_in_8bit=True: the 8-bit base is not built"),
        (native({"bnb_4bit_quant_type": "nf4"}), "model.quantization_config.load_in_4bit=False: set load_in_4bit"),
        (native({**NF4, "bnb_4bit_quant_type": "int4"}), "model.quantization_config.bnb_4bit_quant_type='int4'"),
        (native({**NF4, "llm_int8_threshold": 4.0}), "model.quantization_config.llm_int8_threshold=4.0: an 8-bit"),
        (native({**NF4, "bnb_4bit_compute_dtype": "torch.int8"}), "model.quantization_config.bnb_4bit_compute_dtype"),
        ({**native(), "parallel": {"mode": "fsdp2"}}, "model.quantization_config with parallel.mode='fsdp2'"),
    ],
)
def test_bad_values_are_one_line_config_errors(raw, message):
    with pytest.raises(ConfigError) as info:
        resolve_config(raw)
    assert message in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------- the 4-bit base


@pytest.mark.parametrize("double_quant", [False, True])
def test_the_meta_build_makes_the_tensors_bitsandbytes_makes(double_quant):
    """The planner builds on meta: the packed weight and every scale have bitsandbytes' shapes and dtypes, and a
    model-wide `.to(bf16)` (the masters' cast) leaves a real one's bytes as they were."""
    linear = torch.nn.Linear(96, 40, bias=False)
    kwargs = dict(quant_type="nf4", compute_dtype=torch.bfloat16, double_quant=double_quant)
    real, meta = Linear4bit(linear, **kwargs), Linear4bit(linear.to("meta"), **kwargs)
    tensors = {name: t for name, t in [*real.named_parameters(), *real.named_buffers()]}
    meta_tensors = {name: t for name, t in [*meta.named_parameters(), *meta.named_buffers()]}
    assert {n: (t.shape, t.dtype) for n, t in tensors.items()} == {
        n: (t.shape, t.dtype) for n, t in meta_tensors.items()
    }
    assert real.weight.numel() == 96 * 40 // 2 and real.weight.dtype == torch.uint8
    before = {name: t.clone() for name, t in tensors.items()}
    real.to(torch.bfloat16)
    assert all(torch.equal(t, before[n]) for n, t in [*real.named_parameters(), *real.named_buffers()])


def test_the_weight_is_bitsandbytes_4bit_and_a_full_weight_loads_quantized():
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    linear = torch.nn.Linear(64, 32, bias=False)
    module = Linear4bit(linear, quant_type="fp4", compute_dtype=torch.float32, double_quant=False)
    packed, state = quantize_4bit(linear.weight.detach(), blocksize=64, quant_type="fp4")
    assert torch.equal(module.weight, packed)
    assert torch.equal(module.dequantized(), dequantize_4bit(packed, state))
    other = torch.randn(32, 64)
    module.load_state_dict({"weight": other})  # as a base loaded from files arrives
    assert torch.equal(module.weight, quantize_4bit(other, blocksize=64, quant_type="fp4")[0])


def test_native_qlora_trains_the_adapters_and_leaves_the_4bit_base_bitwise():
    """Every block linear is 4-bit (targeted or not), the adapters get gradients and no base weight does; three
    steps of the trainer's own step lower the loss and leave every frozen tensor bit for bit as built."""
    raw = native()
    parts = build(raw)
    quantized = dict(quantized_linears(parts.model))
    assert len(quantized) == 2 * 7
    frozen_linears = [
        m for m in parts.model.layers.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
    ]
    assert not frozen_linears  # PEFT's lora_A / lora_B are the only nn.Linear left, and they train
    before = base_state(parts.model)
    data = batches(1, parts.model.vocab_size)
    tokens, labels = data[0]
    logits = parts.model(tokens).logits
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
    adapters = dict(adapter_parameters(parts.model))
    assert adapters and all(p.grad is not None for p in adapters.values())
    # B starts at zero, so at step 0 only B's gradient is nonzero (A's is B^T times the output's)
    assert all(p.grad.abs().sum() > 0 for name, p in adapters.items() if ".lora_B." in name)
    assert all(p.grad is None for name, p in parts.model.named_parameters() if not is_adapter_name(name))
    parts.model.zero_grad(set_to_none=True)
    initial = {name: p.detach().clone() for name, p in adapters.items()}
    trainer = make_trainer(resolve_config(raw), CTX, parts)
    try:
        losses = [trainer.train_step([data[0]]).loss for _ in range(3)]  # one batch, learnt step by step
    finally:
        trainer.close()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[2] < losses[1] < losses[0]
    after = base_state(parts.model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    trained = dict(adapter_parameters(parts.model))
    assert all(not torch.equal(p, initial[name]) for name, p in trained.items() if ".lora_B." in name)


def test_hf_causal_lm_qlora_trains_on_a_4bit_base():
    raw = hf()
    parts = build(raw)
    assert len(dict(quantized_linears(parts.model))) == 2 * 7
    before = base_state(parts.model)
    trainer = make_trainer(resolve_config(raw), CTX, parts)
    try:
        losses = [trainer.train_step(batches(1, 97)).loss for _ in range(3)]
    finally:
        trainer.close()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[2] < losses[0]
    after = base_state(parts.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_base_is_rebuilt_bitwise_and_checkpoints_hold_the_adapters_only():
    """What resume relies on: the 4-bit base comes out of the seed bit for bit again, and the checkpoint's model
    state (frozen parameters skipped, as `CheckpointManager(skip_frozen=True)` saves it) is the adapters; a
    base loaded from full-precision files takes their [out, in] shapes and quantizes them."""
    first, second = build(native()).model, build(native()).model
    assert all(torch.equal(a, b) for a, b in zip(base_state(first).values(), base_state(second).values()))
    saved = get_model_state_dict(first, options=StateDictOptions(ignore_frozen_params=True))
    assert saved and all(is_adapter_name(name) for name in saved)
    shapes = full_weight_shapes(first)
    assert shapes["layers.0.attention.wq.base_layer.weight"] == (64, 64)
    plain = build(native(quant=None), seed=0).model  # the same seed unquantized: the base's full weights
    reloaded = build(native(), seed=5).model
    full = {k: v for k, v in plain.state_dict().items() if k in shapes}
    reloaded.load_state_dict(full, strict=False)
    assert all(torch.equal(m.weight, dict(quantized_linears(first))[n].weight) for n, m in quantized_linears(reloaded))


def test_the_planner_counts_the_base_at_its_4bit_bytes():
    """model_params is the packed weights (half a byte a weight) and their scales, the embedding, head and norms
    at bf16 and the adapters' bf16 copies: the real build's bytes exactly."""
    from internlm_offload.planner.trace import trace_step

    raw = native()
    model = build(raw).model
    real = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *scale_tensors(model)])
    weights = sum(m.in_features * m.out_features for _, m in quantized_linears(model))
    packed = sum(m.weight.numel() for _, m in quantized_linears(model))
    assert packed == weights // 2
    parts = trace_step(resolve_config(raw)).components
    assert parts["model_params"] == real
    unquantized = trace_step(resolve_config(native(quant=None))).components
    assert unquantized["model_params"] - parts["model_params"] > weights  # from 2 B a weight to ~0.53
    assert parts["other_at_rest"] == unquantized["other_at_rest"]  # the masters' copy shares the scales
    # model.lora.base_on_host: those 4-bit bytes are pinned host memory, and the device keeps the rest
    blocks = sum(t.untyped_storage().nbytes() for _, m in quantized_linears(model) for t in
                 [m.weight, *scale_tensors(m)])  # fmt: skip
    hosted = trace_step(resolve_config(native(lora={**LORA, "base_on_host": True}))).components
    assert hosted["host_params"] == hosted["pinned_host_peak"] == blocks
    assert hosted["model_params"] == real - blocks
    # at rest the device keeps block 0's copy (kept from backward for the next forward) and nothing else of the base:
    # the masters' copy shares the scales, which moved to the host with the same tensor objects
    assert hosted["other_at_rest"] - parts["other_at_rest"] == blocks // 2


def test_a_base_loaded_into_the_masters_copy_reaches_the_model_it_trains():
    """bf16: a base from files loads through the masters' copy (the trainer's `state_module`), which shares the 4-bit
    weights and scales with the model: the model's matmuls see the file's weights, quantized."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    parts = build(native())
    trainer = make_trainer(resolve_config(native()), CTX, parts)
    name, module = next(iter(quantized_linears(parts.model)))
    twin = dict(trainer.state_module.named_modules())[name]
    assert twin is not module
    weight = torch.randn(module.out_features, module.in_features)
    twin.load_state_dict({"weight": weight})
    packed, state = quantize_4bit(weight.to(torch.bfloat16), blocksize=64, quant_type="nf4", compress_statistics=True)
    assert torch.equal(module.weight, packed)
    assert torch.equal(module.dequantized(), dequantize_4bit(packed, state))


def test_without_bitsandbytes_a_4bit_base_is_a_one_line_config_error(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"needs bitsandbytes, which is not installed \(pip install"):
        resolve_config(native())

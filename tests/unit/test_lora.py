"""LoRA (docs/lora.md): PEFT's names and layers, a frozen base without gradient, master or optimizer state, and
numerics against PEFT's own LoRA and against the LoRA baseline under the offload features."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from internlm_offload.builder import Components, build_components, make_trainer
from internlm_offload.config import ConfigError, resolve_config
from internlm_offload.config.lora import LoraConfig
from internlm_offload.device import Accelerator
from internlm_offload.engine.runtime import RunContext
from internlm_offload.model.lora import adapter_parameters, is_adapter_name

pytest.importorskip("peft")

CTX = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
SEQ = 16
LLAMA = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    tie_word_embeddings=False,
)


def native(lora: dict | None = None, dtype: str = "torch.bfloat16", **overrides) -> dict:
    model = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_attention_heads": 2, "dtype": dtype}
    if lora is not None:
        model["lora"] = lora
    return {"model": model, "data": {"seq_len": SEQ}, **overrides}


def build(raw: dict, seed: int = 0) -> Components:
    torch.manual_seed(seed)
    return build_components(resolve_config(raw), CTX)


def batches(steps: int, vocab: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens, each labelled by a fixed map of itself (a task an adapter learns in a few steps)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (2, SEQ), generator=gen) for _ in range(steps)]
    return [(t, (t * 7 + 3) % vocab) for t in tokens]


def train(raw: dict, data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], Components]:
    """The trainer's own steps (clipping, masters, optimizer, schedule), one batch of `data` each."""
    parts = build(raw)
    trainer = make_trainer(resolve_config(raw), CTX, parts)
    try:
        losses = [trainer.train_step([batch]).loss for batch in data]
    finally:
        trainer.close()
    return losses, parts


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if not is_adapter_name(name)}


# ---------------------------------------------------------------------------------------------------- config


def test_defaults_are_peft_defaults():
    import peft

    ours, theirs = LoraConfig(), peft.LoraConfig()
    for key in ("r", "lora_alpha", "lora_dropout", "bias"):
        assert getattr(ours, key) == getattr(theirs, key), key


@pytest.mark.parametrize(
    "lora, message",
    [
        ({"r": 0}, "model.lora.r=0: input should be greater than or equal to 1"),
        ({"target_modules": ["q_proj", "qkv"]}, "model.lora.target_modules: 'qkv' is not a linear"),
        ({"target_modules": "q_proj"}, "give a list of module names"),
        ({"bias": "all"}, "model.lora.bias='all'"),
        ({"rank": 4}, "unknown config key 'model.lora.rank'"),
        ({"lora_dropout": 1.0}, "model.lora.lora_dropout=1.0"),
    ],
)
def test_bad_values_are_one_line_config_errors(lora, message):
    with pytest.raises(ConfigError) as info:
        resolve_config(native(lora))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_hf_names_map_to_the_native_linears():
    parts = build(native({"target_modules": ["q_proj", "wk", "down_proj", "gate_proj"]}))
    adapted = {name.split(".")[3] for name, _ in adapter_parameters(parts.model)}
    assert adapted == {"wq", "wk", "w2", "w1"}


def test_an_hf_target_the_model_lacks_is_a_config_error():
    raw = {"model": {"type": "hf_causal_lm", "hf_config": LLAMA, "lora": {"target_modules": ["wqkv"]}}}
    with pytest.raises(ConfigError, match=r"model.lora.target_modules=\['wqkv'\]: no linear of LlamaForCausalLM"):
        build(raw)


# ------------------------------------------------------------------------------------------- frozen base


def test_step_zero_is_the_base_model():
    """B starts at zero: the adapted model's logits are bitwise the base model's from the same seed."""
    tokens = batches(1, 259)[0][0]
    base = build(native(dtype="torch.float32")).model
    adapted = build(native({"target_modules": ["q_proj", "v_proj", "up_proj"]}, dtype="torch.float32")).model
    with torch.no_grad():
        assert torch.equal(adapted(tokens).logits, base(tokens).logits)


def test_frozen_base_has_no_grad_master_or_optimizer_state_and_stays_bitwise():
    """bf16: the base in bf16 with no gradient, no fp32 master and no optimizer state; the adapters' fp32 masters are
    what the optimizer, clipping and the records see; after training the base is bitwise the one built."""
    raw = native({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]})
    parts = build(raw)
    before = base_state(parts.model)
    adapters = {name for name, _ in adapter_parameters(parts.model)}
    masters = dict(parts.masters.module.named_parameters())
    model = dict(parts.model.named_parameters())
    for name, param in model.items():
        if name in adapters:
            assert param.requires_grad and masters[name] is not param and masters[name].dtype == torch.float32
        else:
            assert not param.requires_grad and masters[name] is param and param.dtype == torch.bfloat16
    assert {id(p) for p in parts.masters.master_params()} == {id(masters[name]) for name in adapters}
    records = parts.masters.records()
    assert {id(r.master) for r in records} == {id(masters[name]) for name in adapters}
    trainer = make_trainer(resolve_config(raw), CTX, parts)
    for batch in batches(3, 259):
        trainer.train_step([batch])
    trainer.close()
    stepped = [p for group in parts.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in stepped} == {id(masters[name]) for name in adapters}
    assert {id(p) for p in parts.optimizer.state} <= {id(masters[name]) for name in adapters}
    after = base_state(parts.model)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert all(p.grad is None for name, p in model.items() if name not in adapters)
    assert any(not torch.equal(masters[name], torch.zeros_like(masters[name])) for name in adapters if "lora_B" in name)


def test_adapter_output_is_scaled_by_alpha_over_r():
    """base(x) + lora_alpha / r * B A x, with PEFT's names (r=4, alpha=12: a scale of 3, not 12)."""
    parts = build(native({"r": 4, "lora_alpha": 12, "target_modules": ["q_proj"]}, dtype="torch.float32"))
    wq = parts.model.layers[0].attention.wq
    with torch.no_grad():
        wq.lora_B["default"].weight.normal_()
    x = torch.randn(3, 64)
    a, b = wq.lora_A["default"].weight, wq.lora_B["default"].weight
    expected = x @ wq.base_layer.weight.T + 3.0 * (x @ a.T @ b.T)
    torch.testing.assert_close(wq(x), expected, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------- numerics


def test_follows_peft_get_peft_model_for_20_steps_in_fp32():
    """A small HF Llama: this trainer's LoRA against PEFT's `get_peft_model` on the same model, init and data (AdamW,
    clipping at 1.0, constant lr): the losses within 1e-5 relative at every step."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    steps, lr = 20, 2e-2
    lora = {
        "r": 4,
        "lora_alpha": 8,  # a scale of 2: not r, not alpha
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "lm_head"],
    }
    raw = {
        "model": {"type": "hf_causal_lm", "hf_config": LLAMA, "lora": lora},
        "data": {"seq_len": SEQ},
        "adam": {"lr": lr, "weight_decay": 0.01},
        "lr_scheduler": {"warmup_ratio": 0.0, "eta_min": lr},
    }
    parts = build(raw)
    ours = {name.removeprefix("hf_model."): p.detach().clone() for name, p in parts.model.named_parameters()}
    config = AutoConfig.for_model(**LLAMA)
    config.use_cache = False
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    base.load_state_dict({name.replace(".base_layer", ""): t for name, t in ours.items() if "lora_" not in name})
    theirs = peft.get_peft_model(base, peft.LoraConfig(**lora))
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_" in name:
                param.copy_(ours[name.removeprefix("base_model.model.")])
    trainable = [p for p in theirs.parameters() if p.requires_grad]
    assert len(trainable) == sum(1 for _ in adapter_parameters(parts.model))
    # fused, as the trainer's AdamW on cpu: then the curves are in fact bitwise equal here
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=True)
    data = batches(1, LLAMA["vocab_size"]) * steps  # one batch again and again: the loss falls
    expected = []
    for tokens, labels in data:
        loss = F.cross_entropy(theirs(input_ids=tokens).logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    got, _ = train(raw, data)
    assert expected[-1] < expected[0] - 0.1  # it learns: the comparison is not over a flat curve
    for step, (a, b) in enumerate(zip(got, expected, strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: ours {a!r}, peft {b!r}"


VARIANTS = {
    "activation offload": {"cpu_offloading": {"enable": True, "num_layers": 1}},
    "checkpointing": {"model_checkpoint": 1.0},
    "swap": {"swap_optimizer": True},
    "hybrid": {"hybrid_optimizer": {"enable": True, "offload_fraction": 0.5}},
    "swap + grad offload": {"swap_optimizer": True, "grad_offload": True},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_offload_variants_are_bitwise_the_lora_baseline(variant):
    """bf16 LoRA: activation offload, checkpointing and the offload optimizers of the adapter states give the
    baseline's loss curve and adapter masters, bitwise."""
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}
    base_losses, base_parts = train(native(lora), batches(3, 259))
    overrides = copy.deepcopy(VARIANTS[variant])
    raw = native(lora, **overrides)
    if "model_checkpoint" in overrides:
        raw = native(lora)
        raw["model"]["checkpoint"] = overrides["model_checkpoint"]
    losses, parts = train(raw, batches(3, 259))
    assert losses == base_losses
    expected = dict(base_parts.masters.module.named_parameters())
    for name, master in parts.masters.module.named_parameters():
        assert torch.equal(master, expected[name]), name


def test_dropout_under_checkpointing_is_bitwise():
    """lora_dropout=0.1: checkpointing's recompute draws the same dropout masks as the forward did (torch's
    checkpoint restores the RNG), so the curve is bitwise the plain run's."""
    lora = {"r": 4, "lora_dropout": 0.1, "target_modules": ["q_proj", "down_proj"]}
    plain, _ = train(native(lora), batches(3, 259))
    checkpointed = native(lora)
    checkpointed["model"]["checkpoint"] = 1.0
    assert train(checkpointed, batches(3, 259))[0] == plain
    no_dropout, _ = train(native({**lora, "lora_dropout": 0.0}), batches(3, 259))
    assert no_dropout != plain  # the dropout is on


def test_a_hugging_face_folder_loads_into_the_frozen_base(tmp_path):
    """`ckpt.load_ckpt_info` of an HF Llama folder fills the base (PEFT's `base_layer` names mapped), in bf16, and
    leaves the adapters as drawn."""
    from safetensors.torch import save_file

    from internlm_offload.builder import build_model
    from internlm_offload.engine.start_plan import find_weights_source
    from internlm_offload.model.families.internlm2.hf_export import llama_values
    from internlm_offload.model.families.internlm2.hf_names import HF_LLAMA
    from internlm_offload.model.lora import base_keys
    from internlm_offload.weights.convert import Heads, to_format

    plain = resolve_config(native(dtype="torch.float32")).model
    torch.manual_seed(5)
    reference = {name: t.detach().clone() for name, t in build_model(plain, torch.device("cpu")).state_dict().items()}
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **llama_values(plain)}))
    save_file(to_format(reference, HF_LLAMA, Heads(4, 2)), str(folder / "model.safetensors"))
    raw = native({"target_modules": ["q_proj", "down_proj"]})
    raw["ckpt"] = {"load_ckpt_info": {"path": str(folder), "ckpt_type": "hf_llama"}}
    cfg = resolve_config(raw)
    parts = build(raw)
    adapters = {name: p.detach().clone() for name, p in parts.masters.module.named_parameters() if p.requires_grad}
    make_trainer(cfg, CTX, parts).load_weights_from(find_weights_source(cfg), cfg.model)
    model = dict(parts.model.named_parameters())
    for name, key in base_keys(model).items():
        assert torch.equal(model[key], reference[name].to(torch.bfloat16)), name
    for name, master in parts.masters.module.named_parameters():
        if master.requires_grad:
            assert torch.equal(master, adapters[name]) and torch.equal(model[name], master.to(torch.bfloat16))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"parallel": {"tensor": {"size": 2, "mode": "mtp"}}}, "model.lora with parallel.tensor.size > 1"),
    ],
)
def test_what_lora_does_not_compose_with_yet_is_refused(overrides, message):
    raw = native({})
    raw["model"].update(overrides.pop("model", {}))
    raw.update(overrides)
    with pytest.raises(ConfigError, match=message):
        resolve_config(raw, world_size=2)

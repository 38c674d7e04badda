"""Precision policy, explicit fp32 masters, the fp16 loss scaler and the new config keys."""

import pytest
import torch
import torch.nn as nn

from internlm_offload.config import ConfigError, resolve_config
from internlm_offload.engine.loss_scaler import DynamicLossScaler
from internlm_offload.engine.precision import MasterWeights, PrecisionPolicy, cast_model
from internlm_offload.model import InternLM2


def tiny_model() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_attention_heads=2,
        vocab_size=259,
        tie_word_embeddings=True,
    )


# ----------------------------------------------------------------------------- policy


@pytest.mark.parametrize(
    "dtype, masters, param_dtype, scaling, fsdp_policy",
    [
        ("torch.float32", True, torch.float32, False, False),
        ("torch.bfloat16", True, torch.float32, False, True),
        ("torch.bfloat16", False, torch.bfloat16, False, False),
        ("torch.float16", True, torch.float32, True, True),
        ("torch.float16", False, torch.float16, True, False),
    ],
)
def test_policy_dtypes(dtype, masters, param_dtype, scaling, fsdp_policy):
    policy = PrecisionPolicy.from_config(dtype, masters)
    assert policy.param_dtype == param_dtype
    assert policy.loss_scaling == scaling
    mp = policy.fsdp_mixed_precision()
    assert (mp is not None) == fsdp_policy
    if mp is not None:
        assert mp.param_dtype == policy.compute_dtype and mp.reduce_dtype == torch.float32


def test_cast_model_keeps_fp32_masters_outside_fsdp():
    model = tiny_model()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = cast_model(model, PrecisionPolicy(torch.bfloat16), fsdp=False)
    assert masters is not None
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for name, master in masters.module.named_parameters():
        assert master.dtype == torch.float32 and torch.equal(master, reference[name])  # the init, unrounded
    assert masters.module.output.weight is masters.module.tok_embeddings.weight  # ties survive
    assert cast_model(tiny_model(), PrecisionPolicy(torch.bfloat16), fsdp=True) is None  # FSDP2 owns them
    pure = tiny_model()
    assert cast_model(pure, PrecisionPolicy(torch.bfloat16, master_weights=False), fsdp=False) is None
    assert all(p.dtype == torch.bfloat16 for p in pure.parameters())


def test_master_grads_accumulate_in_fp32_and_round_into_the_model():
    model = nn.Linear(4, 3, bias=False)
    masters = MasterWeights(model, torch.bfloat16)
    micro = [torch.full((3, 4), 1.0, dtype=torch.bfloat16), torch.full((3, 4), 2.0**-9, dtype=torch.bfloat16)]
    for grad in micro:
        model.weight.grad = grad.clone()
        masters.accumulate_grads()
        assert model.weight.grad is None  # the low-precision grad is freed at once
    master = masters.module.weight
    # 1 + 2^-9 is not a bf16 number: accumulating in bf16 would lose the second micro-batch entirely.
    assert torch.equal(master.grad, torch.full((3, 4), 1.0 + 2.0**-9))
    masters.reduce_grads(distributed=False)
    with torch.no_grad():
        master.add_(2.0**-12)  # an update too small for bf16
    masters.copy_to_model()
    assert torch.equal(model.weight, master.to(torch.bfloat16))
    assert not torch.equal(model.weight.float(), master)  # the master kept what bf16 cannot hold
    masters.release_grads()
    assert master.grad is None


# ----------------------------------------------------------------------------- loss scaler


def test_loss_scaler_follows_internevo_hysteresis_and_growth():
    scaler = DynamicLossScaler(scale=1024.0, min_scale=256.0, max_scale=4096.0, growth_interval=3, hysteresis=2)
    scaler.update(overflow=True)
    assert scaler.scale == 1024.0  # first overflow: tolerated (step skipped, scale kept)
    scaler.update(overflow=True)
    assert scaler.scale == 512.0
    scaler.update(overflow=True)
    assert scaler.scale == 256.0  # past hysteresis every overflow backs off
    scaler.update(overflow=True)
    assert scaler.scale == 256.0  # min_scale
    for _ in range(2):
        scaler.update(overflow=False)
    assert scaler.scale == 256.0
    scaler.update(overflow=False)
    assert scaler.scale == 512.0 and scaler.hysteresis_step == 0  # growth resets the hysteresis count
    for _ in range(9):
        scaler.update(overflow=False)
    assert scaler.scale == 4096.0  # max_scale


def test_loss_scaler_state_round_trips_without_the_settings():
    scaler = DynamicLossScaler(scale=8.0, growth_interval=5)
    scaler.update(overflow=False)
    other = DynamicLossScaler(scale=2.0**16, growth_interval=7)
    other.load_state_dict(scaler.state_dict())
    assert (other.scale, other.growth_step, other.growth_interval) == (8.0, 1, 7)


# ----------------------------------------------------------------------------- config


def test_internevo_grad_scaler_section_resolves():
    raw = {
        "model": {"dtype": "torch.float16"},
        "grad_scaler": {
            "fp16": {"initial_scale": 2**16, "min_scale": 1, "growth_interval": 1000},
            "growth_factor": 2,
            "backoff_factor": 0.5,
            "max_scale": 2**24,
            "hysteresis": 2,
        },
    }
    cfg = resolve_config(raw)
    assert cfg.grad_scaler.fp16.initial_scale == 65536.0 and cfg.grad_scaler.hysteresis == 2


@pytest.mark.parametrize(
    "raw, part",
    [
        ({"grad_scaler": {"fp16": {"initial_scale": 0.5}}}, "fp16.min_scale <= fp16.initial_scale"),
        ({"grad_scaler": {"backoff_factor": 1.5}}, "grad_scaler.backoff_factor=1.5"),
        ({"ckpt": {"load_ckpt_info": {"path": "b", "content": ("optimizer",)}}}, "content"),
        ({"ckpt": {"load_ckpt_info": {"path": "b", "ckpt_type": "safetensors"}}}, "ckpt_type='safetensors'"),
        ({"ckpt": {"load_ckpt_info": {"path": "b", "content": ("model", "all")}}}, 'use ("model",) or ("all",)'),
        ({"max_skipped_steps": 0}, "max_skipped_steps=0"),
        ({"mixed_precision": {"master_weight": False}}, "did you mean 'mixed_precision.master_weights'"),
    ],
)
def test_bad_precision_and_load_keys_are_one_line(raw, part):
    with pytest.raises(ConfigError) as err:
        resolve_config(raw)
    message = str(err.value)
    assert part in message and "\n" not in message


def test_load_ckpt_info_defaults_to_model_only():
    cfg = resolve_config({"ckpt": {"load_ckpt_info": {"path": "runs/a", "content": ("model",)}}})
    assert cfg.ckpt.load_ckpt_info.content == ["model"] and cfg.ckpt.load_ckpt_info.ckpt_type == "internevo"


def test_only_the_named_masters_live_on_the_host():
    model = tiny_model()
    hosted = []

    def host_empty(shape, dtype):
        hosted.append(torch.empty(shape, dtype=dtype))
        return hosted[-1]

    names = {"layers.0.attention.wq.weight", "norm.weight"}
    masters = MasterWeights(model, torch.bfloat16, host_empty, names)
    assert not masters.on_host and len(hosted) == 2
    by_name = dict(masters.module.named_parameters())
    records = {id(r.master): r for r in masters.records()}
    assert len(records) == len(by_name)  # every master is trainable here
    for name, master in by_name.items():
        on_host = any(master.data_ptr() == h.data_ptr() for h in hosted)
        record = records[id(master)]
        assert on_host == (name in names) == record.on_host == (record.model_param is not None), name
    grads = masters.grads()
    norm, embedding = records[id(by_name["norm.weight"])], records[id(by_name["tok_embeddings.weight"])]
    assert norm.device_grad is not None and norm.master.grad is None
    assert embedding.master.grad is not None and embedding.device_grad is None
    with torch.no_grad():
        for master in by_name.values():
            master.add_(1.0)
    masters.after_step()  # device masters only: the optimizer writes host ones itself
    params = dict(model.named_parameters())
    assert torch.equal(params["tok_embeddings.weight"], by_name["tok_embeddings.weight"].to(torch.bfloat16))
    assert not torch.equal(params["norm.weight"], by_name["norm.weight"].to(torch.bfloat16))
    masters.copy_to_model()  # after a load: all of them
    assert torch.equal(params["norm.weight"], by_name["norm.weight"].to(torch.bfloat16))
    assert len(grads) == len(by_name)

"""The per-parameter record: the masters layer owns it, the optimizers read it, no parameter carries protocol
attributes."""

import pytest
import torch

from internlm_offload.builder import Components, build_components
from internlm_offload.config import resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.runtime import RunContext
from internlm_offload.optim.records import ParamRecord
from internlm_offload.optim.swap import SwapAdamW

PROTOCOL_ATTRIBUTES = ("main_grad", "model_param", "host_grad")
OPTIMIZERS = {
    "swap": {"swap_optimizer": True},
    "hybrid": {"hybrid_optimizer": {"enable": True, "offload_fraction": 0.5}},
}
GRADS_ON_HOST = {  # gradient offload takes the whole CPU share: the hybrid optimizer steps everything there
    "swap": {"swap_optimizer": True},
    "hybrid": {"hybrid_optimizer": {"enable": True, "offload_fraction": 1.0}},
}


def build(dtype: str = "torch.bfloat16", **overrides) -> Components:
    cfg = resolve_config(
        {
            "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "dtype": dtype},
            "data": {"seq_len": 16},
            **overrides,
        }
    )
    return build_components(cfg, RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu")))


def micro_batch(parts: Components) -> None:
    """One forward and backward, then the trainer's accumulation call."""
    tokens = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))
    parts.model(tokens).logits.float().square().mean().backward()
    parts.masters.accumulate_grads()


def finish_step(parts: Components) -> None:
    """The trainer's end of a step, after clipping read `grads()`."""
    parts.optimizer.step()
    parts.masters.after_step()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.masters.release_grads()


def close(parts: Components) -> None:
    parts.optimizer.close()
    if hasattr(parts.masters, "close"):  # gradient offload's hooks, stream and thread
        parts.masters.close()


def assert_no_protocol_attributes(parts: Components) -> None:
    for param in [*parts.model.parameters(), *parts.masters.master_params()]:
        assert not any(hasattr(param, name) for name in PROTOCOL_ATTRIBUTES)


def handed_to_optimizer(parts: Components) -> list[ParamRecord]:
    """The records the optimizer reads: the masters' own objects, one per parameter it steps."""
    records = parts.masters.records()
    assert {id(r) for r in parts.optimizer._records.values()} == {id(r) for r in records}
    stepped = [p for group in parts.optimizer.param_groups for p in group["params"] if p.requires_grad]
    assert sorted(id(r.master) for r in records) == sorted(id(p) for p in stepped)  # groups reorder them
    return records


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_host_masters_get_their_device_gradient_in_the_record(optimizer):
    """bf16 with fp32 masters on the host: `device_grad` is a view of the masters' flat buffer from the first
    micro-batch to `release_grads()`, `model_param` aliases the model's parameter; no attribute on any parameter."""
    parts = build(**OPTIMIZERS[optimizer])
    records = handed_to_optimizer(parts)
    hosted = [r for r in records if r.on_host]
    assert hosted and (optimizer != "swap" or len(hosted) == len(records))
    for record in hosted:
        assert record.model_param.data_ptr() == record.model.data_ptr()
        assert record.model_param.dtype == torch.bfloat16 and record.master.dtype == torch.float32
    micro_batch(parts)
    grads = parts.masters.grads()
    flat = grads[0].untyped_storage()
    assert all(g.untyped_storage().data_ptr() == flat.data_ptr() for g in grads)  # one flat buffer
    for record, grad in zip(records, grads):
        if record.on_host:
            assert record.device_grad.data_ptr() == grad.data_ptr() and record.master.grad is None
        else:
            assert record.device_grad is None and record.master.grad.data_ptr() == grad.data_ptr()
        assert record.host_grad is None
    assert_no_protocol_attributes(parts)
    before = [r.model.detach().clone() for r in hosted]
    finish_step(parts)
    assert all(r.device_grad is None for r in records)
    # the optimizer rounded each host master's update into its `model_param`, the model's own parameter
    assert any(not torch.equal(r.model, b) for r, b in zip(hosted, before))
    assert all(torch.equal(r.model, r.master.detach().to(torch.bfloat16)) for r in hosted)
    assert_no_protocol_attributes(parts)
    close(parts)


@pytest.mark.parametrize("optimizer", GRADS_ON_HOST)
@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float32"])
def test_gradient_offload_sets_host_grad_until_release(optimizer, dtype):
    """Gradient offload writes every record's `host_grad` when `grads()` hands them over and clears it after the
    step; the device gradient buffer never exists."""
    parts = build(dtype, **GRADS_ON_HOST[optimizer], grad_offload=True)
    records = handed_to_optimizer(parts)
    assert all(r.host_grad is None for r in records)
    micro_batch(parts)
    grads = parts.masters.grads()
    assert len(grads) == len(records)
    for record, grad in zip(records, grads):
        assert record.host_grad is not None and record.host_grad.data_ptr() == grad.data_ptr()
        assert record.device_grad is None and record.master.grad is None and record.model.grad is None
    assert_no_protocol_attributes(parts)
    finish_step(parts)
    assert all(r.host_grad is None and r.device_grad is None for r in records)
    assert_no_protocol_attributes(parts)
    close(parts)


def test_a_record_names_the_model_tensor_exactly_when_its_master_lives_on_the_host():
    param = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="model_param exactly when"):
        ParamRecord(param, param, "host")
    with pytest.raises(ValueError, match="model_param exactly when"):
        ParamRecord(param, param, "device", model_param=param.detach())


def test_swap_optimizer_refuses_host_records_without_swap_params():
    """A host master's record without `swap_params`: its update would never reach the model."""
    master = torch.nn.Parameter(torch.ones(3))
    model = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    record = ParamRecord(model, master, "host", model_param=model.detach())
    with pytest.raises(ValueError, match="need swap_params=True"):
        SwapAdamW([master], records=[record], accelerator=Accelerator("cpu"))
    SwapAdamW([master], records=[record], swap_params=True, accelerator=Accelerator("cpu")).close()

"""LoRA's meta-device build under FSDP2 (docs/lora.md "How it is built"): the adapters are injected on the meta
model, the shards materialized (on the host with the CPU offload policy) and drawn as the whole build draws them, the
base first and then PEFT's kaiming A and zero B, so the initial model, the generator after the build and the losses
are bitwise those of the build without meta. One process (a gloo group of one rank)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from internlm_offload.builder import build_components, make_trainer
from internlm_offload.builder.model import builds_on_meta
from internlm_offload.config import resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.precision import PrecisionPolicy
from internlm_offload.engine.runtime import RunContext
from internlm_offload.model.lora import is_adapter_name

pytest.importorskip("peft")

CTX = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
SEQ, VOCAB = 16, 259
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def config(dtype: str, **parallel) -> dict:
    model = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_attention_heads": 2}
    model.update(dtype=dtype, vocab_size=VOCAB, lora=LORA)
    return {"model": model, "data": {"seq_len": SEQ}, "parallel": {"mode": "fsdp2", **parallel}}


def build_and_train(raw: dict, steps: int = 3) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[float]]:
    """(the initial weights, whole; the generator's state after the build; the losses of `steps` steps)."""
    cfg = resolve_config(raw)
    torch.manual_seed(0)
    parts = build_components(cfg, CTX)
    rng = torch.get_rng_state()
    weights = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in parts.model.named_parameters()
    }
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(steps)]
    trainer = make_trainer(cfg, CTX, parts)
    try:
        losses = [trainer.train_step([(t, (t * 7 + 3) % VOCAB)]).loss for t in tokens]
    finally:
        trainer.close()
    return weights, rng, losses


@pytest.mark.parametrize(
    "dtype, cpu_offload",
    [("torch.bfloat16", False), ("torch.bfloat16", True), ("torch.float32", False)],
    ids=["bf16", "bf16 shards on host", "fp32"],
)
def test_meta_build_is_bitwise_the_whole_build(group_of_one, dtype, cpu_offload):
    """Weights (the bf16 base rounded from the fp32 draw, the fp32 adapters), the generator and 3 steps' losses
    (the 2nd and 3rd depend on A through the first update) equal the build without meta, bit for bit."""
    raw = config(dtype, meta_init=True, fsdp_cpu_offload=cpu_offload)
    cfg = resolve_config(raw)
    assert builds_on_meta(cfg, PrecisionPolicy.from_config(cfg.model.dtype, cfg.mixed_precision.master_weights))
    got, got_rng, got_losses = build_and_train(raw)
    expected, rng, losses = build_and_train(config(dtype, meta_init=False, fsdp_cpu_offload=cpu_offload))
    assert got.keys() == expected.keys()
    adapters = [name for name in got if is_adapter_name(name)]
    assert len(adapters) == 2 * 6 * 2
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    for name in adapters:  # A drawn, B zero: the comparison above is not one of zeros
        assert (got[name].abs().sum() > 0) == (".lora_A." in name), name
    assert torch.equal(got_rng, rng)
    assert got_losses == losses and len(set(losses)) == 3

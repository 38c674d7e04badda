"""`model.lora.base_on_host` (docs/lora.md "Base on the host"): the frozen block linears in host memory, brought
to the device a block at a time for forward and again for backward on a copy lane. Only bytes move, so the run is
bitwise the LoRA baseline; the device peak falls by the base's block bytes less the two blocks on the device."""

import gc

import pytest
import torch

from internlm_offload.builder import build_components, make_trainer
from internlm_offload.config import ConfigError, resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.runtime import RunContext
from internlm_offload.model.experts import HostedGroupedExperts
from internlm_offload.offload.hosted_base import HostedLinear

pytest.importorskip("peft")

ACC = Accelerator("cpu")
CTX = RunContext(rank=0, local_rank=0, world_size=1, accelerator=ACC)
SEQ, VOCAB = 16, 259
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


def config(base_on_host: bool, width: int = 64, **overrides) -> dict:
    model = {"num_layers": 3, "hidden_size": width, "num_attention_heads": 4, "num_kv_attention_heads": 2}
    model.update(dtype="torch.bfloat16", vocab_size=VOCAB, lora={**LORA, "base_on_host": base_on_host})
    model.update(overrides.pop("model", {}))
    return {"model": model, "data": {"seq_len": SEQ}, **overrides}


def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(step)
    tokens = [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(2)]
    return [(t, (t * 7 + 3) % VOCAB) for t in tokens]


def train(raw: dict, steps: int = 3, copy_delay_s: float = 0.0) -> tuple[list[tuple[float, float]], dict, list]:
    """((loss, grad norm) per step, the adapters' masters and the base after training, blocks brought per step)."""
    cfg = resolve_config(raw)
    torch.manual_seed(0)
    parts = build_components(cfg, CTX)
    hosted = parts.hosted_base
    if hosted is not None and copy_delay_s:  # injected copy latency: a use before the copy's end reads garbage
        hosted.lane.stream = ACC.stream(delay_s=copy_delay_s)
    trainer = make_trainer(cfg, CTX, parts)
    results, brought = [], []
    try:
        with ACC.check_ordering():  # a copy submitted before the lane waited for the compute stream raises
            for step in range(steps):
                results.append(trainer.train_step(micro_batches(step)))
                if hosted is not None:
                    figures = hosted.metrics()
                    assert figures["base_on_host_copy_s"] > 0 and figures["base_on_host_bytes"] > 0
                    brought.append(figures["base_on_host_blocks"])
    finally:
        trainer.close()
    state = {name: p.detach().clone() for name, p in parts.masters.module.named_parameters()}
    return [(r.loss, r.grad_norm) for r in results], state, brought


VARIANTS = {
    "plain": {},
    "checkpointing": {"model": {"checkpoint": 1.0}},
    "activation offload": {"cpu_offloading": {"enable": True, "num_layers": 2}},
}


def test_a_4bit_base_on_host_is_bitwise_the_qlora_baseline():
    """QLoRA (model.quantization_config): the packed weights and their scales live on the host and come in a block
    at a time, as the bf16 base does; losses, grad norms, adapter masters and the packed base bitwise."""
    pytest.importorskip("bitsandbytes")
    from internlm_offload.model.quantized import HostedLinear4bit

    quant = {"model": {"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                               "bnb_4bit_use_double_quant": True}}}  # fmt: skip
    expected, expected_state, _ = train(config(False, **quant))
    got, state, brought = train(config(True, **quant), copy_delay_s=0.002)
    assert got == expected and len({loss for loss, _ in got}) == 3
    for name, tensor in expected_state.items():
        assert torch.equal(state[name], tensor), name
    assert brought == [1 + 2 * 3, 2 * 3, 2 * 3]  # as for the bf16 base (test_base_on_host_is_bitwise_...)
    hosted = build_components(resolve_config(config(True, **quant)), CTX).hosted_base
    linears = [linear for block in hosted.blocks for linear in block]
    assert len(linears) == 3 * 7 and all(type(linear) is HostedLinear4bit for linear in linears)
    assert hosted.host_bytes == sum(t.untyped_storage().nbytes() for lin in linears for t in [
        lin.weight, *(getattr(lin, n) for n in lin.host_tensor_names()[1:])])  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
def test_base_on_host_is_bitwise_the_lora_baseline(variant):
    """3 steps of 2 micro-batches over 3 blocks: losses, grad norms, adapter masters and the base, bitwise; every
    block is brought in for each forward and again for each backward (the copies delayed on their lane, so a
    copy used before its end shows)."""
    expected, expected_state, _ = train(config(False, **VARIANTS[variant]))
    got, state, brought = train(config(True, **VARIANTS[variant]), copy_delay_s=0.002)
    assert got == expected and len({loss for loss, _ in got}) == 3
    assert state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert torch.equal(state[name], tensor), name
    # per micro-batch: forward brings blocks 1, 2 (0 stays from the last backward; the first forward brings it
    # too), backward block 0 (1 stays from forward's turn): 3 blocks each, so the base crosses about twice
    assert brought == [1 + 2 * 3, 2 * 3, 2 * 3]


def test_a_hugging_face_models_base_on_host_is_bitwise_its_lora_baseline():
    """`model.type="hf_causal_lm"` (transformers' Llama, 3 blocks): its decoder layers' frozen linears go to the host
    and come in a block at a time as the native decoder's do (built on the device, then moved: no meta build for
    transformers' modules); losses, grad norms and the adapters' masters bitwise, the same blocks brought."""
    hf = {"model": {"type": "hf_causal_lm", "hf_config": {**LLAMA, "num_hidden_layers": 3, "vocab_size": VOCAB}}}
    expected, expected_state, _ = train(config(False, **hf))
    got, state, brought = train(config(True, **hf), copy_delay_s=0.002)
    assert got == expected and len({loss for loss, _ in got}) == 3
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in expected_state.items())
    assert brought == [1 + 2 * 3, 2 * 3, 2 * 3]


MOE = {"num_experts": 4, "top_k": 2, "moe_type": "GShard", "num_shared_experts": 1, "mlp_ratio": 1.0}


@pytest.mark.parametrize("variant", ["plain", "checkpointing"])
def test_a_mixture_of_experts_base_on_host_is_bitwise_its_lora_baseline(variant):
    """A GShard mixture of experts (4 experts, a shared one): the stacked experts go to the host with the frozen
    linears and come in with their block; their backward recomputes the experts on the saved rows with the weights
    brought in again. Losses, grad norms, adapter masters and the base bitwise the LoRA baseline's; the experts are
    the largest part of what the host holds."""
    moe = {"model": {**MOE, **VARIANTS[variant].get("model", {})}, "loss": {"moe_loss_coeff": 0.01}}
    expected, expected_state, _ = train(config(False, **moe))
    got, state, brought = train(config(True, **moe), copy_delay_s=0.002)
    assert got == expected and len({loss for loss, _ in got}) == 3
    assert all(torch.equal(state[name], tensor) for name, tensor in expected_state.items())
    assert brought == [1 + 2 * 3, 2 * 3, 2 * 3]
    hosted = build_components(resolve_config(config(True, **moe)), CTX).hosted_base
    experts = [m for block in hosted.blocks for m in block if type(m) is HostedGroupedExperts]
    assert len(experts) == 3
    expert_bytes = sum(t.numel() * t.element_size() for m in experts for t in (m.w1, m.w3, m.w2))
    assert expert_bytes > hosted.host_bytes / 2


def step_peak(on_host: bool) -> tuple[int, list[list]]:
    """The device peak of a second step (width 256), and the frozen linears of each block when on the host."""
    gc.collect()  # the previous run's tensors go before this build marks the memory baseline
    cfg = resolve_config(config(on_host, width=256))
    torch.manual_seed(0)
    parts = build_components(cfg, CTX)
    blocks = [] if parts.hosted_base is None else parts.hosted_base.blocks
    trainer = make_trainer(cfg, CTX, parts)
    try:
        trainer.train_step(micro_batches(0))
        ACC.reset_peak_memory_stats()
        trainer.train_step(micro_batches(1))
        return ACC.max_memory_allocated(), blocks
    finally:
        trainer.close()


def test_the_base_lives_on_the_host_and_the_device_peak_falls_by_it():
    """The step's device peak falls by the frozen block linears' bytes less two blocks' (the current one and the
    next on its way), within 10 % of the base's bytes (1.52 MB against 4.42 - 2 x 1.47 MB when written)."""
    step_peak(False)  # the first run in a process pays the kernels' lazy buffers (oneDNN's: 16 MB here)
    peak, _ = step_peak(False)
    hosted_peak, blocks = step_peak(True)
    linears = [linear for block in blocks for linear in block]
    assert len(linears) == 3 * 7 and all(isinstance(linear, HostedLinear) for linear in linears)
    assert all(p.is_shared() for linear in linears for p in linear.parameters())  # host_empty: /dev/shm on cpu
    block_bytes = [sum(p.numel() * p.element_size() for lin in block for p in lin.parameters()) for block in blocks]
    base_bytes = sum(block_bytes)
    expected = base_bytes - 2 * max(block_bytes)
    assert abs(peak - hosted_peak - expected) < 0.1 * base_bytes, (peak, hosted_peak, expected, base_bytes)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"parallel": {"mode": "fsdp2"}}, "model.lora.base_on_host=True with parallel.mode='fsdp2'"),
        (
            {"model": {"num_experts": 4}, "parallel": {"mode": "ddp", "expert": {"size": 2}}},
            "base_on_host=True with parallel.expert.size=2: the experts are hosted on one rank's blocks only",
        ),
    ],
)
def test_what_it_does_not_compose_with_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config(config(True, **overrides), world_size=2)


def built(meta_init: bool) -> tuple[dict, dict, int, torch.Tensor, int]:
    """The model's and the masters' tensors right after the build (width 256), the build's device peak, the torch
    generator's state after it, and the base's bytes on the host."""
    gc.collect()
    cfg = resolve_config(config(True, width=256, parallel={"meta_init": meta_init}))
    torch.manual_seed(0)
    parts = build_components(cfg, CTX)
    peak = ACC.max_memory_allocated()
    model = {name: p.detach().clone() for name, p in parts.model.named_parameters()}
    masters = {name: p.detach().clone() for name, p in parts.masters.module.named_parameters()}
    return model, masters, peak, torch.get_rng_state(), parts.hosted_base.host_bytes


def test_the_meta_build_draws_the_base_into_host_memory_as_the_whole_build_draws_it():
    """`parallel.meta_init` (the default): built on meta, the frozen linears drawn straight into host buffers at the
    compute dtype. Every weight, master and the generator after the build are bitwise the whole device build's;
    the build's device peak falls by the fp32 base less one weight (8.4 MiB of fp32 base here: 9.4 -> 1.2 MiB
    when written) and stays under half the bf16 base, which the device never holds."""
    model, masters, meta_peak, rng, base = built(meta_init=True)
    want_model, want_masters, whole_peak, want_rng, _ = built(meta_init=False)
    assert model.keys() == want_model.keys() and masters.keys() == want_masters.keys()
    assert all(torch.equal(model[n], want_model[n]) for n in model)
    assert all(torch.equal(masters[n], want_masters[n]) for n in masters)
    assert torch.equal(rng, want_rng)
    assert whole_peak - meta_peak > 0.9 * 2 * base and meta_peak < base / 2

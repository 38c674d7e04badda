"""The one model output (model/output.py): every model family built here returns a `ModelOutput` whose auxiliary
losses are named and unweighted; the trainer applies each one's coefficient, so at a coefficient of 0 a mixture of
experts trains on its token loss alone, bit for bit."""

import pytest
import torch
from tiny_configs import TINY_HF_LLAMA

from internlm_offload.builder import Components, build_components, make_trainer
from internlm_offload.config import RunConfig, resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.loss import token_loss_sum
from internlm_offload.engine.runtime import RunContext
from internlm_offload.model.output import MOE_AUX, ModelOutput

pytest.importorskip("transformers")

CTX = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
SEQ, VOCAB = 16, 259
NATIVE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_attention_heads": 2}
EXPERTS = {"num_experts": 4, "top_k": 2, "moe_type": "GShard", "num_shared_experts": 1, "mlp_ratio": 1.0}
LLAMA = {**TINY_HF_LLAMA, "vocab_size": VOCAB}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
# each family's model and loss sections, and the coefficient of each auxiliary loss its model returns
FAMILIES: dict[str, tuple[dict, dict, dict[str, float]]] = {
    "native_dense": (NATIVE, {}, {}),
    "native_moe": ({**NATIVE, **EXPERTS}, {"moe_loss_coeff": 0.01}, {MOE_AUX: 0.01}),
    "hf_dense": ({"type": "hf_causal_lm", "hf_config": LLAMA}, {}, {}),
    "hf_moe": ({"type": "hf_causal_lm", "hf_config": {**MIXTRAL, "router_aux_loss_coef": 0.02}}, {}, {MOE_AUX: 0.02}),
}


def family_config(family: str) -> RunConfig:
    model, loss, _ = FAMILIES[family]
    return resolve_config({"model": {**model, "dtype": "torch.float32"}, "loss": loss, "data": {"seq_len": SEQ}})


def build(cfg: RunConfig) -> Components:
    torch.manual_seed(0)
    return build_components(cfg, CTX)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return tokens, torch.roll(tokens, -1, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_returns_one_model_output_with_its_losses_named(family: str) -> None:
    """Native and Hugging Face, dense and mixture of experts: a `ModelOutput`, the dense models' losses empty; the
    builder holds a coefficient for each loss the model names (the config's, or the HF config's own)."""
    parts = build(family_config(family))
    with torch.no_grad():
        out = parts.model(batch()[0])
    assert type(out) is ModelOutput and out.logits.shape == (2, SEQ, VOCAB)
    assert out.aux_losses.keys() == FAMILIES[family][2].keys() == parts.aux_loss_coefficients.keys()
    assert parts.aux_loss_coefficients == FAMILIES[family][2]
    assert all(loss.shape == () and loss.dtype == torch.float32 for loss in out.aux_losses.values())


@pytest.mark.parametrize("family", ["native_moe", "hf_moe"])
def test_a_coefficient_of_0_leaves_the_loss_and_gradients_of_the_token_loss_alone(family: str) -> None:
    """The trainer's forward and backward of a mixture of experts with its aux loss weighted by 0: the loss and
    every gradient are bitwise those of the token loss alone on the same model (the dense computation), and the
    weighted aux loss it reports is 0. A model that weighed its own loss would keep it here."""
    cfg = family_config(family)
    parts = build(cfg)
    parts.aux_loss_coefficients = {MOE_AUX: 0.0}
    trainer = make_trainer(cfg, CTX, parts)
    tokens, labels = batch()
    token_weight = 1 / labels.numel()
    try:
        loss_sum, aux = trainer.forward_backward((tokens, labels), token_weight, aux_weight=0.5)
    finally:
        trainer.close()
    grads = {name: p.grad.clone() for name, p in parts.model.named_parameters() if p.grad is not None}
    parts.model.zero_grad(set_to_none=True)
    dense_sum = token_loss_sum(parts.model(tokens).logits, labels)
    (dense_sum * token_weight).backward()
    dense = {name: p.grad for name, p in parts.model.named_parameters() if p.grad is not None}
    assert torch.equal(loss_sum, dense_sum.detach()) and aux.keys() == {MOE_AUX} and aux[MOE_AUX].item() == 0.0
    assert grads.keys() == dense.keys() and all(torch.equal(grads[name], dense[name]) for name in dense)

"""The balancing loss of Qwen3-Next / Qwen3.5-MoE (model.type='qwen3_next') and GPT-OSS ('gpt_oss'): a folder
transformers made with `output_router_logits=True` gives transformers' step-1 loss (its load-balancing loss times
`router_aux_loss_coef` included) and grad norm from the folder alone; `model.balancing_loss` from a config file does
the same for a folder without it; XTuner's loss of a softmax router by hand; what the config refuses."""

from pathlib import Path

import pytest
import torch
from folder_parity import grad_norm, step_1_ids

from internlm_offload.builder.model import aux_loss_coefficients, build_model
from internlm_offload.config import ConfigError, load_config_file, resolve_config
from internlm_offload.engine.loss import weighted_aux_losses
from internlm_offload.model.balancing import balancing_loss
from internlm_offload.model.hooks import PoolsRouterStats
from internlm_offload.model.output import MOE_AUX
from internlm_offload.model.router import Router

transformers = pytest.importorskip("transformers")

VOCAB, COEF = 259, 0.1
_QWEN = {"vocab_size": VOCAB, "hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 40,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
         "num_experts_per_tok": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
         "linear_value_head_dim": 8, "max_position_embeddings": 256}  # fmt: skip
_GPT_OSS = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 32, "head_dim": 16, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3,
            "sliding_window": 4, "max_position_embeddings": 256}  # fmt: skip
# model.type, the causal LM, its config (Qwen3-Next with block 1 dense: its router logits are not in the loss), attention
KINDS = {
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                   {**_QWEN, "intermediate_size": 48, "mlp_only_layers": [1]}, "sdpa"),
    "qwen3_5_moe_text": ("qwen3_next", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", _QWEN, "sdpa"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM", "GptOssConfig", _GPT_OSS, "eager"),
}  # fmt: skip


def transformers_folder(folder: Path, kind: str, output_router_logits: bool) -> torch.nn.Module:
    """A seeded random causal LM of `kind` with `router_aux_loss_coef=COEF`, saved: norms, biases and sinks made to
    count, the routers' weights (and GPT-OSS's router bias) large enough that the tokens crowd some experts."""
    torch.manual_seed(0)
    _, model_class, config_class, config, attn = KINDS[kind]
    hf_config = getattr(transformers, config_class)(
        **config, router_aux_loss_coef=COEF, output_router_logits=output_router_logits, attn_implementation=attn
    )
    model = getattr(transformers, model_class)(hf_config)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5) if kind == "gpt_oss" else tensor.uniform_(-0.5, 0.5)
            elif key.endswith(("mlp.gate.weight", "router.weight")):
                tensor.normal_(0, 0.5)
            elif key.endswith(("_bias", ".bias")) or key.endswith("sinks"):
                tensor.normal_(0, 0.3)
    model.save_pretrained(folder)
    return model


def load(options: dict, tmp_path: Path):
    """The run config of a config file holding `options` (dotted keys), resolved as train.py resolves it."""
    path = tmp_path / "run.py"
    path.write_text("\n".join(f"{key} = {value!r}" for key, value in options.items()) + "\n")
    return resolve_config(load_config_file(path), 1)


def assert_transformers_step_1(cfg, reference: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The native model of `cfg`: its next-token loss plus its weighted auxiliary losses (what the trainer adds) and
    its grad norm are transformers' `reference`'s labels loss (aux included) within 1e-5; the weighted aux loss."""
    torch.manual_seed(0)
    model = build_model(cfg.model, torch.device("cpu"))
    out = model(ids)
    aux = weighted_aux_losses(out.aux_losses, aux_loss_coefficients(cfg, model))
    got = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    got = got + sum(aux.values())
    want = reference(ids, labels=ids, output_router_logits=True)
    want.loss.backward()
    got.backward()
    torch.testing.assert_close(got, want.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad_norm(model), grad_norm(reference), rtol=0, atol=1e-5)
    torch.testing.assert_close(aux[MOE_AUX], COEF * want.aux_loss, rtol=0, atol=1e-6)
    return aux[MOE_AUX]


@pytest.mark.parametrize("kind", KINDS)
def test_a_folder_with_output_router_logits_trains_with_transformers_loss(tmp_path, kind):
    """config.json's output_router_logits=True, router_aux_loss_coef=0.1: the run adds transformers' balancing loss
    times 0.1, as transformers' labels loss does, with no key of the run's config."""
    reference = transformers_folder(tmp_path / "hf", kind, output_router_logits=True)
    cfg = load({"model": {"type": KINDS[kind][0], "hf_path": str(tmp_path / "hf")}}, tmp_path)
    aux = assert_transformers_step_1(cfg, reference, step_1_ids(VOCAB, 70))
    assert aux.item() > 0.1  # a balanced router's loss is about k = 2, times 0.1: the loss counts

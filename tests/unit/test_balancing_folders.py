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
from internlm_offload.family import check_run
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
# model.type, the causal LM, its config (Qwen3-Next's block 1 dense: no router logits of it in the loss), attention
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


@pytest.mark.parametrize("kind", ["qwen3_5_moe_text", "gpt_oss"])
def test_the_config_files_balancing_loss_is_transformers_for_a_folder_without_it(tmp_path, kind):
    """A folder as released (output_router_logits=False): no loss unless the run's config names one;
    model.balancing_loss='transformers' with loss.moe_loss_coeff=0.1 is transformers' loss with router logits asked
    for at the call."""
    reference = transformers_folder(tmp_path / "hf", kind, output_router_logits=False)
    model_section = {"type": KINDS[kind][0], "hf_path": str(tmp_path / "hf")}
    plain = load({"model": model_section}, tmp_path)
    assert aux_loss_coefficients(plain, build_model(plain.model, torch.device("cpu"))) == {}
    cfg = load(
        {"model": {**model_section, "balancing_loss": "transformers"}, "loss": {"moe_loss_coeff": COEF}}, tmp_path
    )
    assert_transformers_step_1(cfg, reference, step_1_ids(VOCAB, 24))


@pytest.mark.parametrize("kind", ["qwen3_next", "gpt_oss"])
def test_xtuners_loss_of_the_families_routers_by_hand(tmp_path, kind):
    """model.balancing_loss='micro_batch': per sparse block E / (T k) * sum_e (top-k choices of e) * (mean over the
    tokens of the softmax over all experts, GPT-OSS's router bias included: XTuner's GreedyRouter's weights), summed
    over the blocks; 'global_batch' on one process is the same number; both only in training."""
    transformers_folder(tmp_path / "hf", kind, output_router_logits=True)  # XTuner's names the loss, not the folder
    section = {"type": KINDS[kind][0], "hf_path": str(tmp_path / "hf"), "balancing_loss": "micro_batch"}
    cfg = load({"model": section, "loss": {"moe_loss_coeff": 0.001}}, tmp_path)
    model = build_model(cfg.model, torch.device("cpu"))
    assert aux_loss_coefficients(cfg, model) == {MOE_AUX: 0.001} and isinstance(model, PoolsRouterStats)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    inputs = []
    for router in routers:
        router.register_forward_hook(lambda mod, args, out: inputs.append(args[0].detach()))
    ids = step_1_ids(VOCAB, 16)
    got = model(ids).aux_losses[MOE_AUX]
    E, k, T = routers[0].num_experts, routers[0].top_k, ids.numel()
    want = 0.0
    for router, x in zip(routers, inputs, strict=True):
        bias = 0.0 if router.bias is None else router.bias.detach().double()
        probs = (x.double() @ router.weight.detach().double().T + bias).softmax(-1)  # (T, E)
        counts = torch.zeros(E, dtype=torch.float64)
        for e in probs.topk(k, dim=-1).indices.flatten().tolist():
            counts[e] += 1
        want += E / (T * k) * float((counts * probs.mean(0)).sum())
    assert len(routers) == 3 and got.item() == pytest.approx(want, rel=1e-5)
    model.balancing_loss = "global_batch"
    assert model(ids).aux_losses[MOE_AUX].item() == pytest.approx(got.item(), rel=1e-6)
    model.eval()
    assert model(ids).aux_losses == {}


def test_a_softmax_routers_global_batch_pools_counts_and_softmax_sums():
    """Two ranks of ten tokens each, the second rank's statistics handed in by a pool: the loss is the one of the 20
    tokens, as one process computes it; its gradient flows through the softmax mass alone."""
    gen = torch.Generator().manual_seed(3)
    router = Router(6, 4, 2, bias=True, softmax_over_topk=True)
    with torch.no_grad():
        router.weight.copy_(torch.randn(4, 6, generator=gen))
        router.bias.copy_(torch.randn(4, generator=gen))
    whole = torch.randn(20, 6, generator=gen)
    want = balancing_loss("global_batch", [router.stats(router(whole))], 4, 2)
    other = router.stats(router(whole[10:]))

    def pool(counts, sums):
        return counts + other.topk_counts[None], sums + other.prob_sum[None]

    got = balancing_loss("global_batch", [router.stats(router(whole[:10]))], 4, 2, pool)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert abs(balancing_loss("micro_batch", [router.stats(router(whole[:10]))], 4, 2).item() - want.item()) > 1e-4
    # the gradient reaches the router through the softmax mass (the counts are constants), as XTuner's does
    probs = (whole @ router.weight.T + router.bias).softmax(-1)
    counts = torch.zeros(4).index_add_(0, probs.topk(2, dim=-1).indices.flatten(), torch.ones(40))
    hand = 4 / (20 * 2) * (counts * probs.mean(0)).sum()
    (want_grad,) = torch.autograd.grad(hand, router.weight)
    (got_grad,) = torch.autograd.grad(balancing_loss("micro_batch", [router.stats(router(whole))], 4, 2), router.weight)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("qwen3_next", {"model.balancing_loss": "sequence", "loss.moe_loss_coeff": 1e-4},
         "model.balancing_loss='sequence': model.type='qwen3_next' computes 'transformers' / 'global_batch'"),
        ("gpt_oss", {"model.balancing_loss": "transformers"}, "loss.moe_loss_coeff, which is not set"),
        ("gpt_oss", {"parallel.pipeline.size": 2, "data.micro_num": 2},
         "parallel.pipeline.size=2 with config.json's output_router_logits=True \\(router_aux_loss_coef=0.1\\)"),
        ("qwen3_next", {"parallel.pipeline.size": 2, "data.micro_num": 2, "model.balancing_loss": "micro_batch",
                        "loss.moe_loss_coeff": 1.0},
         "model.balancing_loss.*not split over stages"),
    ],
    ids=["sequence", "coefficient unset", "folder's loss under a pipeline", "the key under a pipeline"],
)  # fmt: skip
def test_the_config_refuses_in_one_line(tmp_path, kind, options, message):
    transformers_folder(tmp_path / "hf", kind, output_router_logits=True)
    section = {"type": KINDS[kind][0], "hf_path": str(tmp_path / "hf")}
    world = options.get("parallel.pipeline.size", 1)
    with pytest.raises(ConfigError, match=message):  # the schema's checks, then the family's at the build
        check_run(resolve_config(load_config_file(write(tmp_path, {"model": section}), options), world))


def test_a_dense_qwen3_5_refuses_the_key(tmp_path):
    config = {k: v for k, v in _QWEN.items() if not k.startswith(("num_experts", "moe_", "shared_"))}
    hf = {"model_type": "qwen3_5_text", **config, "intermediate_size": 48}
    options = {"model.balancing_loss": "micro_batch", "loss.moe_loss_coeff": 1e-3}
    with pytest.raises(ConfigError, match="model_type='qwen3_5_text' has no experts"):
        check_run(
            resolve_config(
                load_config_file(write(tmp_path, {"model": {"type": "qwen3_next", "hf_config": hf}}), options)
            )
        )


def write(tmp_path: Path, options: dict) -> Path:
    path = tmp_path / "base.py"
    path.write_text("\n".join(f"{key} = {value!r}" for key, value in options.items()) + "\n")
    return path

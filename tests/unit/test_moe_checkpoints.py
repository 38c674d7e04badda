"""Mixture-of-experts checkpoints in and out: Hugging Face Qwen3-MoE, Qwen2-MoE and Mixtral folders written by
transformers load into the native model with transformers' logits, export back to what transformers reads, bit for
bit; a malformed folder is one line (tiny, CPU, float32)."""

import json
from itertools import product
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from internlm_offload.builder import build_model
from internlm_offload.config import resolve_config
from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.internlm2 import hf_config, hf_export, hf_names
from internlm_offload.weights.convert import Heads, to_format
from internlm_offload.weights.hf_folder import write_moe_folder
from internlm_offload.weights.sources import foreign_source, load_weights, read_native_weights

V, H, HEADS, KV, E, K = 97, 64, 4, 2, 4, 2
COMMON = dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, num_hidden_layers=2, vocab_size=V)
FAMILIES = {
    # head_dim apart from hidden / heads, q/k norms, block 1 dense, top-k renormalised
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(head_dim=32, mlp_only_layers=[1], norm_topk_prob=True)),
    # biases on q, k, v; a shared expert two experts wide; top-k weights as they are
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(shared_expert_intermediate_size=64, norm_topk_prob=False)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=E, intermediate_size=32)),
}


def hf_folder(folder: Path, family: str, seed: int = 0) -> torch.nn.Module:
    """A random tiny transformers model of `family` saved by its save_pretrained into `folder`."""
    config_cls, model_cls, extra = FAMILIES[family]
    if family != "mixtral":
        extra = dict(num_experts=E, moe_intermediate_size=32, intermediate_size=48, **extra)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, num_experts_per_tok=K, rms_norm_eps=1e-6, **extra))
    with torch.no_grad():
        for p in model.parameters():  # transformers zero-inits biases and norms: random ones check their wiring
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return model.eval()


def native_config(folder: Path, **model):
    hf = json.loads((folder / "config.json").read_text())
    raw = {"model": {**hf_config.model_section(hf), "attn_impl": "sdpa", **model}}
    raw["ckpt"] = {"load_ckpt_info": {"path": str(folder), "ckpt_type": "hf", "content": ("model",)}}
    return resolve_config(raw)


def load_native(folder: Path, **model) -> torch.nn.Module:
    """The native model with the folder's weights, through the run's own path (`ckpt.load_ckpt_info`)."""
    cfg = native_config(folder, **model)
    source = foreign_source(cfg.ckpt.load_ckpt_info, cfg.model)
    native = build_model(cfg.model, torch.device("cpu"))
    load_weights(native, source, cfg.model)
    return native


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_folders_load_with_its_logits_and_export_back_bitwise(tmp_path: Path, family: str) -> None:
    """save_pretrained's folder (one tensor per expert) -> native: logits within 1e-5 of transformers'; native ->
    exported folder: transformers reads every tensor back bit for bit, and so does the native load (round trip)."""
    hf = hf_folder(tmp_path / "hf", family)
    native = load_native(tmp_path / "hf")
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(native(ids).logits, hf(ids).logits) < 1e-5

    cfg = native_config(tmp_path / "hf")
    assert hf_export.family_of(cfg.model) == family
    weights = {name: t.detach() for name, t in native.state_dict().items()}
    tensors = to_format(weights, hf_names.MOE_TABLES[family], Heads(HEADS, KV))
    write_moe_folder(tensors, cfg.model, family, tmp_path / "out", torch.float32, max_positions=64)
    assert (
        load_file(tmp_path / "out" / "model.safetensors").keys()
        == load_file(tmp_path / "hf" / "model.safetensors").keys()
    )
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, output_loading_info=True)
    assert type(back) is type(hf) and not any(info.values()), info
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    again = load_native(tmp_path / "out").state_dict()
    assert all(torch.equal(again[name], tensor) for name, tensor in weights.items())


def write_without(folder: Path, drop: str | None = None, add: dict[str, torch.Tensor] | None = None) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors = {name: t for name, t in tensors.items() if name != drop}
    save_file({**tensors, **(add or {})}, str(path))


@pytest.mark.parametrize("case", ["missing expert", "extra expert", "expert count", "routing", "fused"])
def test_a_malformed_moe_folder_is_one_line(tmp_path: Path, case: str) -> None:
    folder = tmp_path / "hf"
    hf = hf_folder(folder, "qwen3_moe")
    model = {}
    if case == "fused":  # transformers' in-memory names, kept on disk by save_original_format=False
        (folder / "model.safetensors").unlink()
        hf.save_pretrained(folder, save_original_format=False)
        expected = "'model.layers.0.mlp.experts.down_proj' is not a hf (qwen3_moe) weight of this model; transformers'"
    elif case == "missing expert":
        write_without(folder, drop="model.layers.0.mlp.experts.3.up_proj.weight")
        expected = "no 'model.layers.0.mlp.experts.3.up_proj.weight' (1 of the model's weights missing)"
    elif case == "extra expert":
        write_without(folder, add={"model.layers.0.mlp.experts.4.up_proj.weight": torch.zeros(32, H)})
        expected = "'model.layers.0.mlp.experts.4.up_proj.weight' is not a hf (qwen3_moe) weight of this model"
    elif case == "expert count":
        model = dict(num_experts=8)
        expected = "config.json: num_experts=4 (set model.num_experts to match; it gives 8)"
    else:
        model = dict(moe_type="GShard", moe_layer_kwargs={})
        expected = "routing (every choice computed)='Dropless' (set model.moe_type to match; it gives 'GShard')"
    with pytest.raises(CheckpointError) as err:
        load_native(folder, **model)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_dense_folder_for_a_model_with_experts_says_so(tmp_path: Path) -> None:
    from internlm_offload.model.families.internlm2.hf_export import llama_values

    cfg = resolve_config({"model": dict(num_experts=E, top_k=K)})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **llama_values(cfg.model)}))
    cfg = resolve_config(
        {
            "model": dict(num_experts=E, top_k=K),
            "ckpt": {"load_ckpt_info": {"path": str(tmp_path), "ckpt_type": "hf", "content": ("model",)}},
        }
    )
    with pytest.raises(
        CheckpointError, match="config.json: model.num_experts=4 \\(the folder's model is dense: set 0\\)$"
    ):
        foreign_source(cfg.ckpt.load_ckpt_info, cfg.model)


def test_an_architecture_no_transformers_family_holds_is_refused_on_export() -> None:
    """InternEvo's softmax-mixed shared expert has no transformers counterpart: one line, no folder."""
    cfg = resolve_config({"model": dict(num_experts=E, top_k=K, num_shared_experts=1, shared_expert_gate="softmax")})
    with pytest.raises(CheckpointError, match="model.shared_expert_gate='softmax' \\(Qwen2-MoE's gate is a sigmoid\\)"):
        hf_export.family_of(cfg.model)
    cfg = resolve_config({"model": dict(num_layers=4, num_experts=E, top_k=K, decoder_sparse_step=2)})
    with pytest.raises(CheckpointError, match="holds dense blocks \\[0, 2\\] \\(Mixtral's are all sparse\\)"):
        hf_export.family_of(cfg.model)


# ----------------------------------------------------------------------------- InternEvo's MoE files

INTERNEVO_MOE = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, num_kv_attention_heads=KV, vocab_size=V,
                     attn_impl="sdpa", num_experts=E, top_k=K, moe_type="Dropless", mlp_ratio=0.5, multiple_of=32,
                     qkv_bias=True, o_bias=False, num_shared_experts=1, shared_expert_gate="sigmoid")  # fmt: skip


@pytest.fixture(scope="module")
def moe_reference() -> dict[str, torch.Tensor]:
    """A native Qwen2-MoE-shaped model's weights (experts (E, out, in)), random."""
    torch.manual_seed(4)
    model = build_model(resolve_config({"model": INTERNEVO_MOE}).model, torch.device("cpu"))
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def internevo_dense(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """InternEvo's QWEN2MOE dense file by hand: the gate under moe_layer, the shared expert as residual_mlp."""
    out = {}
    for name, tensor in reference.items():
        if ".feed_forward.experts." in name:
            continue
        name = name.replace(".feed_forward.router.weight", ".feed_forward.moe_layer.gate.wg.weight")
        out[name.replace(".feed_forward.shared_experts.", ".feed_forward.residual_mlp.")] = tensor
    return out


MIXTRAL_NAMES = ((".attention.", ".mixer."), (".attention_norm.", ".norm1."), (".ffn_norm.", ".norm2."),
                 (".feed_forward.", ".mlp."), ("tok_embeddings.", "embedding."), ("output.", "head."))  # fmt: skip


def mixtral_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """InternEvo's MIXTRALMOE names for its QWEN2MOE ones: InternLM v1's blocks (`blocks.{i}.mixer`, norm1, ...)."""
    out = {}
    for name, tensor in state.items():
        name = name.replace("layers.", "blocks.", 1) if name.startswith("layers.") else name
        for old, new in MIXTRAL_NAMES:
            name = (
                name.replace(old, new)
                if old.startswith(".")
                else (new + name[len(old) :] if name.startswith(old) else name)
            )
        out[name] = tensor
    return out


def write_internevo_moe(
    folder: Path, reference: dict[str, torch.Tensor], grouped: bool, ep: int, tp: int, mixtral: bool = False
) -> None:
    """InternEvo's files by hand: the dense file, and per block and expert(-parallel rank) and expert tensor rank
    one file; grouped: (E / ep, in, out) per rank, column-parallel w1/w3 split along out, row-parallel w2 along in."""
    folder.mkdir()
    rename = mixtral_names if mixtral else dict
    torch.save(rename(internevo_dense(reference)), folder / "model_tp0_pp0.pt")
    for layer in range(2):
        stacked = {w: reference[f"layers.{layer}.feed_forward.experts.{w}"] for w in ("w1", "w2", "w3")}
        files = range(ep) if grouped else range(E)
        for index, rank in product(files, range(tp)):
            state = {}
            for w, full in stacked.items():
                if grouped:
                    local = E // ep
                    piece = full[index * local : (index + 1) * local].transpose(1, 2)  # (local, in, out)
                    piece = piece.chunk(tp, dim=1 if w == "w2" else 2)[rank]
                else:
                    piece = full[index].chunk(tp, dim=1 if w == "w2" else 0)[rank]  # (out, in)
                state[f"layers.{layer}.feed_forward.moe_layer.experts.wrapped_experts.{index}.{w}.weight"] = (
                    piece.contiguous()
                )
            torch.save(rename(state), folder / f"model_moe_layer{layer}_expert{index}_tp{rank}.pt")


def load_internevo(folder: Path, **model) -> dict[str, torch.Tensor]:
    cfg = resolve_config(
        {"model": {**INTERNEVO_MOE, **model}, "ckpt": {"load_ckpt_info": {"path": str(folder), "content": ("model",)}}}
    )
    source = foreign_source(cfg.ckpt.load_ckpt_info, cfg.model)
    shapes = {name: t.shape for name, t in build_model(cfg.model, torch.device("meta")).state_dict().items()}
    return read_native_weights(source, cfg.model, shapes)


@pytest.mark.parametrize(("grouped", "ep", "tp", "mixtral"), [(True, 2, 2, False), (True, 1, 1, False),
                                                             (False, 1, 2, False), (True, 2, 1, True)])  # fmt: skip
def test_internevo_moe_files_load_bitwise(tmp_path: Path, moe_reference, grouped, ep, tp, mixtral) -> None:
    """InternEvo's grouped experts (its default; over 2 expert-parallel and 2 expert tensor ranks) and its list form
    load into the stacked native experts bitwise, under QWEN2MOE's names and MIXTRALMOE's (`blocks.{i}.mlp`)."""
    write_internevo_moe(tmp_path / "ie", moe_reference, grouped, ep, tp, mixtral)
    loaded = load_internevo(tmp_path / "ie")
    assert loaded.keys() == moe_reference.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in moe_reference.items())


def test_internevo_moe_export_is_internevos_layout_and_round_trips(tmp_path: Path, moe_reference) -> None:
    """`--internevo` of a run with experts writes what InternEvo writes at one rank, file for file and key for key,
    and it loads back bitwise."""
    from internlm_offload.tools.export import export_internevo

    run = {"model": resolve_config({"model": INTERNEVO_MOE}).model.model_dump()}
    export_internevo(moe_reference, tmp_path / "out", torch.float32, run, tp=1, wp=0)
    write_internevo_moe(tmp_path / "by_hand", moe_reference, grouped=True, ep=1, tp=1)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "by_hand").iterdir())
    for name in names:
        ours, theirs = (torch.load(tmp_path / d / name, weights_only=True) for d in ("out", "by_hand"))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs), name
    loaded = load_internevo(tmp_path / "out")
    assert all(torch.equal(loaded[name], tensor) for name, tensor in moe_reference.items())


@pytest.mark.parametrize("case", ["missing file", "no expert files", "dense model"])
def test_a_malformed_internevo_moe_folder_is_one_line(tmp_path: Path, moe_reference, case: str) -> None:
    folder = tmp_path / "ie"
    write_internevo_moe(folder, moe_reference, grouped=True, ep=2, tp=2)
    if case == "missing file":
        (folder / "model_moe_layer1_expert1_tp0.pt").unlink()
        expected = "model_moe_layer1_expert1_tp0.pt is missing"
    elif case == "no expert files":
        for path in folder.glob("model_moe_*"):
            path.unlink()
        expected = "no model_moe_layer*_expert*_tp*.pt files; model.num_experts=4 needs them"
    model = {}
    if case == "dense model":
        model = dict(num_experts=0, num_shared_experts=0)
        expected = (
            "model_moe_layer0_expert0_tp0.pt: MoE expert files; the configured model has none (model.num_experts=0)"
        )
    with pytest.raises(CheckpointError) as err:
        load_internevo(folder, **model)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_router_bias_family_has_no_native_model_section(family: str) -> None:
    """DeepSeek-V3 and GLM-4-MoE name their experts `n_routed_experts` and correct their router with a bias: their
    config.json is refused in one line naming its model_type, not read as a section with num_experts=None."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model(family).to_dict()  # transformers' defaults: DeepSeek-V3 is the 671B shape
    with pytest.raises(CheckpointError) as err:
        hf_config.model_section(hf, "/models/x/config.json")
    message = str(err.value)
    assert message.startswith(f"/models/x/config.json: model_type={family!r}; the native mixture of experts")
    assert "qwen3_moe, qwen2_moe, mixtral" in message and "\n" not in message

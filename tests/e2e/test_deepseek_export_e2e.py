"""`tools.export --hf` of the DeepSeek-V3 lineage (model.type='deepseek_v3'): tiny random transformers folders of
DeepSeek-V3, GLM-4.5, GLM-4.7-Flash and Kimi-K2 (DeepSeek-V3's, config.json's model_type edited to `kimi_k2`, which
transformers does not register) load, train from a config file and export to a folder transformers loads with no
remote code, giving the native model's logits; loaded and exported with no step trained, the folder's own tensors
come back bit for bit, its multi-token-prediction block (at block L, with the copies of the embedding and head
DeepSeek-V3's files carry) included; where a folder transformers saved has none and its config asks for one (1, its
default, except GLM-4.7-Flash's class), the run trains the seed's and the export adds it at block L."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner import TINY, run_python, train
from test_deepseek_family_e2e import FAMILIES, VOCAB, transformers_folder

from internlm_offload.builder.model import build_model
from internlm_offload.config import ModelConfig, RunConfig
from internlm_offload.device import Accelerator
from internlm_offload.engine.checkpoint import CheckpointManager, latest_checkpoint
from internlm_offload.engine.runtime import RunContext
from internlm_offload.tools.export import load_weights

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

# case -> (the transformers family its folder is made by, the class an export loads as)
CASES = {
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteForCausalLM"),
    "kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
}
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"  # a sparse block's router bias (block 0 is dense)
# transformers' config classes default num_nextn_predict_layers to 1, except GLM-4.7-Flash's, which has no such key
MTP_BY_DEFAULT = ("deepseek_v3", "glm4_moe", "kimi_k2")


def mtp_names(case: str, names) -> set[str]:
    """The names of block L's tensors: the multi-token-prediction block."""
    layers = FAMILIES[CASES[case][0]][1]["num_hidden_layers"]
    return {name for name in names if name.startswith(f"model.layers.{layers}.")}


def make_folder(case: str, folder: Path, *, mtp: bool = False) -> Path:
    """The case's tiny random folder; Kimi-K2's as Moonshot ships it (model_type `kimi_k2`, an `auto_map` naming
    remote code); with `mtp`, a multi-token-prediction block at block L, as DeepSeek-V3's files hold one: its own
    norms and projection, a sparse block's tensors (block L - 1's, copied), the copies of the embedding and head."""
    transformers_folder(CASES[case][0], folder)
    if case == "kimi_k2":
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    if mtp:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        hidden = FAMILIES[CASES[case][0]][1]["hidden_size"]
        layer = FAMILIES[CASES[case][0]][1]["num_hidden_layers"]
        sparse = f"model.layers.{layer - 1}."
        block = {name.replace(sparse, f"model.layers.{layer}.", 1): t.clone() for name, t in tensors.items() if name.startswith(sparse)}  # fmt: skip
        tensors.update(block)
        generator = torch.Generator().manual_seed(5)
        own = {f"{n}.weight": torch.rand(hidden, generator=generator) + 0.5 for n in ("enorm", "hnorm", "shared_head.norm")}  # fmt: skip
        own["eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
        own["embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        own["shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        tensors.update({f"model.layers.{layer}.{name}": t for name, t in own.items()})
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def export(*args: object) -> subprocess.CompletedProcess:
    return run_python([sys.executable, "-m", "internlm_offload.tools.export", *map(str, args)])


def native_logits(folder: Path, weights: dict[str, torch.Tensor] | None, ids: torch.Tensor) -> torch.Tensor:
    """The family's model of `folder` (with a checkpoint's `weights` over the folder's) on `ids`."""
    model = build_model(ModelConfig(type="deepseek_v3", hf_path=str(folder)), torch.device("cpu"))
    if weights is not None:
        model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(ids).logits


def transformers_logits(folder: Path, ids: torch.Tensor, expected_class: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    assert type(model).__name__ == expected_class
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", params=CASES)
def trained(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(case, its folder, a run of 2 steps from a config file naming it), trained once for the tests below."""
    case, root = request.param, tmp_path_factory.mktemp(request.param)
    folder = make_folder(case, root / "folder")
    config = root / "cfg.py"
    config.write_text(f"_base_ = [{str(TINY)!r}]\nmodel = dict(type='deepseek_v3', hf_path={str(folder)!r})\n")
    train(root / "run", "data.total_steps=2", config=config)
    return case, folder, root / "run"


def test_a_trained_run_exports_a_folder_transformers_loads_with_the_native_logits(trained, tmp_path):
    case, folder, run = trained
    out = tmp_path / "hf"
    proc = export(run / "checkpoints", out, "--hf")
    assert proc.returncode == 0, proc.stderr
    weights = load_weights(latest_checkpoint(run / "checkpoints"))
    want = native_logits(folder, weights, IDS)
    torch.testing.assert_close(transformers_logits(out, IDS, CASES[case][1]), want, rtol=0, atol=1e-5)
    from safetensors.torch import load_file

    exported, original = load_file(out / "model.safetensors"), load_file(folder / "model.safetensors")
    added = mtp_names(case, exported)  # the MTP block the run drew and trained: transformers' folder has none
    assert bool(added) == (case in MTP_BY_DEFAULT) and not added & original.keys()
    assert exported.keys() == original.keys() | added
    assert not torch.equal(exported[BIAS], original[BIAS])  # the bias the run moved, not the folder's
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("deepseek_v3" if case == "kimi_k2" else case) and "auto_map" not in config
    assert config["architectures"] == [CASES[case][1]]
    assert ("model_type 'kimi_k2' is written as 'deepseek_v3'" in proc.stderr) == (case == "kimi_k2"), proc.stderr


def test_a_bfloat16_export_keeps_the_router_in_fp32(trained, tmp_path):
    """As transformers keeps them (`_keep_in_fp32_modules_strict`): the router's weight and its bias stay fp32."""
    from safetensors.torch import load_file

    case, _, run = trained
    out = tmp_path / "hf"
    assert export(run / "checkpoints", out, "--hf", "--dtype", "bfloat16").returncode == 0
    weights = load_weights(latest_checkpoint(run / "checkpoints"))
    tensors = load_file(out / "model.safetensors")
    router = {name for name in tensors if name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))}
    assert BIAS in router and len(router) == 2 * (2 + (case in MTP_BY_DEFAULT))  # 2 sparse blocks (+ the MTP block)
    assert all(tensors[name].dtype == torch.float32 for name in router)
    assert all(t.dtype == torch.bfloat16 for name, t in tensors.items() if name not in router)
    assert torch.equal(tensors[BIAS], weights[BIAS.removeprefix("model.").replace("mlp.gate", "feed_forward.router")])
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def step_0_checkpoint(where: Path, **model_keys: object) -> tuple[Path, torch.nn.Module]:
    """A checkpoint of the model of `model_keys` (`hf_path` / `hf_config`) with no step trained, written as a run
    writes one, and the model."""
    run = RunConfig.model_validate({"model": {"type": "deepseek_v3", **model_keys}})
    model = build_model(run.model, torch.device("cpu"))
    ctx = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
    optimizer = torch.optim.AdamW(model.parameters())
    state = {"step": 0, "config": run.model_dump()}
    return CheckpointManager(where, ctx).save(0, model=model, optimizer=optimizer, train_state=state), model


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("case", CASES)
def test_loaded_and_exported_with_no_step_the_folders_tensors_come_back_bit_for_bit(case, tmp_path):
    from safetensors.torch import load_file

    mtp = case in ("deepseek_v3", "kimi_k2")
    folder = make_folder(case, tmp_path / "folder", mtp=mtp)
    out = tmp_path / "hf"
    proc = export(step_0_checkpoint(tmp_path / "ckpt", hf_path=str(folder))[0], out, "--hf")
    assert proc.returncode == 0, proc.stderr
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    block = mtp_names(case, original)
    layers = FAMILIES[CASES[case][0]][1]["num_hidden_layers"]
    sparse = {name for name in original if name.startswith(f"model.layers.{layers - 1}.")}
    assert len(block) == (len(sparse) + 6) * mtp  # a sparse block's, its 4 own, the 2 copies of the embedding and head
    added = mtp_names(case, exported) - block  # glm4_moe: its config asks for one, transformers' folder has none
    assert bool(added) == (case == "glm4_moe")
    assert exported.keys() == original.keys() | added and BIAS in exported
    assert all(bits(exported[name]) == bits(original[name]) for name in original)
    assert all(exported[name].dtype == original[name].dtype for name in original)
    assert not [line for line in proc.stderr.splitlines() if "left out" in line or "not in it" in line], proc.stderr
    want = native_logits(folder, None, IDS)
    torch.testing.assert_close(transformers_logits(out, IDS, CASES[case][1]), want, rtol=0, atol=1e-5)


def test_a_model_of_model_hf_config_exports_that_config(tmp_path):
    """No folder: config.json is `model.hf_config`'s (its dtype the export's), the weights the seeded model's."""
    folder = make_folder("glm4_moe_lite", tmp_path / "folder")
    keys = json.loads((folder / "config.json").read_text())
    checkpoint, model = step_0_checkpoint(tmp_path / "ckpt", hf_config=keys)
    out = tmp_path / "hf"
    proc = export(checkpoint, out, "--hf", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == "bfloat16" and keys["dtype"] == "float32"
    assert {k: v for k, v in written.items() if k not in ("dtype", "transformers_version")} == {
        k: v for k, v in keys.items() if k not in ("dtype", "transformers_version")
    }
    from safetensors.torch import load_file

    exported = load_file(out / "model.safetensors")
    weights = model.state_dict()
    assert torch.equal(exported["lm_head.weight"], weights["output.weight"].to(torch.bfloat16))
    assert torch.equal(exported[BIAS], weights[BIAS.removeprefix("model.").replace("mlp.gate", "feed_forward.router")])
    # the family reads its own export back as transformers reads it
    want = native_logits(out, None, IDS)
    torch.testing.assert_close(transformers_logits(out, IDS, CASES["glm4_moe_lite"][1]), want, rtol=0, atol=1e-5)

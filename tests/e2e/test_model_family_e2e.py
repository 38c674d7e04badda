"""A model family is one package registered once (internlm_offload/family.py): the stub sixth family of the tests
(tests/stub_family: the dense decoder renamed, built from a Hugging Face Llama folder alone) gives transformers'
step-1 loss and grad norm, trains from a config that imports it, as the native family trains the same folder, and is
refused by the features its capabilities do not name; no engine, planner or config code names any family."""

import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from runner import REPO, TINY, losses, train

from internlm_offload.builder.model import build_model
from internlm_offload.config import ModelConfig, resolve_config
from internlm_offload.family import FamilySpec, family_spec
from internlm_offload.registry import MODELS

pytest.importorskip("transformers")

pytestmark = pytest.mark.e2e

VOCAB = 259  # the byte tokenizer's
# Where train.py finds `custom_imports`' stub_family: a new process (the fork server's path is set at its start)
TESTS_PATH = {"PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}


@pytest.fixture(scope="module", autouse=True)
def stub_family() -> Iterator[FamilySpec]:
    """The stub family registered for this file's tests only (tests/ is on the path through conftest.py), as a
    config's `custom_imports` registers it; the other files' processes see the built-in families alone."""
    module = importlib.import_module("stub_family")
    yield module.FAMILY
    MODELS.module_dict.pop(module.FAMILY.name)
    for name in [name for name in sys.modules if name == "stub_family" or name.startswith("stub_family.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A tiny random transformers Llama, saved as a folder (safetensors and config.json)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # transformers initializes norms to ones; make them count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("stub") / "llama"
    model.save_pretrained(folder)
    return model, folder


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))


def test_the_stub_family_gives_transformers_step_1_loss_and_grad_norm(stub_family, llama_folder):
    reference, folder = llama_folder
    assert family_spec("stub_llama") is stub_family
    stub = build_model(ModelConfig(type="stub_llama", hf_path=str(folder)), torch.device("cpu"))
    assert type(stub).__name__ == "StubLlama"
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    want = reference(ids, labels=ids).loss  # transformers shifts the labels itself
    logits = stub(ids).logits
    got = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad_norm(stub), grad_norm(reference), rtol=0, atol=1e-5)


def test_a_config_that_imports_the_stub_family_trains_it_as_the_native_family_trains_the_folder(llama_folder, tmp_path):
    """The same folder, the same data: the stub family from `model.hf_path`, and the native decoder given the
    folder's shape and loading it by `ckpt.load_ckpt_info`; the same model, so the same losses, bit for bit."""
    _, folder = llama_folder
    config = tmp_path / "stub.py"
    config.write_text(
        f"_base_ = [{str(TINY)!r}]\n"
        "custom_imports = dict(imports=['stub_family'])\n"
        f"model = dict(type='stub_llama', hf_path={str(folder)!r})\n"
    )  # fmt: skip
    steps = ["data.total_steps=3"]
    train(tmp_path / "stub", *steps, config=config, env=TESTS_PATH)
    shape = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
             "model.num_kv_attention_heads=2", "model.mlp_ratio=3.0", f"model.vocab_size={VOCAB}"]  # fmt: skip
    native = tmp_path / "native.py"
    native.write_text(
        f"_base_ = [{str(TINY)!r}]\n"
        f"ckpt = dict(load_ckpt_info=dict(path={str(folder)!r}, content=('model',), ckpt_type='hf_llama'))\n"
    )
    train(tmp_path / "native", *steps, *shape, config=native)
    stub_losses = losses(tmp_path / "stub")
    assert sorted(stub_losses) == [1, 2, 3] and stub_losses == losses(tmp_path / "native")


SPLITS = "splits model.type='deepseek_v3' / 'gpt_oss' / 'internlm2' / 'qwen3_next', not 'stub_llama'"  # the families with a plan


@pytest.mark.parametrize(
    "section, refusal",
    [
        ({"parallel": {"pipeline": {"size": 2}}}, SPLITS),
        ({"parallel": {"tensor": {"size": 2}}}, SPLITS),
        ({"model": {"num_experts": 4}}, "builds the experts of model.type='internlm2'; a 'stub_llama' model"),
    ],
)
def test_a_feature_the_family_does_not_offer_refuses_it_by_name(llama_folder, section, refusal):
    model = {"type": "stub_llama", "hf_path": str(llama_folder[1]), **section.pop("model", {})}
    with pytest.raises(ValueError, match=re.escape(refusal)):
        resolve_config({"model": model, **section}, world_size=2)


def test_no_code_outside_a_family_package_asks_for_a_family_by_name():
    """What a feature allows is a capability (family.Capabilities), never `model.type == "<family>"`."""
    package = REPO / "internlm_offload"
    asks = re.compile(r"""type["']?\]?\s*[!=]=\s*["'](internlm2|hf_causal_lm)["']""")
    found = [f"{path.relative_to(REPO)}:{n}" for path in package.rglob("*.py") if "families" not in path.parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if asks.search(line)]  # fmt: skip
    assert found == [], found

"""Checkpoints in and out of the native model, end to end: a run's exports (Hugging Face, InternEvo tp and
ISP files) start runs exactly as its own checkpoint does; transformers loads the HF export, and a
transformers Llama (and its InternLM2 port, fused by hand) loads here, with the same logits."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner import TINY, losses, run_python, train
from test_bad_input import assert_clean_error

from internlm_offload.builder import build_model
from internlm_offload.config import resolve_config
from internlm_offload.tools.export import load_weights
from internlm_offload.weights.sources import foreign_source
from internlm_offload.weights.sources import load_weights as load_foreign

pytestmark = pytest.mark.e2e

VOCAB = 264  # the byte tokenizer's 259, rounded up so the head splits over 2 ranks
TINY_MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=VOCAB)


def export(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "internlm_offload.tools.export", *map(str, args)]
    return run_python(cmd, timeout=300)


def finetune_config(tmp_path: Path, path: Path, ckpt_type: str) -> Path:
    config = tmp_path / f"from_{path.name}.py"
    config.write_text(
        f"_base_ = [{str(TINY)!r}]\n"
        f"ckpt = dict(load_ckpt_info=dict(path={str(path)!r}, content=('model',), ckpt_type={ckpt_type!r}))\n"
    )
    return config


def native_model(path: Path | None = None, ckpt_type: str = "internevo", **model) -> torch.nn.Module:
    """The tiny native model (sdpa, `model` settings on top), with the weights of a foreign folder when given."""
    raw = {"model": {**TINY_MODEL, "attn_impl": "sdpa", **model}}
    if path is not None:
        raw["ckpt"] = {"load_ckpt_info": {"path": str(path), "ckpt_type": ckpt_type}}
    cfg = resolve_config(raw)
    model = build_model(cfg.model, torch.device("cpu")).eval()
    if path is not None:
        load_foreign(model, foreign_source(cfg.ckpt.load_ckpt_info, cfg.model), cfg.model)
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """A native run's checkpoint and its exports: Hugging Face, InternEvo tp=2, InternEvo ISP wp=2."""
    root = tmp_path_factory.mktemp("formats")
    train(root / "run", "data.total_steps=2", f"model.vocab_size={VOCAB}")
    folders = {"dcp": root / "run" / "checkpoints"}
    for name, args in {
        "hf": ["--hf"],
        "tp2": ["--internevo", "--tp", "2"],
        "wp2": ["--internevo", "--wp", "2"],
    }.items():
        folders[name] = root / name
        proc = export(folders["dcp"], folders[name], *args)
        assert proc.returncode == 0, proc.stderr
    return folders


def test_exports_start_a_run_exactly_as_the_checkpoint_does(exported, tmp_path):
    """Weights only, from the run's DCP checkpoint, its HF folder and its InternEvo files: the same losses."""
    runs = {}
    for name, ckpt_type in (("dcp", "internevo"), ("hf", "hf_llama"), ("tp2", "internevo"), ("wp2", "internevo")):
        config = finetune_config(tmp_path, exported[name], ckpt_type)
        train(tmp_path / name, "data.total_steps=3", f"model.vocab_size={VOCAB}", config=config)
        runs[name] = losses(tmp_path / name)
    assert all(run == runs["dcp"] for run in runs.values()), runs


def test_exports_round_trip_bitwise(exported):
    weights = load_weights(sorted(exported["dcp"].glob("step_*"))[-1])
    for name, ckpt_type in (("hf", "hf"), ("tp2", "internevo"), ("wp2", "internevo")):
        loaded = native_model(exported[name], ckpt_type).state_dict()
        assert loaded.keys() == weights.keys()
        assert all(torch.equal(loaded[key], tensor) for key, tensor in weights.items()), name
    assert sorted(p.name for p in exported["wp2"].iterdir()) == ["model_wp0_pp0.pt", "model_wp1_pp0.pt"]


def test_transformers_loads_the_hf_export_with_the_native_logits(exported):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(exported["hf"], local_files_only=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    native = native_model()
    native.load_state_dict(load_weights(sorted(exported["dcp"].glob("step_*"))[-1]))
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, native(ids).logits, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def transformers_llama(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A random transformers Llama of the tiny model's shape, saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers initializes norms to ones; make them count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("llama") / "hf_llama"
    model.save_pretrained(folder)
    return model, folder


def assert_same_logits(reference: torch.nn.Module, native: torch.nn.Module) -> None:
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(native(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def test_a_transformers_llama_loads_with_its_logits_and_trains(transformers_llama, tmp_path):
    reference, folder = transformers_llama
    assert_same_logits(reference, native_model(folder, "hf_llama"))
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()  # the older .bin form (transformers 5 writes safetensors only): read as data only
    torch.save(reference.state_dict(), bin_folder / "pytorch_model.bin")
    (bin_folder / "config.json").write_bytes((folder / "config.json").read_bytes())
    assert_same_logits(reference, native_model(bin_folder, "hf_llama"))
    proc = train(tmp_path / "tuned", "data.total_steps=3", f"model.vocab_size={VOCAB}",
                 config=finetune_config(tmp_path, folder, "hf_llama"))  # fmt: skip
    assert "Loaded hf model weights from" in proc.stderr
    steps = losses(tmp_path / "tuned")
    assert sorted(steps) == [1, 2, 3] and all(0 < loss < 10 for loss in steps.values())


def test_an_hf_internlm2_folder_fused_by_hand_loads_with_the_llamas_logits(transformers_llama, tmp_path):
    """InternLM2's HF port: InternEvo's names under `model.`, wqkv fused per kv group (written out here)."""
    import json

    from safetensors.torch import save_file

    reference, llama_folder = transformers_llama
    weights, head_dim, q_per_kv = reference.state_dict(), 32, 2
    out = {"model.tok_embeddings.weight": weights["model.embed_tokens.weight"],
           "model.norm.weight": weights["model.norm.weight"], "output.weight": weights["lm_head.weight"]}  # fmt: skip
    for i in range(4):
        hf, ours = f"model.layers.{i}.", f"model.layers.{i}."
        q, k, v = (weights[f"{hf}self_attn.{p}_proj.weight"] for p in "qkv")
        rows = []
        for g in range(2):
            rows += [q[(g * q_per_kv + j) * head_dim : (g * q_per_kv + j + 1) * head_dim] for j in range(q_per_kv)]
            rows += [k[g * head_dim : (g + 1) * head_dim], v[g * head_dim : (g + 1) * head_dim]]
        out[f"{ours}attention.wqkv.weight"] = torch.cat(rows)
        out[f"{ours}attention.wo.weight"] = weights[f"{hf}self_attn.o_proj.weight"]
        out[f"{ours}attention_norm.weight"] = weights[f"{hf}input_layernorm.weight"]
        out[f"{ours}ffn_norm.weight"] = weights[f"{hf}post_attention_layernorm.weight"]
        for ours_name, hf_name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[f"{ours}feed_forward.{ours_name}.weight"] = weights[f"{hf}mlp.{hf_name}.weight"]
    folder = tmp_path / "hf_internlm2"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "model.safetensors"))
    config = json.loads((llama_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "internlm2", "bias": False}))
    assert_same_logits(reference, native_model(folder, "hf"))


def test_an_fsdp2_run_starts_from_internevo_files_as_from_its_checkpoint(exported, tmp_path):
    runs = {}
    for name in ("dcp", "tp2"):
        config = finetune_config(tmp_path, exported[name], "internevo")
        train(tmp_path / name, "data.total_steps=2", f"model.vocab_size={VOCAB}", "parallel.mode=fsdp2",
              nproc=2, config=config)  # fmt: skip
        runs[name] = losses(tmp_path / name)
    assert runs["tp2"] == runs["dcp"], runs


def test_bad_folders_and_outputs_are_one_line_exit_2(exported, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model_tp1_pp0.pt").write_bytes((exported["tp2"] / "model_tp1_pp0.pt").read_bytes())
    proc = train(tmp_path / "run", f"model.vocab_size={VOCAB}", config=finetune_config(tmp_path, broken, "internevo"),
                 check=False)  # fmt: skip
    assert_clean_error(proc, "model_tp0_pp0.pt is missing")
    assert not (tmp_path / "run" / "checkpoints").exists()
    proc = train(tmp_path / "run2", config=finetune_config(tmp_path, exported["hf"], "hf_llama"), check=False)
    assert_clean_error(proc, "config.json: vocab_size=264 (set model.vocab_size to match; it gives 259)")
    before = sorted(p.name for p in exported["tp2"].iterdir())
    assert_clean_error(export(exported["dcp"], exported["tp2"], "--hf"), "exists and is not an empty folder")
    assert sorted(p.name for p in exported["tp2"].iterdir()) == before
    assert_clean_error(
        export(exported["dcp"], tmp_path / "odd", "--internevo", "--tp", "3"), "2 kv heads do not split into 3 ranks"
    )
    assert not (tmp_path / "odd").exists() and not list(tmp_path.glob(".odd.*"))


def test_a_malformed_file_found_by_rank_0_stops_both_ranks_with_its_line(exported, tmp_path):
    """Rank 0 alone reads the files: a plain-text model file ends both workers with exit 2 and rank 0's line."""
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "model_tp0_pp0.pt").write_bytes((exported["tp2"] / "model_tp0_pp0.pt").read_bytes())
    (folder / "model_tp1_pp0.pt").write_text("not a torch file\n")
    config = finetune_config(tmp_path, folder, "internevo")
    proc = train(tmp_path / "run", f"model.vocab_size={VOCAB}", "parallel.mode=fsdp2", nproc=2, config=config,
                 check=False)  # fmt: skip
    assert "(exitcode: 2)" in proc.stderr, proc.stderr[-3000:]  # torchrun itself exits 1 for a failed worker
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert errors and all("model_tp1_pp0.pt: not a torch file" in line for line in errors), errors
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_internlm_v1_is_a_llama_with_attention_biases_and_loads_with_its_logits(tmp_path):
    """A transformers Llama with `attention_bias=True` is InternLM v1's architecture: its HF folder, and InternEvo
    v1 files written from it by hand (tp=2: each rank's Wqkv its own q, k, v rows), load with its logits and train."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=True,
    )  # fmt: skip
    reference = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)  # transformers zeroes them: make them count
    reference.save_pretrained(tmp_path / "hf")
    bias = {"attention_bias": True, "num_kv_attention_heads": 4}
    assert_same_logits(reference, native_model(tmp_path / "hf", "hf_llama", **bias))
    weights, v1 = reference.state_dict(), tmp_path / "internlm_v1"
    v1.mkdir()
    ranks: list[dict[str, torch.Tensor]] = [{}, {}]
    whole = {"embedding.weight": ("model.embed_tokens.weight", 1), "head.weight": ("lm_head.weight", 0),
             "norm.weight": ("model.norm.weight", None)}  # fmt: skip
    for i in range(4):
        hf = f"model.layers.{i}."
        whole |= {
            f"blocks.{i}.mixer.out_proj.weight": (f"{hf}self_attn.o_proj.weight", 1),
            f"blocks.{i}.mixer.out_proj.bias": (f"{hf}self_attn.o_proj.bias", None),
            f"blocks.{i}.norm1.weight": (f"{hf}input_layernorm.weight", None),
            f"blocks.{i}.norm2.weight": (f"{hf}post_attention_layernorm.weight", None),
            f"blocks.{i}.mlp.w1.weight": (f"{hf}mlp.gate_proj.weight", 0),
            f"blocks.{i}.mlp.w3.weight": (f"{hf}mlp.up_proj.weight", 0),
            f"blocks.{i}.mlp.w2.weight": (f"{hf}mlp.down_proj.weight", 1),
        }
        for kind in ("weight", "bias"):
            q, k, v = (torch.chunk(weights[f"{hf}self_attn.{p}_proj.{kind}"], 2) for p in "qkv")
            for rank in range(2):
                ranks[rank][f"blocks.{i}.mixer.Wqkv.{kind}"] = torch.cat([q[rank], k[rank], v[rank]])
    for name, (hf_name, dim) in whole.items():
        tensor = weights[hf_name]
        for rank, piece in enumerate([tensor] * 2 if dim is None else torch.chunk(tensor, 2, dim)):
            ranks[rank][name] = piece.clone()
    for rank, state in enumerate(ranks):
        torch.save(state, v1 / f"model_tp{rank}_pp0.pt")
    assert_same_logits(reference, native_model(v1, "internevo", **bias))
    config_file = finetune_config(tmp_path, v1, "internevo")
    config_file.write_text(config_file.read_text() + "model = dict(attention_bias=True, num_kv_attention_heads=4)\n")
    train(tmp_path / "tuned", "data.total_steps=2", f"model.vocab_size={VOCAB}", config=config_file)
    assert sorted(losses(tmp_path / "tuned")) == [1, 2]

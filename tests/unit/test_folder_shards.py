"""`model.hf_path` under FSDP2 with the meta build: the model is built on meta, sharded, and the folder read a tensor
at a time into each rank's shards (`load_folder_shards`); every shard equals the whole build's (built, read, then
sharded) bit for bit, parameters and the routers' fp32 bias buffers, for a DeepSeek-V3 folder with multi-token
prediction's layers (bf16 files, the biases fp32; vocab and widths uneven over 2 ranks), the same over FSDP2's CPU
offload policy, expert parallel and msp's tensor parallel, and a folder transformers saved (no MTP layers: the seed's
draw, as the whole build draws it). The meta run never builds the model whole nor reads the folder whole. Two gloo
processes, one launch."""

import os
import sys
from pathlib import Path

import pytest
import torch
from runner import run_python

from internlm_offload.builder.model import build_model, folder_layout, load_folder, load_folder_shards
from internlm_offload.config import ModelConfig
from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.deepseek_v3.build import folder_config
from internlm_offload.weights.hf_folder import write_family_folder

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]

TINY = {"model_type": "deepseek_v3", "vocab_size": 67, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
        "v_head_dim": 8, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
        "topk_group": 1}  # fmt: skip
MTP = {"num_layers": 2, "share_weights": False}

SCRIPT = r"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import internlm_offload.builder.model as builder_model
import internlm_offload.weights.hf_folder as hf_folder
from internlm_offload.builder import build_components
from internlm_offload.config import resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.runtime import RunContext, expert_mesh, shutdown_runtime, tensor_parallel_mesh

MTP = dict(num_layers=2, share_weights=False)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
acc = Accelerator("cpu")

built_on, whole_reads, pieces = [], [], []
build_model, read_folder, folder_pieces = builder_model.build_model, builder_model.read_folder, hf_folder.folder_pieces
builder_model.build_model = lambda cfg, device: built_on.append(device.type) or build_model(cfg, device)
builder_model.read_folder = lambda *a: whole_reads.append(a) or read_folder(*a)


def piecewise(*a):
    for piece in folder_pieces(*a):
        pieces.append(sum(t.numel() * t.element_size() for t in piece.values()))
        yield piece


builder_model.folder_pieces = piecewise


def state(model):
    # every parameter and persistent buffer whole (a DTensor gathered)
    own = builder_model.state_tensors(model)
    return {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for k, t in own.items()}


def build(folder, meta, **parallel):
    built_on.clear(), whole_reads.clear(), pieces.clear()
    raw = dict(
        model=dict(type="deepseek_v3", hf_path=folder, mtp_config=MTP, dtype="torch.bfloat16"),
        data=dict(seq_len=16),
        parallel=dict(mode="fsdp2", meta_init=meta, **parallel),
    )
    cfg = resolve_config(raw, world_size=world)
    experts, tensor = cfg.parallel.expert.size, cfg.parallel.tensor.size
    ctx = RunContext(
        rank,
        rank,
        world,
        acc,
        tensor_size=tensor,
        mesh=tensor_parallel_mesh("cpu", world, tensor),
        expert_mesh=expert_mesh("cpu", world, experts) if experts > 1 else None,
    )
    torch.manual_seed(5)
    model = build_components(cfg, ctx).model
    return model, torch.get_rng_state()


for label, folder in (("mtp folder", sys.argv[1]), ("transformers folder", sys.argv[2])):
    for name, parallel in (("fsdp2", {}), ("cpu offload", dict(fsdp_cpu_offload=True)), ("ep 2", dict(expert=dict(size=2))),
                           ("msp 2", dict(tensor=dict(size=2, mode="msp"), expert=dict(no_tp=True)))):
        if label == "transformers folder" and name != "fsdp2":
            continue
        whole, whole_rng = build(folder, meta=False, **parallel)
        assert set(built_on) == {"cpu"} and len(whole_reads) == 1 and not pieces, (label, name, built_on)
        want = state(whole)
        model, rng = build(folder, meta=True, **parallel)
        # the meta run: built on meta alone, the folder never read whole, a piece at a time below the model's size
        assert set(built_on) == {"meta"} and not whole_reads, (label, name, built_on, len(whole_reads))
        total = sum(t.numel() * 4 for t in want.values())
        assert pieces and max(pieces) < total / 4, (max(pieces), total)
        own = builder_model.state_tensors(model)
        sharded = [k for k, t in own.items() if isinstance(t, DTensor) and t.to_local().numel() < t.numel()]
        # msp splits the attention alone (its sparse blocks stay whole) and FSDP2 has one data-parallel rank
        assert len(sharded) > (0 if name == "msp 2" else len(own) / 2), (label, name, len(sharded), len(own))
        got = state(model)
        assert got.keys() == want.keys(), got.keys() ^ want.keys()
        for key, tensor in want.items():
            assert got[key].dtype == tensor.dtype, (label, name, key)
            assert torch.equal(got[key], tensor), f"{label} {name}: {key} differs on rank {rank}"
        assert any(k.endswith("e_score_correction_bias") and k.startswith("mtp.") for k in got)
        assert torch.equal(rng, whole_rng), (label, name)
        print(f"FOLDER-OK {label} {name} rank={rank} pieces={len(pieces)} max={max(pieces)}B of {total}B", flush=True)
shutdown_runtime()
"""


def write_mtp_folder(folder: Path) -> None:
    """A seeded model with two MTP layers written as DeepSeek-V3 ships one: bf16, the routers' biases (made to count)
    in fp32, the MTP blocks at L + k with their copies of the shared embedding and head."""
    cfg = ModelConfig(type="deepseek_v3", hf_config=TINY, mtp_config=MTP)
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.3, 0.3)
    layout = folder_layout(cfg)
    write_family_folder(model.state_dict(), layout, folder_config(cfg), folder, torch.bfloat16, mtp_copies=True)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_folder_read_into_the_shards_equals_the_whole_build(tmp_path: Path) -> None:
    write_mtp_folder(tmp_path / "mtp")
    torch.manual_seed(1)
    config = {key: value for key, value in TINY.items() if key != "model_type"}
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).save_pretrained(tmp_path / "hf")
    script = tmp_path / "folder_shards.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    cmd += [str(tmp_path / "mtp"), str(tmp_path / "hf")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    proc = run_python(cmd, env=env, timeout=300, expect_success=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("FOLDER-OK") == 5 * 2, proc.stdout


def seeded(hf_config: dict | None = None) -> torch.nn.Module:
    torch.manual_seed(3)
    cfg = ModelConfig(type="deepseek_v3", hf_config=hf_config or TINY, mtp_config=MTP)
    return build_model(cfg, torch.device("cpu"))


def test_one_process_reads_the_folder_a_piece_at_a_time_as_the_whole_read(tmp_path: Path) -> None:
    """Into a plain model (no DTensor: each piece copied whole), the pieces give what `load_folder` gives."""
    write_mtp_folder(tmp_path)
    layout = folder_layout(ModelConfig(type="deepseek_v3", hf_config=TINY, mtp_config=MTP))
    whole, pieces = seeded(), seeded()
    load_folder(tmp_path, layout, whole)
    load_folder_shards(tmp_path, layout, pieces)
    want = whole.state_dict()
    assert all(torch.equal(t, want[name]) for name, t in pieces.state_dict().items())


def test_a_tensor_missing_or_of_another_shape_is_refused_in_one_line(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    write_mtp_folder(tmp_path)
    layout = folder_layout(ModelConfig(type="deepseek_v3", hf_config=TINY, mtp_config=MTP))
    other = seeded(hf_config={**TINY, "vocab_size": 64})
    with pytest.raises(CheckpointError, match=r"size mismatch for output.weight: shape \[67, 32\] in the folder"):
        load_folder_shards(tmp_path, layout, other)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r'Missing key\(s\): "layers.1.feed_forward.router.e_score_correction_bias"'
    ):
        load_folder_shards(tmp_path, layout, seeded())

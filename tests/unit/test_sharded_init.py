"""Meta build + per-shard init (`materialize_shards`): every rank's shards are the slices of the one-process
build's weights under the same seed, whatever the layout: FSDP2 over all ranks (uneven shards), with its CPU
offload policy, HSDP (isp's weight parallel), and FSDP2 over tensor parallel's DTensors (mtp, msp, fsp, and kv
heads replicated where the tensor size exceeds them). Four gloo processes, one launch."""

import os
import sys
from pathlib import Path

import pytest
import torch
from runner import run_python

from internlm_offload.engine.parallel import init_from_whole

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from internlm_offload.device import Accelerator
from internlm_offload.engine.parallel import apply_fsdp2, materialize_shards
from internlm_offload.engine.runtime import RunContext, shutdown_runtime
from internlm_offload.engine.tensor_parallel import apply_tensor_parallel
from internlm_offload.model import InternLM2
from internlm_offload.optim.dtensor import is_dtensor

# vocab 97 and intermediate 192 leave uneven shards over 4 ranks
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=97)
SEED = 11

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
acc = Accelerator("cpu")
tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def whole(**overrides):
    torch.manual_seed(SEED)
    model = InternLM2(**{**TINY, **overrides})
    return model, torch.get_rng_state()


def sharded(tensor_mode=None, fsdp_mesh=None, on_host=False, **overrides):
    torch.manual_seed(SEED)  # the run's seeding before its build
    with torch.device("meta"):
        model = InternLM2(**{**TINY, **overrides})
    mesh = None
    if tensor_mode is not None:
        mesh = tp_mesh
        apply_tensor_parallel(model, tp_mesh["tp"], mode=tensor_mode, parallel_output=True)
        fsdp_mesh = tp_mesh["dp"]
    ctx = RunContext(rank, rank, world, acc, tensor_size=2 if mesh is not None else 1, mesh=mesh)
    apply_fsdp2(model, ctx=ctx, layers=model.layers, mesh=fsdp_mesh, cpu_offload=on_host)
    materialize_shards(model, ctx, on_host=on_host)
    return model, torch.get_rng_state()


LAYOUTS = {
    "fsdp2 over 4": dict(),
    "fsdp2 over 4, CPU offload policy": dict(on_host=True),
    "hsdp 2 x 2": dict(fsdp_mesh=hsdp_mesh),
    "mtp 2 x fsdp2 2": dict(tensor_mode="mtp"),
    "msp 2 x fsdp2 2": dict(tensor_mode="msp"),
    "fsp 2 x fsdp2 2": dict(tensor_mode="fsp"),
    "mtp 2 (kv heads replicated) x fsdp2 2": dict(tensor_mode="mtp", num_kv_attention_heads=1),
    "msp 2 x fsdp2 2, CPU offload policy": dict(tensor_mode="msp", on_host=True),
}
for name, layout in LAYOUTS.items():
    kv = {k: v for k, v in layout.items() if k == "num_kv_attention_heads"}
    reference, reference_rng = whole(**kv)
    model, rng = sharded(**layout)
    expected = dict(reference.named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == expected.keys(), (name, got.keys() ^ expected.keys())
    assert any(is_dtensor(p) and p.to_local().numel() < p.numel() for p in got.values()), name
    for key, param in got.items():
        full = param.full_tensor() if is_dtensor(param) else param
        assert full.device.type == "cpu" and param.dtype == torch.float32
        assert torch.equal(full, expected[key].detach()), f"{name}: {key} differs on rank {rank}"
    assert torch.equal(model.inv_freq, reference.inv_freq), name
    # the generator stands where the whole build leaves it: the rest of the run draws the same
    assert torch.equal(rng, reference_rng), name
    print(f"INIT-OK {name} rank={rank}", flush=True)

# LoRA through the builder: the meta build's shards (base and PEFT's adapters, uneven over 4 ranks) are the
# slices of the whole build's, and the generator stands where the whole build leaves it
from internlm_offload.builder import build_components
from internlm_offload.config import resolve_config

LORA = dict(r=6, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"])
lora_ctx = RunContext(rank, rank, world, acc)
built = {}
for meta in (True, False):
    raw = dict(
        model=dict(**TINY, dtype="torch.bfloat16", lora=LORA),
        data=dict(seq_len=16),
        parallel=dict(mode="fsdp2", meta_init=meta, fsdp_cpu_offload=meta),
    )
    torch.manual_seed(SEED)
    parts = build_components(resolve_config(raw, world_size=world), lora_ctx)
    full = {k: p.full_tensor() for k, p in parts.model.named_parameters()}
    built[meta] = (full, torch.get_rng_state())
(got, got_rng), (expected, rng) = built[True], built[False]
assert got.keys() == expected.keys() and any(".lora_A." in k for k in got)
for key, tensor in expected.items():
    assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), f"lora: {key} differs on rank {rank}"
assert torch.equal(got_rng, rng)
print(f"INIT-OK lora meta build rank={rank}", flush=True)
shutdown_runtime()
"""


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_every_layouts_shards_are_slices_of_the_one_process_build(tmp_path: Path) -> None:
    script = tmp_path / "sharded_init.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)]
    # PYTHONPATH: the script lives in tmp_path, so without it the package would come from the installed checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    proc = run_python(cmd, env=env, timeout=300, expect_success=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("INIT-OK") == (8 + 1) * 4, proc.stdout


def test_init_from_whole_fills_a_plain_tensor_whole() -> None:
    """Without a DTensor (one rank, no mesh) the parameter gets the whole draw."""
    param = torch.empty(5, 3)
    torch.manual_seed(0)
    init_from_whole(param, torch.nn.init.normal_, device=torch.device("cpu"))
    torch.manual_seed(0)
    assert torch.equal(param, torch.randn(5, 3))

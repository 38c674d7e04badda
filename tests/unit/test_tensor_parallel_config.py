"""`parallel.tensor` / `parallel.weight`: what each tensor mode needs of the model and the world, one line each."""

from typing import Any

import pytest

from pathlib import Path

from internlm_offload.config import ConfigError, load_config_file, resolve_config

REPO = Path(__file__).resolve().parents[2]

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259)


def resolve(world_size: int, options: dict[str, Any]):
    """The small model's config with dotted `options` (`"parallel.tensor.size": 2`) set."""
    raw: dict[str, Any] = {"model": dict(MODEL), "data": dict(seq_len=64, micro_bsz=2)}
    for key, value in options.items():
        *sections, name = key.split(".")
        holder = raw
        for section in sections:
            holder = holder.setdefault(section, {})
        holder[name] = value
    return resolve_config(raw, world_size=world_size)


def tensor(size: int, mode: str = "mtp", parallel: str = "none") -> dict[str, Any]:
    return {"parallel.mode": parallel, "parallel.tensor": dict(size=size, mode=mode)}


@pytest.mark.parametrize(
    ("world_size", "options", "wrapper"),
    [
        (2, {"parallel.tensor.size": 2, "parallel.tensor.mode": "isp"}, "ddp"),
        (4, {"parallel.tensor.size": 2, "parallel.tensor.mode": "isp", "parallel.weight.size": 2}, "fsdp2"),
    ],
)
def test_isp_on_the_shipped_config_picks_its_wrapper(world_size, options, wrapper):
    """configs/internlm2_tiny.py with isp from the command line, no parallel.mode: the wrapper InternEvo's
    translation picks (DDP; FSDP2 with weight parallel), named in the start-up notes."""
    raw = load_config_file(REPO / "configs" / "internlm2_tiny.py", options)
    cfg = resolve_config(raw, world_size=world_size)
    assert cfg.parallel.mode == wrapper
    assert any(f"parallel.mode={wrapper!r}" in line for line in cfg.migration_notes()[0])


def test_isp_sections_as_internevo_writes_them():
    """isp over a tensor group takes a wrapper (DDP, or FSDP2 with weight parallel) even without data parallel."""
    section = {"parallel.zero1": dict(size=-1), "parallel.tensor": dict(size=2, mode="isp")}
    assert resolve(2, section).parallel.mode == "ddp"
    weighted = resolve(4, {**section, "parallel.weight": dict(size=2, overlap=True)})
    assert weighted.parallel.mode == "fsdp2" and weighted.parallel.weight.size == 2 and weighted.data.micro_num == 1


def test_data_parallel_size_is_the_world_over_the_tensor_groups():
    cfg = resolve(4, {**tensor(2, "msp", "fsdp2"), "data.global_bsz": 8})
    assert cfg.data.micro_num == 2  # 8 samples over 2 data-parallel ranks of 2-sample micro-batches
    assert resolve(2, tensor(2)).parallel.tensor.size == 2  # one tensor group needs no data-parallel wrapper
    assert resolve(2, {"parallel.tensor": dict(size=2)}).parallel.mode == "none"  # InternEvo's way, no mode


@pytest.mark.parametrize(
    "world_size, options, message",
    [
        (3, tensor(2), "parallel.tensor.size=2 must divide the world size 3"),
        (1, tensor(2), "parallel.tensor.size=2 must divide the world size 1"),
        (4, tensor(2), "parallel.mode='none' with 2 data-parallel ranks (world size 4, tensor size 2)"),
        (4, tensor(2, parallel="ddp"), "parallel.mode='ddp' with parallel.tensor.size=2"),
        (2, tensor(8), "must divide model.num_attention_heads=4"),
        (
            3,
            {**tensor(3, "msp"), "model.hidden_size": 96, "model.num_attention_heads": 6},
            "parallel.tensor.size=3 (mode 'msp') and model.num_kv_attention_heads=2: one must divide the other",
        ),
        (2, {**tensor(2, "msp"), "data.seq_len": 63}, "(mode 'msp') must divide data.seq_len=63"),
        (2, {**tensor(2), "model.multiple_of": 5, "model.mlp_ratio": 1.0}, "must divide the SwiGLU width"),
        (2, tensor(2, "isp"), "parallel.tensor.mode='isp' with size 2 needs parallel.mode 'ddp' or 'fsdp2'"),
        (2, {**tensor(2, "isp", "ddp"), "data.seq_len": 63}, "(mode 'isp') must divide data.seq_len=63"),
        (
            2,
            {
                **tensor(2, "isp", "ddp"),
                "model.hidden_size": 96,
                "model.num_attention_heads": 6,
                "model.num_kv_attention_heads": 3,
            },
            "parallel.tensor.size=2 (mode 'isp') and model.num_kv_attention_heads=3: one must divide the other",
        ),
        (4, {**tensor(2, "isp", "ddp"), "parallel.weight": dict(size=2)}, "shards the weights with FSDP2"),
        (4, {**tensor(2, "isp", "fsdp2"), "parallel.weight": dict(size=3)}, "parallel.weight.size=3 must divide"),
        (2, {**tensor(1), "parallel.weight": dict(size=2)}, "parallel.weight.size=2 works only with parallel.tensor"),
        (2, {**tensor(2), "model.tie_word_embeddings": True}, "model.tie_word_embeddings=True is not sharded"),
    ],
)
def test_what_a_tensor_mode_cannot_take_is_one_line(world_size, options, message):
    with pytest.raises(ConfigError) as info:
        resolve(world_size, options)
    assert message in str(info.value), str(info.value)
    assert len(str(info.value).splitlines()) <= 2


@pytest.mark.parametrize("mode", ["mtp", "msp", "fsp", "isp"])
def test_every_mode_repeats_kv_heads_where_the_tensor_size_exceeds_them(mode):
    """Each of the 2 kv heads serves 2 of 4 ranks (InternEvo's rule): isp's all-to-all repeats it, the column
    modes keep wk and wv whole (`KVHeadReplicas`); 3 ranks over 2 kv heads are refused above."""
    assert resolve(4, tensor(4, mode, "ddp" if mode == "isp" else "none")).parallel.tensor.size == 4

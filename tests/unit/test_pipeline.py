"""Pipeline parallel's pure parts: InternEvo's partition, the stage-to-rank placement, the schedule choice, the
stage modules against the whole decoder, and the config section with its one-line refusals."""

import re
from typing import Any

import pytest
import torch
from pipeline_configs import PP2, resolve
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from internlm_offload.config import ConfigError
from internlm_offload.config.pipeline import micro_batch_problem
from internlm_offload.config.pipeline_partition import local_stages, partition_uniform, stage_rank
from internlm_offload.engine.pipeline import PipelineStages, schedule_class
from internlm_offload.engine.pipeline_split import split_model
from internlm_offload.model.families.internlm2.model import InternLM2

# ----------------------------------------------------------------------------- partition and placement


@pytest.mark.parametrize(
    ("layers", "size", "chunks", "ranges"),
    [
        (4, 2, 1, [(0, 2), (2, 4)]),
        (5, 2, 1, [(0, 2), (2, 5)]),  # the remainder to the last stage
        (10, 4, 1, [(0, 2), (2, 4), (4, 7), (7, 10)]),  # to the last two
        (8, 2, 2, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (10, 2, 2, [(0, 2), (2, 5), (5, 7), (7, 10)]),  # per chunk: each chunk's last stage
        (80, 8, 1, [(10 * s, 10 * s + 10) for s in range(8)]),
    ],
)
def test_partition_is_internevos_uniform_split(layers, size, chunks, ranges):
    """InternEvo's partition_uniform: each chunk's blocks evenly over its stages, the remainder one block each to
    the chunk's last stages (the embedding and the head weigh nothing). Red with the remainder on the first stages
    (a stage boundary off by one block)."""
    assert partition_uniform(layers, size, chunks) == ranges


def test_partition_refuses_empty_stages_and_uneven_chunks():
    with pytest.raises(ValueError, match="without a block"):
        partition_uniform(3, 4, 1)
    with pytest.raises(ValueError, match="do not split into 2 chunks"):
        partition_uniform(5, 2, 2)


def test_stage_placement_loop_and_v():
    """Round robin for 1F1B, interleaved and ZBH1 (rank r holds r, r + P, ...); ZBV's V: rank r holds stages r and
    2P - 1 - r, InternEvo's second chunk assigned in reverse rank order."""
    assert [local_stages(r, 2, 2, v_shape=False) for r in range(2)] == [[0, 2], [1, 3]]
    assert [local_stages(r, 4, 2, v_shape=True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_rank(s, 3, v_shape=False) for s in range(3)] == [0, 1, 2]
    # InternEvo's ZBV parts for 10 blocks on 2 ranks: rank 0 (0, 2) and (7, 10), rank 1 (2, 5) and (5, 7)
    ranges = partition_uniform(10, 2, 2)
    assert [[ranges[s] for s in local_stages(r, 2, 2, v_shape=True)] for r in range(2)] == [
        [(0, 2), (7, 10)],
        [(2, 5), (5, 7)],
    ]


@pytest.mark.parametrize(
    ("mode", "chunks", "cls"),
    [
        ("1F1B", 1, Schedule1F1B),
        ("1F1B", 2, ScheduleInterleaved1F1B),
        ("ZBH1", 1, ScheduleInterleavedZeroBubble),
        ("ZBV", 2, ScheduleZBVZeroBubble),
    ],
)
def test_schedule_choice_is_internevos_on_torchs_classes(mode, chunks, cls):
    assert schedule_class(mode, chunks) is cls


# ----------------------------------------------------------------------------- stages against the whole model


def tiny_decoder() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=67)


@pytest.mark.parametrize(("size", "chunks", "v_shape"), [(2, 1, False), (4, 1, False), (2, 2, False), (2, 2, True)])
@pytest.mark.parametrize("packed", [False, True])
def test_stages_in_order_are_the_whole_decoder_bitwise(size, chunks, v_shape, packed):
    """Every rank's stages, run in stage order, give the whole model's logits bitwise (packed documents too: each
    stage applies RoPE and the document mask); each stage holds the partition's blocks under their global names,
    the embedding only on the first stage, norm and head only on the last."""
    model = tiny_decoder()
    stages: dict[int, Any] = {}
    for rank in range(size):
        stages.update(split_model(model, size, chunks, rank, v_shape))
    ranges = partition_uniform(4, size, chunks)
    for index, stage in stages.items():
        assert list(stage.layers) == [str(i) for i in range(*ranges[index])]
        assert (stage.tok_embeddings is not None, stage.output is not None) == (index == 0, index == len(ranges) - 1)
    ids = torch.randint(0, 67, (2, 16))
    positions = torch.tensor([list(range(10)) + list(range(6))] * 2) if packed else None
    h = ids
    for index in sorted(stages):
        h = stages[index](h, position_ids=positions)
    assert torch.equal(h, model(ids, positions).logits)


@pytest.mark.parametrize(("size", "chunks", "v_shape"), [(2, 1, False), (4, 1, False), (2, 2, False), (2, 2, True)])
def test_each_rank_holds_its_parameters_under_the_whole_models_names(size, chunks, v_shape):
    """What the optimizer steps and checkpoints hold on each rank (`PipelineStages`): its stages' parameters under
    the whole model's names, the ranks' names disjoint, and all of them together the whole model's state, tensor
    for tensor, so that a checkpoint reads at any layout."""
    model = tiny_decoder()
    whole = model.state_dict(keep_vars=True)
    seen: dict[str, torch.Tensor] = {}
    for rank in range(size):
        state = PipelineStages(split_model(model, size, chunks, rank, v_shape)).state_dict(keep_vars=True)
        assert not set(state) & set(seen)
        seen.update(state)
    assert sorted(seen) == sorted(whole)
    assert all(seen[name] is whole[name] for name in whole)


# ----------------------------------------------------------------------------- config


def test_internevo_pipeline_section_as_written():
    """`pipeline=2` means size 2, the mode is upper-cased, num_chunks and interleaved_overlap are read as written;
    pipeline stages read the same micro-batches, so the data-parallel size is the world over the pipeline."""
    cfg = resolve(2, {"parallel.pipeline": 2})
    assert (cfg.parallel.pipeline.size, cfg.parallel.pipeline.mode, cfg.parallel.mode) == (2, "1F1B", "none")
    cfg = resolve(2, {"parallel.pipeline": dict(size=2, interleaved_overlap=True, mode="zbv"), "model.num_chunks": 2})
    pipe = cfg.parallel.pipeline
    assert (pipe.mode, cfg.model.num_chunks, pipe.interleaved_overlap) == ("ZBV", 2, True)
    cfg = resolve(4, {"data.global_bsz": 16})  # 2 data-parallel ranks per stage, micro-batches of 4: 2 each
    assert (cfg.parallel.mode, cfg.data.micro_num) == ("ddp", 2)  # InternEvo's wrapper for them: DDP


@pytest.mark.parametrize(
    "options",
    [
        {"model.checkpoint": 1.0},
        {"model.checkpoint": 0.5, "selective_checkpoint": True},
        {"model.checkpoint": 1.0, "selective_checkpoint": True, "model.num_chunks": 2},
    ],
)
def test_activation_checkpointing_under_the_whole_backward_schedules(options):
    """Full and selective checkpointing pass under 1F1B and interleaved 1F1B (each rank's plan over its stages'
    blocks; tests/e2e/test_pipeline_e2e.py holds them bitwise against the pipeline without them)."""
    cfg = resolve(2, options)
    assert cfg.model.checkpoint == options["model.checkpoint"]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"model.num_chunks": 2},
        {"parallel.pipeline.mode": "ZBH1"},
        {"parallel.pipeline.mode": "ZBV"},
        {"model.checkpoint": 1.0},
        {"model.checkpoint": 1.0, "selective_checkpoint": True, "selective_checkpoint_offload": True},
    ],
)
def test_activation_offload_under_every_schedule(options):
    """`cpu_offloading` passes under each schedule (with checkpointing, and with selective checkpointing's outputs
    offloaded too, under 1F1B); tests/e2e/test_pipeline_e2e.py holds them bitwise against the pipeline without the
    offload, tests/unit/test_pipeline_offload.py the order of the reloads."""
    cfg = resolve(2, {"cpu_offloading.enable": True, "cpu_offloading.num_layers": 1, **options})
    assert cfg.cpu_offloading.num_layers == 1


@pytest.mark.parametrize(
    "count, message",
    [
        (2, "cpu_offloading.num_layers=2 must be < 2 on pipeline rank 0: under a pipeline it counts the rank's own"),
        ([1, 2], "cpu_offloading.num_layers=[1, 2] must be < 2 on pipeline rank 1: under a pipeline it counts"),
    ],
)
def test_activation_offload_counts_the_ranks_own_blocks(count, message):
    """Under a pipeline `cpu_offloading.num_layers` counts the rank's blocks (the last never offloaded), each rank's
    entry of a list its own: a rank with 2 blocks refuses 2 in one line naming the key, when the config resolves."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(2, {"cpu_offloading.enable": True, "cpu_offloading.num_layers": count})


@pytest.mark.parametrize(
    "options",
    [
        {"model.dtype": "torch.bfloat16", "swap_optimizer": True, "grad_offload": True},
        {"model.dtype": "torch.float16", "hybrid_optimizer.enable": True, "hybrid_optimizer.offload_fraction": 0.5},
        {"swap_optimizer": True, "nvme_offload.enable": True, "nvme_offload.path": "/tmp"},
    ],
)
def test_the_offload_optimizers_and_masters_pass_under_a_pipeline(options):
    """Each stage's optimizer tier over its own parameters (tests/e2e/test_pipeline_optimizers_e2e.py holds them
    bitwise against the pipeline without them)."""
    cfg = resolve(2, options)
    assert cfg.parallel.pipeline.size == 2 and cfg.model.dtype == options.get("model.dtype", "torch.float32")


@pytest.mark.parametrize(
    ("world_size", "options", "message"),
    [
        (2, {"data.micro_num": 1}, "1F1B needs at least one micro-batch per stage; set data.micro_num >= 2"),
        (2, {"data.micro_num": 5, "model.num_chunks": 2}, "micro_num // 2 = 2 rounds, which must divide it"),
        (2, {"model.num_chunks": 3}, "model.num_layers=4 must be divisible by the 3 pipeline chunks"),
        (4, {"parallel.pipeline.size": 4, "model.num_chunks": 2}, "leaves a stage without a block"),
        (2, {"parallel.pipeline.mode": "ZBH1", "model.num_chunks": 2}, "ZBH1 runs one chunk per rank"),
        (
            4,
            {"parallel.pipeline.mode": "ZBV", "parallel.mode": "fsdp2"},
            "FSDP2 does not reduce the zero-bubble schedules' split backward correctly yet",
        ),
        (3, {}, "parallel.pipeline.size=2 must divide the world size 3"),
        (4, {"parallel.mode": "fsdp2", "parallel.fsdp_cpu_offload": True}, "FSDP2's CPU offload per stage"),
        (2, {"model.checkpoint": 1.0, "parallel.pipeline.mode": "ZBV"}, "split backward fails on checkpointed"),
        (2, {"model.checkpoint": 0.5, "parallel.pipeline.mode": "ZBH1"}, "split backward fails on checkpointed"),
        (2, {"model.tie_word_embeddings": True}, "the embedding and the head sit on different stages"),
        (
            2,
            {"model.lora": {"r": 4, "base_on_host": True}},
            "base_on_host=True with parallel.pipeline.size=2: not built",
        ),
        (2, {"parallel.tensor.mode": "auto", "memory_budget.device": "1GiB"}, "not searched under a pipeline"),
        # a stage's tensor group
        (
            4,
            {"parallel.tensor.size": 2, "parallel.tensor.mode": "msp", "parallel.mode": "ddp", "data.global_bsz": 16},
            "DDP does not take torch's tensor-parallel DTensors",
        ),
        (
            4,
            {
                "parallel.tensor.size": 2,
                "parallel.tensor.mode": "isp",
                "parallel.mode": "ddp",
                "parallel.pipeline.mode": "ZBV",
            },
            "does not follow the zero-bubble split backward",
        ),
        (
            8,
            {
                "parallel.tensor.size": 2,
                "parallel.tensor.mode": "isp",
                "parallel.mode": "fsdp2",
                "parallel.weight.size": 2,
            },
            "parallel.weight.size=2 under a pipeline: FSDP2 shards over a stage's 4 ranks",
        ),
        (
            4,
            {"parallel.tensor.size": 4},
            "parallel.pipeline.size=2 x parallel.tensor.size=4 must divide the world size 4",
        ),
    ],
)
def test_what_a_pipeline_cannot_take_is_one_line(world_size, options, message):
    with pytest.raises(ConfigError) as info:
        resolve(world_size, options)
    assert message in str(info.value), str(info.value)
    assert len(str(info.value).splitlines()) <= 2


def test_micro_batch_rules_match_torchs_schedules():
    """Schedule1F1B raises below one micro-batch per stage; the interleaved and zero-bubble schedules when the
    rounds (micro_num // P, at least 1) do not divide micro_num."""
    assert micro_batch_problem(4, "1F1B", 1, 4) is None and micro_batch_problem(4, "1F1B", 1, 3) is not None
    assert micro_batch_problem(4, "1F1B", 2, 3) is None  # one round
    assert micro_batch_problem(4, "1F1B", 2, 10) is None  # two rounds of 5
    assert micro_batch_problem(4, "ZBH1", 1, 9) is not None  # two rounds do not divide 9
    assert micro_batch_problem(2, "ZBV", 1, 2) is None


def test_the_planner_refuses_fsdp2_under_a_pipeline_in_one_line(capsys):
    """torch's stage defers FSDP2's gradient reduction to the step's end; the planner's local run of a stage does
    not (tests/unit/test_planner_pipeline.py traces the other layouts)."""
    from internlm_offload.tools.plan import main

    config = str(PP2)
    assert main(["--config", config, "--world-size", "4", "--cfg-options", "parallel.mode=fsdp2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "parallel.mode='fsdp2' with parallel.pipeline.size=2: the memory planner traces a pipeline's" in err
    assert len(err.splitlines()) == 1


def test_another_trainers_weights_are_refused_under_a_pipeline_in_one_line(tmp_path, monkeypatch):
    """One rank reads a foreign folder for its own parameters: not for a pipeline's stages yet (this trainer's
    own checkpoints load model-only into stages, tests/e2e/test_pipeline_e2e.py)."""
    from internlm_offload.engine import start_plan
    from internlm_offload.weights.sources import WeightsSource

    monkeypatch.setattr(start_plan, "foreign_source", lambda info, model: WeightsSource(tmp_path, "hf"))
    cfg = resolve(2, {"ckpt.load_ckpt_info": {"path": str(tmp_path), "ckpt_type": "hf"}})
    with pytest.raises(ConfigError) as info:
        start_plan.find_weights_source(cfg)
    assert "another trainer's weights (hf) do not load into a pipeline's stages yet" in str(info.value)
    assert len(str(info.value).splitlines()) == 1
    single = resolve(
        1, {"parallel.pipeline.size": 1, "ckpt.load_ckpt_info": {"path": str(tmp_path), "ckpt_type": "hf"}}
    )
    assert start_plan.find_weights_source(single) == WeightsSource(tmp_path, "hf")

"""The DeepSeek-V3 family's tensor plan and what the config checks count of it: every module the plan names exists
(MLA with and without the query bottleneck, GLM-4.5's grouped-query attention), heads the tensor size cannot split
are refused in one line when the model is split, the routed experts come from its config, and the features it
does not have refuse it in one line."""

import json
from pathlib import Path

import pytest
import torch

from internlm_offload.builder.model import build_model
from internlm_offload.config import ConfigError, ModelConfig, load_config_file, resolve_config
from internlm_offload.engine.model_plan import planned_blocks
from internlm_offload.engine.tensor_parallel import check_heads
from internlm_offload.family import routed_experts
from internlm_offload.model.tensor_plan import BlockPlan, Region

REPO = Path(__file__).resolve().parents[2]
DEEPSEEK = REPO / "configs" / "deepseek_v3_tiny.py"
TINY = load_config_file(DEEPSEEK)["model"]["hf_config"]
GLM45 = dict(model_type="glm4_moe", vocab_size=259, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
             num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             n_routed_experts=4, num_experts_per_tok=2, use_qk_norm=True)  # fmt: skip


def names(plan: BlockPlan) -> list[str]:
    attention, feed_forward = plan.attention, plan.feed_forward
    modules = [attention.module, *attention.column, *attention.row, *(r.module for r in attention.replicated)]
    return [*modules, feed_forward.module, *feed_forward.column, *feed_forward.row, *plan.kv, *plan.norms]


@pytest.mark.parametrize(
    "config",
    [TINY, {**TINY, "q_lora_rank": None}, GLM45],
    ids=["mla", "mla-without-q-lora", "glm45-gqa"],
)
def test_the_plan_names_modules_the_model_has(config):
    model = build_model(ModelConfig(type="deepseek_v3", hf_config=config), torch.device("meta"))
    plan = model.tensor_plan()
    assert len(plan.blocks) == len(model.layers) and plan.sparse_blocks() == list(model.args.sparse_layers)
    for name in (plan.embedding, plan.final_norm, plan.head):
        model.get_submodule(name)
    for block, block_plan in zip(model.layers, plan.blocks):
        for name in names(block_plan):
            block.get_submodule(name)  # raises where the plan names a module the block lacks
    attention = plan.blocks[0].attention
    if model.args.mla:  # the rope key: the last qk_rope_head_dim outputs of kv_a_proj_with_mqa
        assert [(r.module, r.read_whole) for r in attention.replicated if r.read_whole] == [
            ("attention.kv_a_proj_with_mqa", config["qk_rope_head_dim"])
        ]
    else:
        assert not attention.replicated and plan.blocks[0].kv == ("attention.wk", "attention.wv")


def test_the_mtp_layers_are_side_blocks_after_the_stack():
    """Each MTP layer's block is planned as a sparse block after the main ones (numbered on from them: tensor, expert
    and sequence parallel find it as block L + k), its norms and eh_proj named at the model level."""
    mtp = {"num_layers": 2, "share_weights": False}
    model = build_model(ModelConfig(type="deepseek_v3", hf_config=TINY, mtp_config=mtp), torch.device("meta"))
    plan = model.tensor_plan()
    assert [side.block for side in plan.side_blocks] == ["mtp.layers.0.block", "mtp.layers.1.block"]
    for side in plan.side_blocks:
        assert side.plan.sparse and side.projections == (side.block.replace("block", "eh_proj"),)
        for name in (side.block, *side.norms, *side.projections):
            model.get_submodule(name)
        for name in names(side.plan):
            model.get_submodule(side.block).get_submodule(name)
    indexed = [(index, block) for index, block, _ in planned_blocks(model, plan)]
    assert [index for index, _ in indexed] == list(range(len(model.layers) + 2))
    assert [block for _, block in indexed[-2:]] == [layer.block for layer in model.mtp.layers]


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(4, 4, 8), (6, 6, 4), (4, 3, 2)])
def test_heads_the_tensor_size_cannot_split_are_refused_in_one_line(heads, kv_heads, size):
    plan = BlockPlan(attention=Region("attention"), kv=(), kv_heads=kv_heads, feed_forward=Region("ffn"), heads=heads)
    with pytest.raises(ConfigError) as error:
        check_heads(1, plan, size, "parallel.tensor.mode='mtp'")
    message = str(error.value)
    assert f"over {size} ranks: block 1 has {heads} query heads and {kv_heads} kv heads" in message
    assert "\n" not in message


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(4, 4, 2), (4, 2, 4), (4, 1, 2), (4, 4, 1)])
def test_heads_the_tensor_size_splits_pass(heads, kv_heads, size):
    plan = BlockPlan(attention=Region("attention"), kv=(), kv_heads=kv_heads, feed_forward=Region("ffn"), heads=heads)
    check_heads(0, plan, size, "parallel.tensor.mode='mtp'")
    unstated = BlockPlan(attention=Region("attention"), kv=(), kv_heads=3, feed_forward=Region("ffn"))
    check_heads(0, unstated, 2, "parallel.tensor.mode='mtp'")  # heads 0: the config section checked them


def test_routed_experts_come_from_the_config_or_the_folder(tmp_path):
    assert routed_experts(ModelConfig(type="deepseek_v3", hf_config=TINY)) == 8
    assert routed_experts(ModelConfig(type="deepseek_v3", hf_config={"model_type": "glm4_moe"})) == 128  # default
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "n_routed_experts": 16}))
    assert routed_experts(ModelConfig(type="deepseek_v3", hf_path=str(tmp_path))) == 16
    assert routed_experts(ModelConfig(num_experts=4, top_k=2)) == 4  # the native section's own key


def resolve(world_size: int, options: dict):
    return resolve_config(load_config_file(DEEPSEEK, options), world_size=world_size)


def test_the_config_checks_count_the_family_s_experts_not_the_native_keys():
    """Expert parallel over the config's 8 experts; tensor parallel at 8 not refused for the native section's
    defaults (the model's own 4 heads are checked when it is split); a size that does not divide 8 experts refused
    naming where they come from."""
    assert resolve(4, {"parallel.mode": "ddp", "parallel.expert.size": 2}).parallel.expert.size == 2
    tensor = {"parallel.mode": "fsdp2", "parallel.tensor.size": 8, "parallel.expert.no_tp": True}
    assert resolve(8, tensor).parallel.tensor.size == 8
    with pytest.raises(ConfigError, match=r"parallel.expert.size=3 must divide the config's n_routed_experts \(8\)"):
        resolve(3, {"parallel.mode": "ddp", "parallel.expert.size": 3})
    split = {"parallel.mode": "fsdp2", "parallel.tensor.size": 2, "parallel.expert.size": -1}  # no_tp=False
    assert resolve(4, split).parallel.expert.size == 2  # min(data-parallel ranks 2, 8 experts)


def test_a_pipeline_takes_the_family_and_refuses_its_stage_tensor_groups_in_one_line():
    """Its stages count their own routers' choices (tests/unit/test_pipeline_moe.py): `pipeline` is in its
    capabilities; a stage's tensor group under experts is not checked yet, refused naming the key."""
    no_mtp = {"model.mtp_config": {"num_layers": 0}}  # refused under a pipeline (tests/unit/test_pipeline_moe.py)
    assert resolve(2, {"parallel.pipeline.size": 2, **no_mtp}).parallel.pipeline.size == 2
    with pytest.raises(ConfigError) as error:
        resolve(4, {"parallel.pipeline.size": 2, "parallel.tensor.size": 2, "parallel.mode": "fsdp2", **no_mtp})
    message = str(error.value)
    assert "parallel.pipeline.size=2 with parallel.tensor.size=2 on a mixture of experts" in message, message

"""The qwen3_next family's block kinds (mixer / feed-forward) and its reduced models of given kinds: what the kernel
probe runs one block of each of, and what the planner composes from."""

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.family import block_kinds, with_blocks
from internlm_offload.model.families.qwen3_next.args import args_from_config
from internlm_offload.model.families.qwen3_next.build import transformers_config

LIN, FULL = "linear_attention/sparse", "full_attention/sparse"


def section(**hf):
    cfg = resolve_config(load_config_file("configs/qwen3_next_tiny.py", {}))
    return cfg.model.model_copy(update={"hf_config": {**cfg.model.hf_config, **hf}})


def test_the_tiny_configs_kinds_follow_the_layer_pattern():
    assert block_kinds(section()) == (LIN, LIN, LIN, FULL)


def test_qwen3_next_dense_blocks_are_their_own_kind_and_survive_the_reduction():
    """mlp_only_layers / decoder_sparse_step make dense blocks; a reduced model of any order builds those kinds."""
    model = section(num_hidden_layers=8, mlp_only_layers=[0], decoder_sparse_step=1)
    kinds = block_kinds(model)
    assert kinds[0] == "linear_attention/dense" and kinds[1:4] == (LIN, LIN, FULL)
    wanted = ["full_attention/dense", LIN, "linear_attention/dense", FULL]
    reduced = with_blocks(model, wanted)
    assert block_kinds(reduced) == tuple(wanted) and reduced.num_layers == 4
    args = args_from_config(transformers_config(reduced))  # the build reads the same pattern
    assert args.layer_types == tuple(k.split("/")[0] for k in wanted)
    assert args.sparse == (False, True, False, True)


def test_qwen3_5_moe_holds_no_dense_block():
    model = section(model_type="qwen3_5_moe_text")
    assert with_blocks(model, [LIN, FULL]).hf_config["layer_types"] == ["linear_attention", "full_attention"]
    assert with_blocks(model, ["linear_attention/dense"]) is None

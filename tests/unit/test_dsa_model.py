"""DeepSeek Sparse Attention in the DeepSeek-V3 family (configs/glm5_tiny.py: GLM-5's `glm_moe_dsa` with top-k 16
and shared blocks; and as DeepSeek-V3.2's `deepseek_v32`): the blocks it builds (which own an indexer, which share
whose top-k, the indexer frozen), packed documents each with its own loss at top-k below their lengths, the names
its folder reads, and the layouts not built refused in one line."""

from pathlib import Path

import pytest
import torch
from test_deepseek_documents import document_loss, randomized

from internlm_offload.builder.model import build_model
from internlm_offload.config import ConfigError, ModelConfig, load_config_file, resolve_config
from internlm_offload.model.dsa import SparseLatentAttention
from internlm_offload.model.families.deepseek_v3 import build as deepseek_build

GLM5 = load_config_file(Path(__file__).parents[2] / "configs" / "glm5_tiny.py")["model"]["hf_config"]
V32 = {k: v for k, v in GLM5.items() if k != "indexer_types"} | {"model_type": "deepseek_v32"}
# two documents, each longer than the top-k (16): their attention is sparse, alone and packed
DOCUMENTS = [list(range(3, 3 + 23)), [(7 * t) % 250 + 2 for t in range(29)]]


def build(config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(type="deepseek_v3", hf_config=config), torch.device("cpu"))


def test_glm5_blocks_own_or_share_an_indexer_as_indexer_types_say():
    model = build(GLM5)
    blocks = [layer.attention for layer in model.layers]
    assert all(isinstance(b, SparseLatentAttention) for b in blocks)
    assert [b.indexer is not None for b in blocks] == [True, False, True, False]
    assert [b.source for b in blocks] == [0, 0, 2, 2]
    indexer = dict(blocks[0].indexer.named_parameters())
    assert sorted(indexer) == ["k_norm.bias", "k_norm.weight", "weights_proj.weight", "wk.weight", "wq_b.weight"]
    assert not any(p.requires_grad for p in indexer.values())  # frozen: the optimizer skips them
    assert blocks[0].indexer.rope_interleave and model.needs_documents
    names = {n for n, _ in model.named_parameters() if ".indexer." in n}
    assert {n.split(".")[1] for n in names} == {"0", "2"}


def test_deepseek_v32_has_an_indexer_in_every_block_with_half_split_rope():
    model = build(V32)
    assert all(layer.attention.indexer is not None for layer in model.layers)
    assert not model.layers[0].attention.indexer.rope_interleave


def test_multi_token_prediction_block_owns_an_indexer_and_trains():
    """GLM-5's MTP layer is "full" (XTuner appends it so): its block has its own indexer, reading the forward's store
    under its own index; a training forward gives its logits and the backward runs."""
    torch.manual_seed(0)
    section = ModelConfig(type="deepseek_v3", hf_config=GLM5, mtp_config={"num_layers": 2, "share_weights": True})
    model = build_model(section, torch.device("cpu")).train()
    attention = model.mtp.layers[0].block.attention
    assert attention.indexer is not None and attention.source == attention.layer == 4
    ids = torch.tensor([t for d in DOCUMENTS for t in d])[None]
    positions = torch.cat([torch.arange(len(d)) for d in DOCUMENTS])[None]
    out = model(ids, positions)
    assert len(out.mtp_logits) == 2
    sum(logits.float().square().mean() for logits in (out.logits, *out.mtp_logits)).backward()
    assert attention.q_b_proj.weight.grad.abs().sum() > 0 and attention.indexer.wq_b.weight.grad is None


def test_folder_names_of_the_indexer():
    model = build(GLM5)
    layout = deepseek_build.folder_format(model)
    foreign = {layout.table.to_foreign(n) for n, _ in model.named_parameters() if ".indexer." in n}
    assert "model.layers.2.self_attn.indexer.weights_proj.weight" in foreign and len(foreign) == 10
    assert "indexer.weights_proj.weight" in layout.keep_fp32  # transformers keeps it in fp32


@pytest.mark.parametrize("config", [GLM5, V32], ids=["glm5", "v32"])
def test_each_document_of_a_packed_row_has_the_loss_it_has_alone(config):
    model = randomized(build(config).eval())
    row = torch.tensor([t for d in DOCUMENTS for t in d])[None]
    positions = torch.cat([torch.arange(len(d)) for d in DOCUMENTS])[None]
    starts = [0, len(DOCUMENTS[0]), row.shape[1]]
    with torch.no_grad():
        packed = model(row, positions).logits[0]
        for k, tokens in enumerate(DOCUMENTS):
            alone = document_loss(model(torch.tensor(tokens)[None]).logits[0], tokens)
            in_row = document_loss(packed[starts[k] : starts[k + 1]], tokens)
            torch.testing.assert_close(in_row, alone, rtol=1e-5, atol=0)
        # top-k matters here: the same model with every key chosen gives the documents other losses
        for layer in model.layers:
            layer.attention.topk = row.shape[1]
        dense = model(row, positions).logits[0]
    assert (dense - packed).abs().max() > 1e-3


def test_bad_indexer_types_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"indexer_types\[0\]='shared' has no 'full' layer before it"):
        build({**GLM5, "indexer_types": ["shared", "full", "full", "full"]})
    with pytest.raises(ConfigError, match=r"indexer_types has 3 entries for num_hidden_layers=4"):
        build({**GLM5, "indexer_types": ["full"] * 3})


def check_run(parallel: dict, config: dict = GLM5, world_size: int = 2) -> None:
    raw = {"model": {"type": "deepseek_v3", "hf_config": config}, "parallel": parallel, "data": {"micro_num": 2}}
    deepseek_build.check_run(resolve_config(raw, world_size=world_size))


@pytest.mark.parametrize(
    "parallel",
    [
        {"mode": "fsdp2", "tensor": {"size": 2, "mode": mode}, "expert": {"no_tp": True}}
        for mode in ("mtp", "msp", "fsp")
    ]
    + [{"pipeline": {"size": 2}}],
    ids=["mtp", "msp", "fsp", "pipeline-at-a-full-block"],
)
def test_tensor_modes_and_a_pipeline_cut_at_a_full_block_are_taken(parallel):
    """The tiny GLM-5's blocks full, shared, full, shared: two stages begin at blocks 0 and 2, both full."""
    check_run(parallel)


def test_a_stage_beginning_at_a_shared_block_is_refused_in_one_line():
    """Blocks full, shared, shared, shared over two stages: block 2 begins stage 1 and shares block 0's top-k."""
    config = {**GLM5, "indexer_types": ["full", "shared", "shared", "shared"]}
    with pytest.raises(ConfigError) as info:
        check_run({"pipeline": {"size": 2}}, config)
    assert str(info.value) == (
        "parallel.pipeline.size=2: stage 1 begins at block 2, which shares the top-k of block 0 on an earlier stage "
        "(model.hf_config's indexer_types); DeepSeek sparse attention sends no top-k between stages: choose a size "
        "(or model.num_chunks) whose every stage begins at a 'full' block"
    )


def test_the_tiny_glm5_config_is_the_tiny_deepseek_v3_with_glm5_keys_over_it():
    """configs/glm5_tiny.py inherits configs/deepseek_v3_tiny.py (`_base_`): the same model but for GLM-5's keys, and
    no multi-token prediction (GlmMoeDsaConfig has none)."""
    configs = Path(__file__).parents[2] / "configs"
    glm5, v3 = (load_config_file(configs / name)["model"] for name in ("glm5_tiny.py", "deepseek_v3_tiny.py"))
    dsa = {"model_type", "n_group", "index_topk", "index_n_heads", "index_head_dim", "indexer_types", "rope_parameters"}
    assert {k: v for k, v in glm5["hf_config"].items() if k not in dsa} == {
        k: v for k, v in v3["hf_config"].items() if k not in dsa
    }
    assert glm5["hf_config"]["model_type"] == "glm_moe_dsa" and glm5["mtp_config"] is None
    cfg = resolve_config({"model": glm5}, world_size=1)
    assert cfg.model.mtp_config is None or not cfg.model.mtp_config.num_layers

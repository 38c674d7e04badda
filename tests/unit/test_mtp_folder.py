"""Multi-token prediction's weights in a Hugging Face folder of the DeepSeek-V3 family: written at blocks L + k with
transformers' names (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the block's own, its router's bias in fp32)
and the copies of the shared embedding and head DeepSeek-V3's files carry, read back bit for bit; a folder
transformers saved (no MTP weights) keeps the seed's draw, said in one line; part of a layer is refused; layers the
model does not build are left out, said in one line."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from internlm_offload.builder.model import build_model, folder_layout
from internlm_offload.config import ModelConfig
from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.deepseek_v3.build import folder_config
from internlm_offload.weights.hf_folder import write_family_folder

transformers = pytest.importorskip("transformers")

TINY = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1)  # fmt: skip
TWO = {"num_layers": 2, "share_weights": False}  # two MTP layers: blocks 2 and 3 of the folder


def seeded(**keys: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(type="deepseek_v3", **keys), torch.device("cpu"))


def written(tmp_path, mtp: dict = TWO) -> tuple[torch.nn.Module, object]:
    """A seeded model with `mtp`, its router biases made to count, written as its folder with the copies."""
    cfg = ModelConfig(type="deepseek_v3", hf_config=TINY, mtp_config=mtp)
    model = seeded(hf_config=TINY, mtp_config=mtp)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.3, 0.3)
    layout = folder_layout(cfg)
    write_family_folder(
        model.state_dict(), layout, folder_config(cfg), tmp_path / "folder", torch.float32, mtp_copies=True
    )
    return model, layout


def test_mtp_layers_go_out_at_blocks_l_plus_k_and_come_back_bit_for_bit(tmp_path):
    model, _ = written(tmp_path)
    folder = tmp_path / "folder"
    tensors = load_file(folder / "model.safetensors")
    for k, block in ((0, 2), (1, 3)):
        for own, native in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("shared_head.norm", "head_norm")):  # fmt: skip
            assert torch.equal(
                tensors[f"model.layers.{block}.{own}.weight"], model.mtp.layers[k].get_submodule(native).weight
            )
        bias = tensors[f"model.layers.{block}.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and torch.equal(bias, model.mtp.layers[k].block.feed_forward.router.e_score_correction_bias)  # fmt: skip
        assert f"model.layers.{block}.self_attn.kv_b_proj.weight" in tensors
        assert f"model.layers.{block}.mlp.experts.3.down_proj.weight" in tensors
        assert torch.equal(tensors[f"model.layers.{block}.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
        assert torch.equal(tensors[f"model.layers.{block}.shared_head.head.weight"], tensors["lm_head.weight"])
    assert not any(name.startswith("model.layers.4.") for name in tensors)
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 2
    loaded = seeded(hf_path=str(folder), mtp_config=TWO)
    want = model.state_dict()
    assert loaded.state_dict().keys() == want.keys()
    assert all(torch.equal(t, want[name]) for name, t in loaded.state_dict().items()), "a tensor changed"


def test_a_folder_transformers_saved_has_no_mtp_weights_they_are_the_seeds_draw(tmp_path, caplog):
    """transformers' causal LMs never build MTP: the layer keeps what the seed drew (the model of its config.json,
    num_nextn_predict_layers=1 by default), said in one line; the main model is the folder's."""
    config = {key: value for key, value in TINY.items() if key != "model_type"}
    reference = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    reference.save_pretrained(tmp_path / "hf")
    with caplog.at_level("WARNING"):
        loaded = seeded(hf_path=str(tmp_path / "hf"))
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert lines == [
        f"{tmp_path / 'hf'} holds no weights of multi-token-prediction layer(s) 0 (model.layers.2 on; a folder "
        "transformers saved never has them): drawn from the seed"
    ]
    assert torch.equal(loaded.output.weight, reference.lm_head.weight)
    drawn = seeded(hf_config=TINY)
    assert all(torch.equal(p, drawn.mtp.get_parameter(n)) for n, p in loaded.mtp.named_parameters())


@pytest.mark.parametrize("absent_too", [False, True], ids=["one-part-missing", "and-a-layer-absent"])
def test_part_of_an_mtp_layer_is_refused_naming_what_is_missing(tmp_path, absent_too):
    """A layer the folder holds in part is refused, whether or not another is absent altogether (drawn)."""
    written(tmp_path)
    path = tmp_path / "folder" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.3.hnorm.weight"]
    if absent_too:
        tensors = {name: t for name, t in tensors.items() if not name.startswith("model.layers.2.")}
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r'Missing key\(s\) in state_dict: "mtp.layers.1.hnorm.weight"\.'):
        seeded(hf_path=str(tmp_path / "folder"), mtp_config=TWO)


def test_layers_the_model_does_not_build_are_left_out_in_one_line(tmp_path, caplog):
    """The folder's two MTP layers, the section unset (its config's depth 2, one shared layer: block 2 read, block 3
    left out), then num_layers=0 (both left out; the main model read all the same)."""
    model, _ = written(tmp_path)
    folder = str(tmp_path / "folder")
    for mtp, start, built in ((None, 3, 1), ({"num_layers": 0}, 2, 0)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            loaded = seeded(hf_path=folder, mtp_config=mtp)
        lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert (
            len(lines) == 1 and f"blocks from {start} on (multi-token prediction the model does not build: " in lines[0]
        )
        assert f"builds {built} layers" in lines[0]
        assert torch.equal(loaded.output.weight, model.output.weight)
    shared = seeded(hf_path=folder)
    assert torch.equal(shared.mtp.layers[0].eh_proj.weight, model.mtp.layers[0].eh_proj.weight)

"""A released-style Qwen3.5-MoE vision-language folder (transformers' `Qwen3_5MoeForConditionalGeneration`, a tiny
vision tower) from the folder alone (model/families/qwen3_next/folder_layout.py): its text model gives the vision-language
class's step-1 loss and grad norm on text-only ids, the vision tower is left out in one line, and the `--hf` export is
the folder again (the vision tower copied through bit for bit). Two layouts: transformers' save_pretrained (one tensor
per expert) and the released files' (experts fused [E, 2I, D] / [E, D, I], as transformers holds them in memory)."""

import json
import logging
from pathlib import Path

import pytest
import torch
from folder_parity import assert_step_1_matches, step_1_ids
from safetensors.torch import load_file, save_file

from internlm_offload.builder.model import build_model, folder_layout
from internlm_offload.config import ModelConfig
from internlm_offload.model.families.qwen3_next.folder_layout import TEXT_PREFIX
from internlm_offload.tools.export import export_family_folder
from internlm_offload.weights.hf_folder import folder_pieces, read_folder

transformers = pytest.importorskip("transformers")

VOCAB = 259
# 4 layers: 3 Gated DeltaNet then 1 gated full attention; 8 of each head's 16 dims rotate, as mRoPE sections
# [2, 1, 1] of its 4 frequencies (interleaved, as Qwen3.5's [11, 11, 10] of 32)
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 40,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True}}  # fmt: skip
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 4, "num_position_embeddings": 16}  # fmt: skip
LAYOUTS = ("per_expert", "fused")


def vl_folder(folder: Path, layout: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A seeded random vision-language model (sdpa), its zero-init norms made to count, saved in `layout`: "fused"
    writes transformers' in-memory names and shapes (the released files' layout), "per_expert" its save_pretrained."""
    torch.manual_seed(0)
    config = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION, attn_implementation="sdpa")
    model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key.endswith("norm.weight") and "visual" not in key:
                tensor.uniform_(-0.5, 0.5)
    model.to(dtype).save_pretrained(folder)
    if layout == "fused":
        tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
        assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return model


def hf_path(folder: Path) -> ModelConfig:
    return ModelConfig(type="qwen3_next", hf_path=str(folder))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_text_model_gives_the_vision_language_class_step_1_and_says_the_vision_tower_is_left_out(
    tmp_path, layout, caplog
):
    """70 tokens a row (two chunks of the delta rule); the vision-language forward's own (4, B, T) text positions."""
    reference = vl_folder(tmp_path / "vl", layout)
    with caplog.at_level(logging.WARNING):
        model = build_model(hf_path(tmp_path / "vl"), torch.device("cpu"))
    assert model.source_layout.fused_experts == (layout == "fused")
    assert_step_1_matches(model, reference, step_1_ids(VOCAB, 70))
    tower = [n for n in load_file(tmp_path / "vl" / "model.safetensors") if n.startswith("model.visual.")]
    lines = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(lines) == 1 and f"{len(tower)} tensors of the vision tower (model.visual.*)" in lines[0], lines


def test_text_positions_in_three_equal_rows_are_the_text_models_rope(tmp_path):
    """Interleaved mRoPE reads frequency j from row j mod 3 within its sections: three equal rows (text) give the
    1-D RoPE the native decoder applies, bit for bit."""
    reference = vl_folder(tmp_path / "vl", "per_expert")
    model = build_model(hf_path(tmp_path / "vl"), torch.device("cpu"))
    positions = torch.stack([torch.arange(9), torch.arange(9) + 5])  # (B, T), two rows of a batch
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = reference.model.language_model.rotary_emb(x, positions[None].expand(3, -1, -1))
    native_cos, native_sin = model.rope_cos_sin(9, torch.float32, positions)
    assert torch.equal(native_cos, cos) and torch.equal(native_sin, sin)


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(("layout", "stored", "dtype"), [("per_expert", BF16, BF16), ("fused", BF16, BF16),
                                                         ("fused", BF16, FP32)])  # fmt: skip
def test_the_hf_export_is_the_folder_with_its_vision_tower_copied_through(tmp_path, layout, stored, dtype):
    """The text model in `dtype`, the vision tower as stored whatever `dtype`; config.json as the released files spell
    it (transformers 4.57's `rope_scaling`, which 5.x rewrites as `rope_parameters` on a save) comes back as it was,
    the export's dtype recorded."""
    vl_folder(tmp_path / "vl", layout, stored)
    config = json.loads((tmp_path / "vl" / "config.json").read_text())
    rope = config["text_config"].pop("rope_parameters")
    config["text_config"].update(rope_theta=rope.pop("rope_theta"), partial_rotary_factor=rope.pop("partial_rotary_factor"),
                                 rope_scaling=rope)  # fmt: skip
    (tmp_path / "vl" / "config.json").write_text(json.dumps(config, indent=2))
    cfg = hf_path(tmp_path / "vl")
    model = build_model(cfg, torch.device("cpu"))
    assert model.args.rotary_dim == 8
    run = {"model": cfg.model_dump(), "data": {"tokenizer": "byte"}}
    export_family_folder(model.state_dict(), tmp_path / "out", dtype, run)
    want, have = load_file(tmp_path / "vl" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert have.keys() == want.keys()
    tower = [k for k in want if k.startswith("model.visual.")]
    assert tower and all(have[k].dtype == stored and torch.equal(have[k], want[k]) for k in tower), "the tower differs"
    text = [k for k in want if k not in tower]
    assert all(have[k].dtype == dtype and torch.equal(have[k].to(stored), want[k]) for k in text), "the text differs"
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == {**config, "dtype": str(dtype).removeprefix("torch.")}
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == "Qwen3_5MoeForConditionalGeneration"


def test_a_vision_language_hf_config_is_refused_in_one_line():
    with pytest.raises(ValueError, match="a vision-language config is built from its folder"):
        ModelConfig(type="qwen3_next", hf_config={"model_type": "qwen3_5_moe", "text_config": {}})


def test_the_piece_at_a_time_read_is_the_whole_read(tmp_path, caplog):
    """FSDP2's meta build reads the folder a piece at a time (`folder_pieces`): the same tensors bit for bit, a fused
    tensor one piece (both of its stacked halves), the vision tower not read and said once."""
    vl_folder(tmp_path / "vl", "fused")
    layout = folder_layout(hf_path(tmp_path / "vl"))
    whole = read_folder(tmp_path / "vl", layout)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        pieces = list(folder_pieces(tmp_path / "vl", layout))
    assert sum("vision tower" in r.getMessage() for r in caplog.records) == 1
    read = {name: tensor for piece in pieces for name, tensor in piece.items()}
    assert read.keys() == whole.keys() and all(torch.equal(read[k], whole[k]) for k in whole)
    assert {"layers.0.feed_forward.experts.w1", "layers.0.feed_forward.experts.w3"} in [set(p) for p in pieces]


def released_mtp_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released folders' `mtp.*` (outside the `model.language_model.` prefix, the experts one tensor each even
    where the main experts are fused), random, shaped after the last (full-attention, sparse) block."""
    g = torch.Generator().manual_seed(3)
    last = f"{TEXT_PREFIX}layers.{TEXT['num_hidden_layers'] - 1}."
    hidden, inner = TEXT["hidden_size"], TEXT["moe_intermediate_size"]
    shapes = {"mtp.fc.weight": (hidden, 2 * hidden)}
    shapes |= {f"mtp.{n}.weight": (hidden,) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    for name, t in tensors.items():
        if name.startswith(last) and ".experts." not in name:
            shapes["mtp.layers.0." + name.removeprefix(last)] = tuple(t.shape)
    for e in range(TEXT["num_experts"]):
        for proj, shape in (
            ("gate_proj", (inner, hidden)),
            ("up_proj", (inner, hidden)),
            ("down_proj", (hidden, inner)),
        ):
            shapes[f"mtp.layers.0.mlp.experts.{e}.{proj}.weight"] = shape
    dtype = tensors[f"{TEXT_PREFIX}norm.weight"].dtype
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in shapes.items()}


def test_a_released_folder_trains_its_mtp_layer_and_exports_every_tensor_back(tmp_path, caplog):
    """A fused vision-language folder with the released `mtp.*` and text_config's mtp_num_hidden_layers=1: the MTP
    layer is read by name (nothing left out but the vision tower), and the export is the folder bit for bit: the
    main experts fused under the prefix, the MTP experts one tensor each outside it, the vision tower copied."""
    vl_folder(tmp_path / "vl", "fused", BF16)
    want = load_file(tmp_path / "vl" / "model.safetensors")
    want |= released_mtp_tensors(want)
    save_file(want, tmp_path / "vl" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "vl" / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (tmp_path / "vl" / "config.json").write_text(json.dumps(config, indent=2))
    cfg = hf_path(tmp_path / "vl")
    with caplog.at_level(logging.WARNING):
        model = build_model(cfg, torch.device("cpu"))
    assert model.mtp is not None and "left out" not in caplog.text, caplog.text
    layer = model.mtp.layers[0]
    assert torch.equal(layer.eh_proj.weight, want["mtp.fc.weight"].float())
    assert torch.equal(
        layer.block.feed_forward.experts.w2[3], want["mtp.layers.0.mlp.experts.3.down_proj.weight"].float()
    )
    run = {"model": cfg.model_dump(), "data": {"tokenizer": "byte"}}
    export_family_folder(model.state_dict(), tmp_path / "out", BF16, run)
    have = load_file(tmp_path / "out" / "model.safetensors")
    assert have.keys() == want.keys()
    assert all(torch.equal(have[k], want[k]) for k in want), [k for k in want if not torch.equal(have[k], want[k])]

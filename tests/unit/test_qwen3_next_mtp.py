"""Multi-token prediction on the Qwen3-Next family (model/mtp.py, the DeepSeek-V3 family's, with zero-centred norms):
the forward is the reference's equations written out by hand on the same weights (transformers has no MTP for these
models); with λ = 0 a training step is the step without MTP bit for bit; a folder's `mtp.*` tensors (the released
names, the experts one tensor each) load into the MTP layer without a warning and go back out bit for bit; without MTP
they are left out in one line; the pipeline's last stage runs the depths as one process does; the config's section
follows config.json's `mtp_num_hidden_layers` and refuses what is not built in one line."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_pipeline_moe import run_stages_with_mtp, stages_of
from test_qwen3_next_folder import CONFIG, KINDS, transformers_folder

from internlm_offload.builder import build_components, make_trainer
from internlm_offload.builder.model import build_model, folder_layout
from internlm_offload.config import ConfigError, ModelConfig, resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.loss import mtp_labels, token_loss_sum
from internlm_offload.engine.runtime import RunContext
from internlm_offload.model.attention import Attention, Documents
from internlm_offload.model.families.qwen3_next import build as qwen_build
from internlm_offload.model.moe import MoE
from internlm_offload.model.output import MTP
from internlm_offload.weights.hf_folder import folder_pieces, read_folder, write_family_folder

transformers = pytest.importorskip("transformers")

CTX = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
TINY = {"model_type": "qwen3_next", **CONFIG, **KINDS["qwen3_next"][2]}  # block 1 dense, block 3 full attention
VOCAB, SEQ = CONFIG["vocab_size"], 16
POSITIONS = torch.stack(
    [torch.cat([torch.arange(7), torch.arange(9)]), torch.cat([torch.arange(n) for n in (4, 5, 7)])]
)
MTP_WEIGHTS = (0.05 / 30, 0.05 / 28)  # each depth's weight on its loss sum (any values: the same on both sides)


def seeded(**keys: object) -> torch.nn.Module:
    """The tiny model with `keys`, every norm weight moved off its zero init (a plain norm would then differ)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(type="qwen3_next", **keys), torch.device("cpu"))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name:
                tensor.uniform_(-0.5, 0.5)
    return model


def zero_centred_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def rolled(x: torch.Tensor, shift: int, positions: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """x[t + shift] where t + shift is in t's document, else `fill`: position by position."""
    out = torch.full_like(x, fill)
    for row in range(x.shape[0]):
        for t in range(x.shape[1] - shift):
            if all(positions[row, s] != 0 for s in range(t + 1, t + shift + 1)):
                out[row, t] = x[row, t + shift]
    return out


@pytest.mark.parametrize("mtp", [{"num_layers": 1}, {"num_layers": 2, "share_weights": True}], ids=["1", "2-shared"])
def test_the_forward_is_the_reference_equations_on_the_same_weights(mtp):
    """Depth k: h^k = norm(block(fc([norm_e(Emb(ids rolled by k)) ; norm_h(h^{k-1})]))), the norms (1 + w), h^0 the
    stack's output before its final norm, `block` a gated full attention with the last block's experts, then the shared
    head. Red with the concat order swapped, with the MTP norms plain (w, not 1 + w), or with the block a DeltaNet."""
    model = seeded(hf_config=TINY, mtp_config=mtp)
    block = model.mtp.layers[0].block
    assert (
        isinstance(block.attention, Attention) and block.attention.output_gate and isinstance(block.feed_forward, MoE)
    )
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids, POSITIONS)
        documents = Documents(POSITIONS)
        h = model.tok_embeddings(ids)
        rope = model.rope_cos_sin(SEQ, h.dtype, POSITIONS)
        for layer in model.layers:
            h = layer(h, rope, documents)
        eps = model.args.rms_norm_eps
        for k in range(1, mtp["num_layers"] + 1):
            layer = model.mtp.layers[0]
            embedded = model.tok_embeddings(rolled(ids, k, POSITIONS))
            joined = torch.cat(
                [zero_centred_rms(embedded, layer.enorm.weight, eps), zero_centred_rms(h, layer.hnorm.weight, eps)], -1
            )
            x = F.linear(joined, layer.eh_proj.weight)
            h = zero_centred_rms(layer.block(x, rope, documents), layer.head_norm.weight, eps)
            torch.testing.assert_close(out.mtp_logits[k - 1], F.linear(h, model.output.weight), rtol=0, atol=1e-6)


def step_metrics(mtp: dict, steps: int = 2, clip: float = 0.0) -> tuple[list, dict]:
    """Two training steps of the tiny model (two micro-batches of packed rows; the gradients clipped to `clip`, 0:
    not): each step's result and the main model's parameters after them."""
    cfg = resolve_config(
        {
            "model": {"type": "qwen3_next", "hf_config": TINY, "mtp_config": mtp},
            "data": {"seq_len": SEQ, "micro_bsz": 2},
            "hybrid_zero_optimizer": {"clip_grad_norm": clip},
        }
    )
    torch.manual_seed(0)
    parts = build_components(cfg, CTX)
    trainer = make_trainer(cfg, CTX, parts)
    results = []
    try:
        for step in range(steps):
            batches = []
            for seed in (2 * step, 2 * step + 1):
                ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
                batches.append((ids, rolled(ids, 1, POSITIONS, -100), POSITIONS))
            results.append(trainer.train_step(batches))
    finally:
        trainer.close()
    main = {n: p.detach().clone() for n, p in parts.model.named_parameters() if not n.startswith("mtp.")}
    return results, main


def test_with_lambda_0_the_steps_are_the_steps_without_mtp_bit_for_bit():
    """loss_scaling_factor=0: the MTP layer runs and logs `mtp_loss`, yet every step's loss and the main weights after
    two steps are those of MTP off bit for bit (its weights drawn after the main ones; the grad norm within 1e-6:
    below; with clipping the loss of both steps); λ > 0 moves them. Red with the MTP weights drawn before the main model's."""
    off, off_main = step_metrics({"num_layers": 0})
    zero, zero_main = step_metrics({"num_layers": 2, "share_weights": True, "loss_scaling_factor": 0.0})
    on, _ = step_metrics({"num_layers": 2, "share_weights": True, "loss_scaling_factor": 0.3})
    assert MTP in zero[0].aux_losses and MTP not in off[0].aux_losses and on[0].aux_losses[MTP] > 0
    assert [r.loss for r in zero] == [r.loss for r in off]
    # the norm's sum over tensors holds the MTP layer's zero gradients too: summed in other groups, a few ulps off;
    # so a clip by it scales by a few ulps more or less (the weights then differ in their last bits: not compared)
    assert [r.grad_norm for r in zero] == pytest.approx([r.grad_norm for r in off], rel=1e-6, abs=0)
    assert all(torch.equal(zero_main[n], p) for n, p in off_main.items())
    clipped = [
        step_metrics(mtp, clip=1.0)[0] for mtp in ({"num_layers": 0}, {"num_layers": 1, "loss_scaling_factor": 0})
    ]
    assert [r.loss for r in clipped[0]] == [r.loss for r in clipped[1]]
    assert on[0].loss == off[0].loss and on[1].loss != off[1].loss


def mtp_tensors(reference: dict[str, torch.Tensor], hidden: int, experts: int) -> dict[str, torch.Tensor]:
    """The released folders' `mtp.*` tensors, random, by the names and shapes the reference note lists: fc [D, 2D],
    three norms, and one layer shaped as the last (full-attention, sparse) block, its experts one tensor each."""
    g = torch.Generator().manual_seed(3)
    dtype = reference["model.norm.weight"].dtype
    tensors = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=g)
    names = [f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    names += ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight"]
    names += [f"mlp.shared_expert.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    names += ["mlp.shared_expert_gate.weight"]
    names += [f"mlp.experts.{e}.{n}.weight" for e in range(experts) for n in ("gate_proj", "up_proj", "down_proj")]
    last = CONFIG["num_hidden_layers"] - 1
    for name in names:
        tensors[f"mtp.layers.0.{name}"] = torch.randn(reference[f"model.layers.{last}.{name}"].shape, generator=g)
    return {name: t.to(dtype) for name, t in tensors.items()}


def folder_with_mtp(folder, kind: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A transformers folder of `kind` with the released `mtp.*` tensors added and config.json's
    mtp_num_hidden_layers=1: every tensor of it."""
    transformers_folder(folder, dtype, kind)
    tensors = load_file(folder / "model.safetensors")
    tensors.update(mtp_tensors(tensors, CONFIG["hidden_size"], CONFIG["num_experts"]))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return tensors


@pytest.mark.parametrize(("kind", "dtype"), [("qwen3_next", torch.float32), ("qwen3_5_moe_text", torch.bfloat16)])
def test_the_folders_mtp_loads_without_a_warning_and_goes_back_out_bit_for_bit(tmp_path, caplog, kind, dtype):
    """config.json's mtp_num_hidden_layers=1 and no model.mtp_config: one MTP layer, read from `mtp.*` by name (fc
    as eh_proj, the pre-fc norms as enorm / hnorm, `mtp.norm` as head_norm, the layer's experts stacked), nothing
    left out; the `--hf` export writes every tensor back under its name (experts one tensor each), bit for bit,
    config.json's mtp_num_hidden_layers 1, and transformers loads it. Red with the fc and norm renames dropped."""
    want = folder_with_mtp(tmp_path / "in", kind, dtype)
    cfg = ModelConfig(type="qwen3_next", hf_path=str(tmp_path / "in"))
    assert (cfg.mtp_config.num_layers, cfg.mtp_config.share_weights) == (1, True)
    model = build_model(cfg, torch.device("cpu"))
    assert "left out" not in caplog.text and "seed" not in caplog.text, caplog.text
    layer = model.mtp.layers[0]
    for folder_name, module in (("mtp.fc", layer.eh_proj), ("mtp.pre_fc_norm_embedding", layer.enorm),
                                ("mtp.pre_fc_norm_hidden", layer.hnorm), ("mtp.norm", layer.head_norm),
                                ("mtp.layers.0.self_attn.q_proj", layer.block.attention.wq),
                                ("mtp.layers.0.mlp.shared_expert_gate", layer.block.feed_forward.coefficient)):  # fmt: skip
        assert torch.equal(module.weight, want[f"{folder_name}.weight"].float()), folder_name
    assert torch.equal(
        layer.block.feed_forward.experts.w2[3], want["mtp.layers.0.mlp.experts.3.down_proj.weight"].float()
    )
    write_family_folder(model.state_dict(), folder_layout(cfg), qwen_build.folder_config(cfg), tmp_path / "out", dtype)
    have = load_file(tmp_path / "out" / "model.safetensors")
    assert have.keys() == want.keys()
    assert all(torch.equal(have[k], want[k]) for k in want), "tensors differ"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")).__name__ == KINDS[kind][0]


def test_without_mtp_the_folders_mtp_is_left_out_in_one_line(tmp_path, caplog):
    """model.mtp_config=dict(num_layers=0): the rest loads as from the folder without `mtp.*`, which is said in one
    line; the export leaves them out and states mtp_num_hidden_layers 0."""
    transformers_folder(tmp_path / "plain")
    plain = build_model(ModelConfig(type="qwen3_next", hf_path=str(tmp_path / "plain")), torch.device("cpu"))
    folder_with_mtp(tmp_path / "q", "qwen3_next", torch.float32)
    cfg = ModelConfig(type="qwen3_next", hf_path=str(tmp_path / "q"), mtp_config={"num_layers": 0})
    model = build_model(cfg, torch.device("cpu"))
    assert model.mtp is None
    want = plain.state_dict()
    assert (
        all(torch.equal(t, want[k]) for k, t in model.state_dict().items()) and model.state_dict().keys() == want.keys()
    )
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(lines) == 1 and "tensors of blocks from 4 on" in lines[0], lines
    write_family_folder(
        model.state_dict(), folder_layout(cfg), qwen_build.folder_config(cfg), tmp_path / "out", torch.float32
    )
    assert not [n for n in load_file(tmp_path / "out" / "model.safetensors") if n.startswith("mtp.")]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mtp_num_hidden_layers"] == 0


@pytest.mark.parametrize("depths", [1, 0])
def test_a_read_a_piece_at_a_time_is_the_whole_read(tmp_path, caplog, depths):
    """The sharded loader's read (`folder_pieces`: a tensor, or one stacked tensor's experts, at a time) gives the
    whole read's tensors bit for bit, the MTP layer's stacked experts among them; without MTP the `mtp.*` tensors are
    left out in one line after the pieces. Red with the line said before the pieces (from the folder's raw names,
    which hold no block past the stack)."""
    folder_with_mtp(tmp_path / "q", "qwen3_next", torch.float32)
    cfg = ModelConfig(type="qwen3_next", hf_path=str(tmp_path / "q"), mtp_config={"num_layers": depths})
    layout = folder_layout(cfg)
    whole = read_folder(tmp_path / "q", layout)
    caplog.clear()
    pieces = {}
    for piece in folder_pieces(tmp_path / "q", layout):
        pieces.update(piece)
    assert pieces.keys() == whole.keys() and all(torch.equal(pieces[k], whole[k]) for k in whole)
    assert ("mtp.layers.0.block.feed_forward.experts.w1" in pieces) == bool(depths)
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(lines) == (0 if depths else 1), lines


@pytest.mark.parametrize(("size", "chunks", "v_shape"), [(2, 1, False), (2, 2, True)])
def test_the_pipelines_last_stage_runs_the_depths_as_one_process(size, chunks, v_shape):
    """Two depths of one shared layer over pipeline stages (1F1B at P = 2, ZBV's V), packed rows: the loss sums and
    every parameter's gradient are one process's bit for bit (the embedding's share of the depths through the
    stages)."""
    mtp = {"num_layers": 2, "share_weights": True}
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    depth_labels = mtp_labels(labels, POSITIONS, 2)
    whole = seeded(hf_config=TINY, mtp_config=mtp)
    out = whole(ids, POSITIONS)
    want_mtp = sum(token_loss_sum(d, t) * w for d, t, w in zip(out.mtp_logits, depth_labels, MTP_WEIGHTS, strict=True))
    want_loss = token_loss_sum(out.logits, labels)
    (want_loss / 32 + want_mtp).backward()
    model = seeded(hf_config=TINY, mtp_config=mtp)
    stages = stages_of(model, size, chunks, v_shape, {})
    runner = run_stages_with_mtp(stages, ids, POSITIONS, torch.stack([labels, *depth_labels], 1))
    assert torch.equal(runner._sums[0], want_loss) and torch.equal(runner._mtp_sums[0], want_mtp)
    want = dict(whole.named_parameters())
    assert all(torch.equal(p.grad, want[n].grad) for n, p in model.named_parameters())


def test_the_tensor_plan_places_the_mtp_layer_as_block_l():
    """The MTP layer is a side block planned as a full-attention block (wq column, wo row), its norms and fc beside."""
    plan = seeded(hf_config=TINY, mtp_config={"num_layers": 1}).tensor_plan()
    (side,) = plan.side_blocks
    assert side.block == "mtp.layers.0.block" and side.projections == ("mtp.layers.0.eh_proj",)
    assert side.norms == ("mtp.layers.0.enorm", "mtp.layers.0.hnorm", "mtp.layers.0.head_norm")
    assert (
        side.plan.attention.column == ("attention.wq",)
        and side.plan.sparse
        and side.plan.kv == ("attention.wk", "attention.wv")
    )


def test_unset_the_section_follows_mtp_num_hidden_layers():
    """As the DeepSeek-V3 family's: config.json's count (none where it has no such key: transformers' classes have
    none), one shared layer, λ 0.1."""
    section = ModelConfig(type="qwen3_next", hf_config={**TINY, "mtp_num_hidden_layers": 2}).mtp_config
    assert (section.num_layers, section.share_weights, section.loss_scaling_factor) == (2, True, 0.1)
    assert ModelConfig(type="qwen3_next", hf_config=TINY).mtp_config.num_layers == 0


def run_config(mtp: dict, hf: dict | None = None, **parallel: object):
    model = {"type": "qwen3_next", "hf_config": hf or TINY, "mtp_config": mtp}
    return resolve_config({"model": model, "parallel": parallel}, world_size=2 if parallel else 1)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (lambda: run_config({"num_layers": 2}), "model.mtp_config.num_layers=2 with share_weights=False: 2 MTP layers"),
        (
            lambda: run_config(
                {"num_layers": 1, "detach_mtp_lm_head_weight": True},
                mode="fsdp2",
                tensor={"size": 2, "mode": "msp"},
                expert={"no_tp": True},
            ),
            "detach_mtp_lm_head_weight=True with parallel.tensor.mode='msp'",
        ),
    ],
    ids=["two-physical-layers", "detached-head-under-msp"],
)
def test_what_is_not_built_is_refused_in_one_line(cfg, message):
    with pytest.raises(ConfigError) as error:
        qwen_build.check_run(cfg())
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_dedicated_mtp_embeddings_are_refused_in_one_line():
    cfg = ModelConfig(
        type="qwen3_next", hf_config={**TINY, "mtp_use_dedicated_embeddings": True}, mtp_config={"num_layers": 1}
    )
    with pytest.raises(ConfigError, match="mtp_use_dedicated_embeddings=True: MTP reads the shared embedding"):
        build_model(cfg, torch.device("meta"))

"""weights/: foreign layouts built by hand from their documented rules load into the native model bitwise.

The fixtures here do not use the code under test: InternEvo's fused wqkv, its tensor/weight/pipeline/FSDP
file layouts and Meta's RoPE row order are written out with explicit loops and index lists.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from internlm_offload.builder import build_model
from internlm_offload.config import resolve_config
from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.internlm2.hf_names import HF_INTERNLM2, HF_LLAMA
from internlm_offload.weights.convert import Heads, to_format, to_native
from internlm_offload.weights.names import INTERNEVO, META_LLAMA
from internlm_offload.weights.qkv import fuse_wqkv, split_wqkv
from internlm_offload.weights.shards import merge_pieces
from internlm_offload.weights.sources import foreign_source, read_native_weights

REPO = Path(__file__).resolve().parents[2]
LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 4, 64, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS


def run_config(path: Path | None = None, ckpt_type: str = "internevo", content=("model",), **model):
    raw = {
        "model": {**dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                         num_kv_attention_heads=KV_HEADS, vocab_size=VOCAB, attn_impl="sdpa"), **model},
    }  # fmt: skip
    if path is not None:
        raw["ckpt"] = {"load_ckpt_info": {"path": str(path), "ckpt_type": ckpt_type, "content": content}}
    return resolve_config(raw)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """A native model's weights, random, by parameter name."""
    torch.manual_seed(3)
    model = build_model(run_config().model, torch.device("cpu"))
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def load(path: Path, ckpt_type: str = "internevo", **model) -> dict[str, torch.Tensor]:
    cfg = run_config(path, ckpt_type, **model)
    source = foreign_source(cfg.ckpt.load_ckpt_info, cfg.model)
    shapes = {name: t.shape for name, t in build_model(cfg.model, torch.device("meta")).state_dict().items()}
    return read_native_weights(source, cfg.model, shapes)


def assert_bitwise(loaded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name


# ----------------------------------------------------------------------------- InternEvo's layout, by hand


def internevo_wqkv(reference: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """InternEvo's `(h gs d)` rows: per kv head g, its query heads g*q_per_kv .. , then k head g, then v head g."""
    wq, wk, wv = (reference[f"layers.{layer}.attention.w{p}.weight"] for p in "qkv")
    q_per_kv, rows = HEADS // KV_HEADS, []
    for g in range(KV_HEADS):
        for j in range(q_per_kv):
            head = g * q_per_kv + j
            rows.append(wq[head * HEAD_DIM : (head + 1) * HEAD_DIM])
        rows += [wk[g * HEAD_DIM : (g + 1) * HEAD_DIM], wv[g * HEAD_DIM : (g + 1) * HEAD_DIM]]
    return torch.cat(rows)


def internevo_state(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in reference.items():
        if ".attention.w" in name and name.split(".")[3] in ("wq", "wk", "wv"):
            layer = int(name.split(".")[1])
            state[f"layers.{layer}.attention.wqkv.weight"] = internevo_wqkv(reference, layer)
        else:
            state[name] = tensor
    return state


# InternEvo's splits (mtp: column-parallel rows, row-parallel columns; isp: rows everywhere); norms replicated.
MTP_DIMS = {"wqkv": 0, "wo": 1, "w1": 0, "w3": 0, "w2": 1, "tok_embeddings": 1, "output": 0}
ISP_DIMS = {**{key: 0 for key in MTP_DIMS}, "tok_embeddings": 1}


def split_for(state: dict[str, torch.Tensor], ranks: int, dims: dict[str, int]) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(ranks)]
    for name, tensor in state.items():
        key = name.split(".")[-2]
        pieces = torch.chunk(tensor, ranks, dims[key]) if key in dims else [tensor] * ranks
        for rank in range(ranks):
            out[rank][name] = pieces[rank].clone()
    return out


@pytest.mark.parametrize(
    "layout",
    ["tp1", "tp2", "tp2_vocab_parallel_embedding", "isp_wp2", "isp_tp2_wp2", "pp2", "fsdp_dp2", "tp2_pp2"],
)
def test_internevo_layouts_load_bitwise(tmp_path, reference, layout):
    state = internevo_state(reference)
    folder = tmp_path / "internevo"
    folder.mkdir()
    tp = 2 if layout.startswith("tp2") else 1
    dims = {**MTP_DIMS, "tok_embeddings": 0} if "vocab_parallel" in layout else MTP_DIMS
    if layout.startswith("isp"):
        for w, piece in enumerate(split_for(state, 2, ISP_DIMS)):
            if layout == "isp_tp2_wp2":
                for t in range(2):
                    torch.save(piece, folder / f"model_tp{t}_wp{w}_pp0.pt")
            else:
                torch.save(piece, folder / f"model_wp{w}_pp0.pt")
    elif layout == "fsdp_dp2":
        for d in range(2):
            torch.save(
                {n: torch.chunk(t, 2, 0)[d].clone() for n, t in state.items()}, folder / f"model_tp0_pp0_dp{d}.pt"
            )
    else:
        stages = 2 if layout.endswith("pp2") else 1
        per_stage = LAYERS // stages
        for p in range(stages):
            blocks = range(p * per_stage, (p + 1) * per_stage)
            stage = {}
            for name, tensor in state.items():
                if name.startswith("layers."):
                    block = int(name.split(".")[1])
                    if block in blocks:  # each stage numbers its blocks from 0
                        stage[name.replace(f"layers.{block}.", f"layers.{block - blocks[0]}.", 1)] = tensor
                elif (name == "tok_embeddings.weight") == (p == 0) or (
                    name != "tok_embeddings.weight" and p == stages - 1
                ):
                    stage[name] = tensor
            for t, piece in enumerate(split_for(stage, tp, dims)):
                torch.save(piece, folder / f"model_tp{t}_pp{p}.pt")
    assert_bitwise(load(folder), reference)


def test_internevo_files_with_q_k_v_apart_load_bitwise(tmp_path, reference):
    """InternEvo's InternLM2 with `enable_qkv_fusion=False` (InternLM3's configs) saves the native names."""
    for t, piece in enumerate(split_for(reference, 2, {**MTP_DIMS, "wq": 0, "wk": 0, "wv": 0})):
        torch.save(piece, tmp_path / f"model_tp{t}_pp0.pt")
    assert_bitwise(load(tmp_path), reference)


def test_internlm_v1_files_load_bitwise_with_their_biases(tmp_path):
    """InternLM v1 (`blocks.{i}.mixer.Wqkv` with bias, `out_proj`, `norm1/2`, `embedding`, `head`), tp=2 and
    two pipeline stages: each tensor rank's Wqkv holds its own q rows, then k, then v."""
    torch.manual_seed(5)
    model = build_model(run_config(attention_bias=True, num_kv_attention_heads=HEADS).model, torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()  # zero at init: make the biases count
    reference = {name: t.detach().clone() for name, t in model.state_dict().items()}
    v1_names = {"attention_norm": "norm1", "ffn_norm": "norm2"}
    ranks = [[{}, {}], [{}, {}]]  # [stage][tp rank]
    for name, tensor in reference.items():
        parts = name.split(".")
        if name == "tok_embeddings.weight":
            pieces, stage, v1 = torch.chunk(tensor, 2, 1), 0, "embedding.weight"
        elif name == "output.weight":
            pieces, stage, v1 = torch.chunk(tensor, 2, 0), 1, "head.weight"
        elif name == "norm.weight":
            pieces, stage, v1 = [tensor] * 2, 1, name
        else:
            block, module = int(parts[1]), parts[2]
            stage, local = block // 2, f"blocks.{block % 2}"
            if module in v1_names:
                pieces, v1 = [tensor] * 2, f"{local}.{v1_names[module]}.weight"
            elif module == "feed_forward":
                pieces, v1 = torch.chunk(tensor, 2, 1 if parts[3] == "w2" else 0), f"{local}.mlp.{parts[3]}.weight"
            elif parts[3] == "wo":
                pieces = torch.chunk(tensor, 2, 1) if parts[4] == "weight" else [tensor] * 2  # row-parallel bias: whole
                v1 = f"{local}.mixer.out_proj.{parts[4]}"
            else:
                continue  # wq, wk, wv: fused below
        for rank in range(2):
            ranks[stage][rank][v1] = pieces[rank].clone()
    for block in range(LAYERS):
        for kind in ("weight", "bias"):
            q, k, v = (torch.chunk(reference[f"layers.{block}.attention.w{p}.{kind}"], 2, 0) for p in "qkv")
            for rank in range(2):
                fused = torch.cat([q[rank], k[rank], v[rank]])
                ranks[block // 2][rank][f"blocks.{block % 2}.mixer.Wqkv.{kind}"] = fused
    for stage in range(2):
        for rank in range(2):
            torch.save(ranks[stage][rank], tmp_path / f"model_tp{rank}_pp{stage}.pt")
    assert_bitwise(load(tmp_path, attention_bias=True, num_kv_attention_heads=HEADS), reference)
    with pytest.raises(CheckpointError, match=r"'blocks.0.mixer.out_proj.bias' .* model.attention_bias=True"):
        load(tmp_path, num_kv_attention_heads=HEADS)


def test_fused_wqkv_is_internevos_grouping(reference):
    wq, wk, wv = (reference[f"layers.1.attention.w{p}.weight"] for p in "qkv")
    fused = fuse_wqkv(wq, wk, wv, KV_HEADS)
    assert torch.equal(fused, internevo_wqkv(reference, 1))
    assert all(torch.equal(a, b) for a, b in zip(split_wqkv(fused, HEADS, KV_HEADS), (wq, wk, wv)))


def test_every_format_round_trips_bitwise(reference):
    heads = Heads(HEADS, KV_HEADS)
    for table in (INTERNEVO, HF_INTERNLM2, HF_LLAMA, META_LLAMA):
        assert_bitwise(to_native(to_format(reference, table, heads), table, heads, "x"), reference)


def test_meta_rows_rotate_as_metas_interleaved_rope():
    """Meta's query rows under Meta's RoPE (complex pairs x_2j + i x_2j+1) give, per head, the same values as
    the converted rows under the native rotate-half RoPE (pairs x_j, x_j+d/2), in the halves' order."""
    torch.manual_seed(0)
    T, base = 7, 10000.0
    model = build_model(run_config(rope_base=base).model, torch.device("cpu"))
    wq_meta, x = torch.randn(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64), torch.randn(T, HIDDEN, dtype=torch.float64)
    theta = base ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * theta  # (T, D/2)
    q = torch.view_as_complex((x @ wq_meta.T).view(T, HEADS, HEAD_DIM // 2, 2).contiguous())
    rotated = torch.view_as_real(q * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(-2)
    (native,) = to_native({"layers.0.attention.wq.weight": wq_meta}, META_LLAMA, Heads(HEADS, KV_HEADS), "x").values()
    cos, sin = model.rope_cos_sin(T, torch.float64)
    from internlm_offload.model.rope import apply_rope

    ours = apply_rope((x @ native.T).view(1, T, HEADS, HEAD_DIM), cos, sin)[0]
    halves = rotated.view(T, HEADS, HEAD_DIM // 2, 2).transpose(-1, -2).reshape(T, HEADS, HEAD_DIM)
    torch.testing.assert_close(ours, halves, rtol=0, atol=1e-5)  # the native angles are computed in fp32


def test_meta_consolidated_shards_load_bitwise(tmp_path, reference):
    """Two model-parallel files of Meta's reference layout (rows interleaved per head, by an index list)."""
    interleave = [j // 2 + (j % 2) * HEAD_DIM // 2 for j in range(HEAD_DIM)]  # Meta row j <- native row
    state = {}
    for name, tensor in reference.items():
        kind = name.split(".")[-2]
        if kind in ("wq", "wk"):
            heads = HEADS if kind == "wq" else KV_HEADS
            tensor = tensor.view(heads, HEAD_DIM, HIDDEN)[:, interleave].reshape(-1, HIDDEN)
        state[name] = tensor
    dims = {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w1": 0, "w3": 0, "w2": 1, "tok_embeddings": 1, "output": 0}
    for rank, piece in enumerate(split_for(state, 2, dims)):
        torch.save({**piece, "rope.freqs": torch.zeros(4)}, tmp_path / f"consolidated.{rank:02d}.pth")
    params = dict(dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB, norm_eps=1e-6)
    (tmp_path / "params.json").write_text(json.dumps(params))
    assert_bitwise(load(tmp_path, "llama"), reference)


def test_merge_reads_the_split_off_the_shapes():
    full = torch.arange(24.0).view(4, 6)
    assert torch.equal(merge_pieces(list(torch.chunk(full, 2, 0)), full.shape, "x"), full)
    assert torch.equal(merge_pieces(list(torch.chunk(full, 3, 1)), full.shape, "x"), full)
    assert merge_pieces([full, full.clone()], full.shape, "x") is full
    with pytest.raises(CheckpointError, match=r"x: 2 piece\(s\) of shape \(4, 2\) do not make the model's \(4, 6\)"):
        merge_pieces([full[:, :2], full[:, :2]], full.shape, "x")


# ----------------------------------------------------------------------------- bad folders: one line each


def internevo_tp2(folder: Path, reference) -> list[dict[str, torch.Tensor]]:
    folder.mkdir()
    pieces = split_for(internevo_state(reference), 2, MTP_DIMS)
    for t, piece in enumerate(pieces):
        torch.save(piece, folder / f"model_tp{t}_pp0.pt")
    return pieces


class _TouchFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.mark.parametrize("case", ["missing_rank", "shapes", "unknown_name", "missing_name", "code", "resume"])
def test_a_bad_internevo_folder_is_one_line_naming_file_and_key(tmp_path, reference, case):
    folder = tmp_path / "ckpt"
    pieces = internevo_tp2(folder, reference)
    expected = {
        "missing_rank": "model_tp1_pp0.pt is missing",
        "shapes": "stage 0: layers.2.attention.wo.weight: 2 piece(s) of shape [(64, 32), (64, 31)] do not make",
        "unknown_name": "model_tp0_pp0.pt: 'layers.0.attention.rotary.weight' is not an InternEvo weight of this model",
        "missing_name": "no 'norm.weight' in any model file",
        "code": "model_tp1_pp0.pt would load posix.system; model files may hold only tensors",
        "resume": 'they start a run with content=("model",)',
    }[case]
    content = ("all",) if case == "resume" else ("model",)
    if case == "missing_rank":
        torch.save(pieces[1], folder / "model_tp2_pp0.pt")
        (folder / "model_tp1_pp0.pt").unlink()
    elif case == "shapes":
        pieces[1]["layers.2.attention.wo.weight"] = pieces[1]["layers.2.attention.wo.weight"][:, :31]
        torch.save(pieces[1], folder / "model_tp1_pp0.pt")
    elif case in ("unknown_name", "missing_name"):
        for t, piece in enumerate(pieces):
            if case == "unknown_name":
                piece["layers.0.attention.rotary.weight"] = torch.zeros(2)
            else:
                del piece["norm.weight"]
            torch.save(piece, folder / f"model_tp{t}_pp0.pt")
    elif case == "code":
        torch.save({**pieces[1], "hook": _TouchFile(tmp_path / "PWNED")}, folder / "model_tp1_pp0.pt")
    with pytest.raises(CheckpointError) as err:
        cfg = run_config(folder, content=content)
        source = foreign_source(cfg.ckpt.load_ckpt_info, cfg.model)
        read_native_weights(source, cfg.model, {n: t.shape for n, t in reference.items()})
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "PWNED").exists()


def test_an_hf_folder_of_another_model_says_which_keys_to_set(tmp_path):
    config = dict(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, intermediate_size=192, vocab_size=VOCAB, rms_norm_eps=1e-5)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load(tmp_path, "hf_llama")
    message = str(err.value)
    assert "config.json: num_hidden_layers=2 (set model.num_layers to match; it gives 4)" in message
    assert "rms_norm_eps=1e-05 (set model.norm_eps to match; it gives 1e-06)" in message and "\n" not in message
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    with pytest.raises(
        CheckpointError, match="model_type=.qwen2.; the native model loads internlm2, llama, internlm, qwen3_moe"
    ):
        load(tmp_path, "hf")
    with pytest.raises(CheckpointError, match='no params.json .* \\(a Hugging Face folder: ckpt_type="hf_llama"\\)'):
        load(tmp_path, "llama")


def test_a_biased_export_splits_wqkv_bias_with_its_rows_and_keeps_wo_bias_whole(tmp_path):
    from internlm_offload.weights.internevo_files import write_internevo_files

    torch.manual_seed(9)
    model = build_model(run_config(attention_bias=True).model, torch.device("cpu"))
    native = {name: t.detach().normal_() for name, t in model.state_dict().items()}
    fused = to_format(native, INTERNEVO, Heads(HEADS, KV_HEADS))
    write_internevo_files(fused, tmp_path, tp=2)
    rank0 = torch.load(tmp_path / "model_tp0_pp0.pt", weights_only=True)
    assert torch.equal(rank0["layers.0.attention.wqkv.bias"], fused["layers.0.attention.wqkv.bias"].chunk(2)[0])
    assert torch.equal(rank0["layers.0.attention.wo.bias"], fused["layers.0.attention.wo.bias"])
    assert_bitwise(load(tmp_path, attention_bias=True), native)


# ----------------------------------------------------------------------------- malformed foreign files: one line each


def write_hf_folder(folder: Path, reference: dict[str, torch.Tensor]) -> None:
    """A Hugging Face Llama folder of `reference`: config.json and one model.safetensors."""
    from safetensors.torch import save_file

    from internlm_offload.model.families.internlm2.hf_export import llama_values

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **llama_values(run_config().model)}))
    save_file(to_format(reference, HF_LLAMA, Heads(HEADS, KV_HEADS)), str(folder / "model.safetensors"))


def write_meta_folder(folder: Path, reference: dict[str, torch.Tensor]) -> None:
    """A Meta Llama folder of `reference`: params.json and one consolidated.00.pth."""
    model = run_config().model
    folder.mkdir()
    params = {"dim": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": KV_HEADS,
              "norm_eps": model.norm_eps, "rope_theta": model.rope_base}  # fmt: skip
    (folder / "params.json").write_text(json.dumps(params))
    torch.save(to_format(reference, META_LLAMA, Heads(HEADS, KV_HEADS)), folder / "consolidated.00.pth")


def write_index(folder: Path, weight_map: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize(
    "case",
    ["params_json_list", "config_json_string", "plain_text_pt", "fsdp_shards_apart", "index_int", "index_outside"],
)
def test_a_malformed_foreign_file_is_one_line_naming_file_and_key(tmp_path, reference, case):
    folder = tmp_path / "ckpt"
    ckpt_type = {"params_json_list": "llama", "config_json_string": "hf_llama", "index_int": "hf_llama"}.get(case)
    if case == "params_json_list":
        write_meta_folder(folder, reference)
        (folder / "params.json").write_text("[4096, 32]")
        expected = "params.json: holds a JSON list; it must be an object"
    elif case == "config_json_string":
        write_hf_folder(folder, reference)
        (folder / "config.json").write_text('"llama"')
        expected = "config.json: holds a JSON str; it must be an object"
    elif case == "plain_text_pt":
        internevo_tp2(folder, reference)
        (folder / "model_tp1_pp0.pt").write_text("hello, not a torch file\n")
        expected = "model_tp1_pp0.pt: not a torch file (neither torch.save's zip archive nor a pickle)"
    elif case == "fsdp_shards_apart":
        folder.mkdir()
        for d in range(2):
            shard = {n: torch.chunk(t, 2, 0)[d].clone() for n, t in internevo_state(reference).items()}
            if d == 1:
                del shard["norm.weight"]
            torch.save(shard, folder / f"model_tp0_pp0_dp{d}.pt")
        expected = "model_tp0_pp0_dp0.pt: 'norm.weight' is in this FSDP shard and not in every other shard"
    elif case == "index_int":
        write_hf_folder(folder, reference)
        write_index(folder, {"model.norm.weight": 1})
        expected = "model.safetensors.index.json: weight_map['model.norm.weight'] = 1; each value must be a file"
    else:  # an index naming a file beside the folder, which would be read from outside it
        write_hf_folder(folder, reference)
        (folder / "model.safetensors").rename(tmp_path / "beside.safetensors")
        write_index(folder, {"model.norm.weight": "../beside.safetensors"})
        ckpt_type = "hf_llama"
        expected = "weight_map['model.norm.weight'] = '../beside.safetensors' points outside"
    with pytest.raises(CheckpointError) as err:
        load(folder, ckpt_type or "internevo")
    message = str(err.value)
    assert expected in message and "\n" not in message, message


def test_an_index_may_name_files_that_link_out_of_the_folder(tmp_path, reference):
    """The Hugging Face cache's snapshot folders hold links into its blobs folder: the names are checked, not
    where the links lead."""
    folder = tmp_path / "snapshot"
    write_hf_folder(folder, reference)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (folder / "model.safetensors").rename(blobs / "5f3a")
    (folder / "model-00001-of-00001.safetensors").symlink_to(blobs / "5f3a")
    write_index(folder, {"model.norm.weight": "model-00001-of-00001.safetensors"})
    assert_bitwise(load(folder, "hf_llama"), reference)


def test_an_internevo_folder_is_listed_once_and_each_file_read_once(tmp_path, reference, monkeypatch):
    """foreign_source and read_native_weights together: one listing of the folder, one torch.load per file."""
    folder = tmp_path / "internevo"
    folder.mkdir()
    for p, stage in enumerate(({"layers.0.": "layers.0.", "layers.1.": "layers.1.", "tok_embeddings": ""},
                               {"layers.2.": "layers.0.", "layers.3.": "layers.1.", "norm": "", "output": ""})):  # fmt: skip
        state = {}
        for name, tensor in internevo_state(reference).items():
            prefix = next((key for key in stage if name.startswith(key)), None)
            if prefix is not None:
                state[name.replace(prefix, stage[prefix], 1) if stage[prefix] else name] = tensor
        for t, piece in enumerate(split_for(state, 2, MTP_DIMS)):
            torch.save(piece, folder / f"model_tp{t}_pp{p}.pt")
    listings, reads = [], []
    iterdir, glob, torch_load = Path.iterdir, Path.glob, torch.load
    monkeypatch.setattr(Path, "iterdir", lambda self: listings.append(self) or iterdir(self))
    monkeypatch.setattr(Path, "glob", lambda self, *a, **k: listings.append(self) or glob(self, *a, **k))
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: reads.append(Path(f).name) or torch_load(f, *a, **k))
    assert_bitwise(load(folder), reference)
    assert listings == [folder]
    assert sorted(reads) == ["model_tp0_pp0.pt", "model_tp0_pp1.pt", "model_tp1_pp0.pt", "model_tp1_pp1.pt"]


# ----------------------------------------------------------------------------- two processes: rank 0 reads, the rest receive

BROADCAST_SCRIPT = r"""
import json
import os
import sys
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from internlm_offload.builder import build_model
from internlm_offload.errors import CheckpointError
from internlm_offload.weights.sources import foreign_source, load_weights

sys.path.insert(0, os.environ["TEST_DIR"])
from test_weights import run_config

dist.init_process_group("gloo")
rank = dist.get_rank()
folders, reference = json.loads(sys.argv[1]), torch.load(sys.argv[2], weights_only=True)
WEIGHT_SUFFIXES = (".pt", ".pth", ".safetensors", ".bin")
opened = []  # every weight file this rank opens: Python's open() (torch.load) and safetensors' safe_open


def audit(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].endswith(WEIGHT_SUFFIXES):
        opened.append(Path(args[0]).name)


sys.addaudithook(audit)
safe_open = safetensors.torch.safe_open
safetensors.torch.safe_open = lambda f, *a, **k: opened.append(Path(f).name) or safe_open(f, *a, **k)

report = {}
for (ckpt_type, folder), wrap in [(item, wrap) for item in folders for wrap in ("plain", "fsdp2")]:
    cfg = run_config(Path(folder), ckpt_type)
    torch.manual_seed(100 + rank)  # other weights than the files', and other on each rank
    model = build_model(cfg.model, torch.device("cpu"))
    if wrap == "fsdp2":
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opened.clear()
    try:
        load_weights(model, foreign_source(cfg.ckpt.load_ckpt_info, cfg.model), cfg.model)
    except CheckpointError as exc:
        report[f"{Path(folder).name}/{wrap}"] = {"error": str(exc), "opened": sorted(set(opened))}
        continue
    for name, param in model.state_dict().items():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        assert torch.equal(full, reference[name]), (folder, wrap, name)
    report[f"{Path(folder).name}/{wrap}"] = {"opened": sorted(set(opened))}
import internlm_offload

# one file per rank: two ranks' lines on one stdout pipe can interleave
report = {"package": internlm_offload.__file__, "folders": report}
(Path(sys.argv[2]).parent / f"report_{rank}.json").write_text(json.dumps(report))
from internlm_offload.engine.runtime import shutdown_runtime

shutdown_runtime()
"""


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_two_ranks_load_foreign_weights_read_by_rank_0_alone(tmp_path, reference):
    """InternEvo, Hugging Face and Meta folders into a plain and an FSDP2 model on 2 gloo ranks: every rank ends
    with the files' weights bitwise, rank 1 opens no weight file, and rank 0's read failure is rank 1's too."""
    internevo_tp2(tmp_path / "internevo", reference)
    write_hf_folder(tmp_path / "hf", reference)
    write_meta_folder(tmp_path / "meta", reference)
    for t, piece in enumerate(internevo_tp2(tmp_path / "broken", reference)):
        del piece["norm.weight"]  # found missing only once the files are read
        torch.save(piece, tmp_path / "broken" / f"model_tp{t}_pp0.pt")
    kinds = {"internevo": "internevo", "hf": "hf_llama", "meta": "llama", "broken": "internevo"}
    folders = [(ckpt_type, str(tmp_path / name)) for name, ckpt_type in kinds.items()]
    torch.save(reference, tmp_path / "reference.pt")
    script = tmp_path / "broadcast.py"
    script.write_text(BROADCAST_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # this checkout's package
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path,
           "TEST_DIR": str(Path(__file__).parent)}  # fmt: skip
    from runner import run_python  # here: the ranks' script imports this module, without the test path

    proc = run_python([*cmd, json.dumps(folders), str(tmp_path / "reference.pt")], env=env, timeout=280,
                      expect_success=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    reports = {}
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report_{rank}.json").read_text())
        assert report["package"] == str(REPO / "internlm_offload" / "__init__.py"), report["package"]  # this code
        reports[rank] = report["folders"]
    files = {"internevo": ["model_tp0_pp0.pt", "model_tp1_pp0.pt"], "hf": ["model.safetensors"],
             "meta": ["consolidated.00.pth"], "broken": ["model_tp0_pp0.pt", "model_tp1_pp0.pt"]}  # fmt: skip
    for wrap in ("plain", "fsdp2"):
        for folder, names in files.items():
            assert reports[0][f"{folder}/{wrap}"]["opened"] == names, (folder, wrap, reports[0])
            assert reports[1][f"{folder}/{wrap}"]["opened"] == [], (folder, wrap, reports[1])
        errors = [reports[rank][f"broken/{wrap}"].get("error") for rank in (0, 1)]
        assert errors[0] == errors[1] and "no 'norm.weight' in any model file" in errors[0], errors

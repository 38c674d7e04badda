"""The DeepSeek-V3 block benchmark runs end to end at tiny sizes: transformers' dense and sparse blocks and the native
ones on the same weights, in agreement, profiled, JSON and PNG written (no timing assertions: the machine is shared)."""

import json
from pathlib import Path

import pytest
import torch

from internlm_offload.bench import mla as bench


def test_quick_run_writes_json_and_png(tmp_path: Path, capsys) -> None:
    out = tmp_path / "res" / "mla.json"
    returned = bench.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned))
    records = {rec["name"]: rec for rec in data["results"]}
    assert list(records) == ["transformers_dense", "native_dense", "transformers_sparse", "native_sparse"]
    for name, rec in records.items():
        assert len(rec["wall_s"]) == len(rec["cpu_s"]) == bench.QUICK["repeats"] and rec["cpu_s_median"] > 0
        if name.startswith("transformers"):
            assert rec["ratio_cpu"] == 1.0 == rec["ratio_wall"]
    # same weights, same tokens: the blocks compute the same thing (fp32)
    assert set(data["relative_error"]) == {"dense", "sparse"}
    for errors in data["relative_error"].values():
        assert set(errors) == {"output", "input_grad", "param_grads"} and max(errors.values()) < 1e-5, errors
    for prof in data["profiles"].values():
        assert 0 < prof["matmul_share"] < 1 and prof["steps"] == bench.QUICK["profile_steps"]
    assert data["env"]["shape"] == {k: bench.QUICK[k] for k in bench.SHAPE_KEYS}
    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "native_dense" in capsys.readouterr().out


def test_the_native_block_holds_transformers_weights_by_the_family_names() -> None:
    """Every native parameter and the router bias come from transformers' tensor of the name the family's table maps
    (the experts' gate and up halves of its stacked gate_up_proj)."""
    args = bench.parse_args(["--quick"])
    config = bench.hf_config(args)
    hf = bench.hf_layer(config, 1, torch.float32)
    native = bench.native_layer(config, hf, 1, torch.float32)
    ours, theirs = native.state_dict(), hf.state_dict()
    assert ours["attention.kv_b_proj.weight"].equal(theirs["self_attn.kv_b_proj.weight"])
    assert ours["feed_forward.router.e_score_correction_bias"].equal(theirs["mlp.gate.e_score_correction_bias"])
    I = args.moe_intermediate
    assert ours["feed_forward.experts.w3"].equal(theirs["mlp.experts.gate_up_proj"][:, I:])
    assert len(ours) == len(theirs) + 1  # the stacked gate_up_proj is two tensors here


def test_a_disagreeing_block_stops_the_run(tmp_path: Path, monkeypatch) -> None:
    """Timing blocks that compute different things would measure nothing: a weight read under the wrong name stops
    the run before any timing."""
    native_names = bench.native_names

    def swapped(tensors, index):
        out = native_names(tensors, index)
        out["attention.o_proj.weight"] = out["attention.o_proj.weight"] * 1.001
        return out

    monkeypatch.setattr(bench, "native_names", swapped)
    with pytest.raises(SystemExit, match="disagrees with transformers"):
        bench.main(["--quick", "--blocks", "dense", "--out", str(tmp_path / "mla.json")])

"""The Gated DeltaNet bench runs end to end at tiny sizes: transformers' Qwen3-Next layer and the native one at two
lengths on the same weights, in agreement, JSON and PNG written (no timing assertions: the machine is shared)."""

import json
from pathlib import Path

import pytest

from internlm_offload.bench import gated_deltanet as bench


def test_quick_run_writes_json_and_png(tmp_path: Path, capsys) -> None:
    out = tmp_path / "res" / "gdn.json"
    returned = bench.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned))
    records = {rec["name"]: rec for rec in data["results"]}
    assert list(records) == ["transformers_70", "native_70", "transformers_130", "native_130"]
    for name, rec in records.items():
        assert len(rec["wall_s"]) == len(rec["cpu_s"]) == bench.QUICK["repeats"] and rec["cpu_s_median"] > 0
        if name.startswith("transformers"):
            assert rec["ratio_cpu"] == 1.0 == rec["ratio_wall"]
    # same weights, same tokens: the layers compute the same thing (fp32, two and three chunks)
    assert set(data["relative_error"]) == {"70", "130"}
    for errors in data["relative_error"].values():
        assert set(errors) == {"output", "input_grad", "param_grads"} and max(errors.values()) < 1e-4, errors
    assert data["env"]["shape"] == {k: bench.QUICK[k] for k in bench.SHAPE_KEYS}
    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "native_130" in capsys.readouterr().out


def test_the_native_layer_holds_transformers_weights() -> None:
    """Every native parameter is transformers' tensor of the same name (the conv's under `conv_weight`)."""
    args = bench.parse_args(["--quick"])
    hf = bench.hf_layer(args, bench.DTYPES["float32"])
    native = bench.native_layer(args, hf, bench.DTYPES["float32"])
    ours, theirs = native.state_dict(), hf.state_dict()
    assert len(ours) == len(theirs) and ours["conv_weight"].equal(theirs["conv1d.weight"])
    assert all(ours[bench.RENAMES.get(k, k)].equal(t) for k, t in theirs.items())
    assert not theirs["norm.weight"].eq(1).all()  # the gated norm's weight off its init, so a swap would show


def test_a_disagreeing_layer_stops_the_run(tmp_path: Path, monkeypatch) -> None:
    """Timing layers that compute different things would measure nothing: a weight read wrong stops the run."""
    native_layer = bench.native_layer

    def off(args, hf, dtype):
        layer = native_layer(args, hf, dtype)
        layer.A_log.data.mul_(1.01)
        return layer

    monkeypatch.setattr(bench, "native_layer", off)
    with pytest.raises(SystemExit, match="disagrees with transformers"):
        bench.main(["--quick", "--seqs", "70", "--out", str(tmp_path / "gdn.json")])

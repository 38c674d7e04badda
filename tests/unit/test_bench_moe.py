"""The MoE benchmark runs end to end at tiny sizes: both transformers implementations and the native block, in
agreement with each other, profiled, JSON and PNG written (no timing assertions: the machine is shared)."""

import json
from pathlib import Path

from internlm_offload.bench import moe as bench


def test_quick_run_writes_json_and_png(tmp_path: Path, capsys) -> None:
    out = tmp_path / "res" / "moe.json"
    returned = bench.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned))
    records = {rec["name"]: rec for rec in data["results"]}
    assert list(records) == ["transformers_grouped_mm", "transformers_eager", "native"]
    assert records["transformers_grouped_mm"]["ratio_wall"] == 1.0 == records["transformers_grouped_mm"]["ratio_cpu"]
    for rec in records.values():
        assert len(rec["wall_s"]) == len(rec["cpu_s"]) == bench.QUICK["repeats"] and rec["wall_s_median"] > 0
    # same weights, same tokens: the blocks compute the same thing (fp32)
    assert set(data["relative_error"]) == {"grouped_mm", "eager"}
    for errors in data["relative_error"].values():
        assert set(errors) == {"output", "input_grad", "router_grad", "gate_up_grad", "down_grad"}
        assert max(errors.values()) < 1e-5, errors
    prof = data["native_profile"]
    assert 0 < prof["expert_matmul_share"] < 1
    assert abs(prof["expert_matmul_share"] + prof["dispatch_and_rest_share"] - 1) < 1e-9
    assert "aten::mm" in prof["top_ops_self_s_per_step"]
    assert data["env"]["shape"] == {k: bench.QUICK[k] for k in ("tokens", "hidden", "intermediate", "experts", "top_k")}
    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "native" in capsys.readouterr().out


def test_native_block_holds_transformers_weights() -> None:
    """w1 and w3 are the gate and up halves of transformers' fused gate_up_proj, w2 its down_proj."""
    args = bench.parse_args(["--quick"])
    hf = bench.hf_block(args, "eager")
    native = bench.native_block(args, hf)
    I = args.intermediate
    assert native.experts.w1.equal(hf.experts.gate_up_proj[:, :I]) and native.experts.w3.equal(
        hf.experts.gate_up_proj[:, I:]
    )
    assert native.experts.w2.equal(hf.experts.down_proj) and native.router.weight.equal(hf.gate.weight)

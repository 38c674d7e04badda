"""The DSA attention benchmark runs end to end at tiny sizes: transformers' GlmMoeDsaAttention, the native DSA block
and dense MLA on the same weights, the DSA block in agreement with transformers', JSON written (no timing
assertions: the machine is shared)."""

import json

from internlm_offload.bench import dsa as bench


def test_quick_run_writes_json(tmp_path) -> None:
    out = tmp_path / "dsa.json"
    returned = bench.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned))
    assert [r["ratio_to_topk"] for r in data["results"]] == [4, 16]
    for rec in data["results"]:
        assert max(rec["relative_error"].values()) < 1e-5
        for name in ("dense_mla", "native_dsa", "transformers_dsa"):
            assert rec[name]["cpu_s"] > 0 and rec[name]["saved_bytes"] > 0
        assert rec["dense_mla"]["cpu_ratio_to_dense"] == 1.0
    # at 16x the top-k the sparse kernel saves less than dense attention's probabilities
    assert data["results"][1]["native_dsa"]["saved_bytes"] < data["results"][1]["dense_mla"]["saved_bytes"]

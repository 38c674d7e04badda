"""The activation benchmark runs end to end at tiny sizes: every configuration, bitwise grads, JSON and PNG."""

import json
from pathlib import Path

from internlm_offload.bench import activation as bench

EXPECTED = {
    "baseline",
    "full_ckpt",
    "selective_ckpt",
    "offload_sync_2",
    "offload_sync_4",
    "offload_sync_7",
    "offload_async_2",
    "offload_async_4",
    "offload_async_7",
    "save_on_cpu",
    "selective_offload_sync_7",
    "selective_offload_async_7",
}


def test_quick_run_writes_json_and_png(tmp_path: Path, capsys) -> None:
    out = tmp_path / "res" / "activation.json"
    returned = bench.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned))
    records = {rec["name"]: rec for rec in data["results"]}
    assert set(records) == EXPECTED
    assert all(rec["bitwise_equal"] for rec in records.values()), "a configuration changed the gradients"
    assert records["baseline"]["ratio"] == 1.0
    for name, rec in records.items():
        assert len(rec["step_s"]) == bench.QUICK["repeats"] and rec["step_s_median"] > 0
        assert (rec["offloader"] is not None) == ("offload_" in name)
        assert ("freed_fraction" in rec) == name.startswith("offload_")  # block offload against the baseline
        assert (rec.get("copy_overlap") is not None) == ("offload_async" in name)
        if rec.get("copy_overlap") is not None:
            assert rec["copy_overlap"] <= 1.0
    offloaded = [records[f"offload_sync_{n}"]["offloader"]["offloaded_bytes"] for n in (2, 4, 7)]
    assert 0 < offloaded[0] < offloaded[1] < offloaded[2]
    assert records["offload_async_4"]["offloader"]["offloaded_bytes"] == offloaded[1]
    fwd = "forward_peak_rss_anon_delta_bytes"
    if not all(records[name][fwd] < records["baseline"][fwd] for name in ("offload_sync_7", "save_on_cpu")):
        # The peaks are sampled RssAnon of the whole process: a stray allocation elsewhere in it can lift one
        # (CI saw save_on_cpu at 3.94 MB against 3.83 MB once; it is ~1.4 MB below as a rule). Measure again.
        again = bench.main(["--quick", "--out", str(tmp_path / "again" / "activation.json")])
        records = {rec["name"]: rec for rec in again["results"]}
    assert records["offload_sync_7"][fwd] < records["baseline"][fwd], "offload freed no anonymous memory"
    assert records["save_on_cpu"][fwd] < records["baseline"][fwd], "save_on_cpu's copies stayed anonymous"
    assert data["env"]["model"]["layers"] == 8 and data["env"]["torch"]
    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "offload_async_7" in capsys.readouterr().out


def test_offload_counts_follow_the_layer_count(tmp_path: Path) -> None:
    args = bench.parse_args(["--quick", "--layers", "4", "--out", str(tmp_path / "a.json")])
    cases = bench.make_cases(args, bench.Accelerator("cpu"))
    for case in cases:
        if case.handle is not None:
            case.handle.close()
    names = [case.name for case in cases]
    assert names == [
        "baseline",
        "full_ckpt",
        "selective_ckpt",
        "offload_sync_2",
        "selective_offload_sync_2",
        "offload_async_2",
        "selective_offload_async_2",
        "save_on_cpu",
    ]

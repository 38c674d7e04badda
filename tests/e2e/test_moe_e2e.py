"""The native mixture-of-experts model trains through train.py: configs/internlm2_tiny_moe.py, 3 steps, one process."""

from pathlib import Path

from runner import REPO, metrics, run_python, train

MOE = REPO / "configs" / "internlm2_tiny_moe.py"
STEPS = ["data.total_steps=3", "ckpt.enable_save_ckpt=False"]


def test_moe_trains_and_logs_its_aux_loss_bitwise_again(tmp_path: Path) -> None:
    """Both moe_types: three finite steps with moe_aux_loss (already times loss.moe_loss_coeff=0.01: about 0.01 per
    sparse block for a near-uniform router) in metrics.jsonl; a second run of the same seed logs the same values."""
    for moe_type in ("GShard", "Dropless"):
        runs = []
        for attempt in range(2):
            work_dir = tmp_path / f"{moe_type}_{attempt}"
            train(work_dir, *STEPS, f"model.moe_type={moe_type}", config=MOE)
            runs.append(metrics(work_dir))
        first, second = runs
        assert [r["step"] for r in first] == [1, 2, 3]
        # 2 micro-batches x 2 rows x 64 tokens, 2 choices each, 4 sparse blocks: Dropless computes every choice,
        # GShard at most that (capacity ceil(128 / 4 * 1.0 * 2) = 64 per expert and block)
        routed = 2 * 2 * 64 * 2 * 4
        for record in first:
            assert 0.0 < record["moe_aux_loss"] < 0.1, record  # 4 blocks x ~1 x 0.01
            counts = record["moe_tokens_per_expert"]
            assert len(counts) == 4 and record["moe_max_load"] >= 1.0
            assert sum(counts) == routed if moe_type == "Dropless" else 0 < sum(counts) <= routed
            assert max(counts) <= 64 * 4 * 2 or moe_type == "Dropless"  # GShard: capacity x blocks x micro-batches
        keys = ("loss", "grad_norm", "moe_aux_loss")
        assert [[r[k] for k in keys] for r in first] == [[r[k] for k in keys] for r in second]


def test_a_qwen3_moe_folder_trains_exports_and_a_wrong_one_is_one_line(tmp_path: Path) -> None:
    """A Qwen3-MoE folder made by transformers starts a run (ckpt_type='hf'), which trains 2 steps; `tools.export
    --hf` writes its checkpoint as a Qwen3MoeForCausalLM folder that transformers loads with nothing missing, whose
    tensors read back bitwise and whose logits are the native model's. A folder with another expert count: exit 2."""
    import json
    import sys

    import torch
    from test_bad_input import assert_clean_error
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from internlm_offload.builder import build_model
    from internlm_offload.config import resolve_config
    from internlm_offload.model.families.internlm2.hf_config import model_section
    from internlm_offload.tools.export import load_weights
    from internlm_offload.weights.sources import foreign_source, read_native_weights

    torch.manual_seed(0)
    hf_config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               num_hidden_layers=2, vocab_size=259, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, intermediate_size=48, mlp_only_layers=[1],
                               norm_topk_prob=True)  # fmt: skip
    Qwen3MoeForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    section = model_section(json.loads((tmp_path / "hf" / "config.json").read_text()))

    def config(folder: Path) -> Path:
        path = tmp_path / f"{folder.name}.py"
        path.write_text(
            f"_base_ = [{str(REPO / 'configs' / 'internlm2_tiny.py')!r}]\nmodel = {section!r}\n"
            f"ckpt = dict(load_ckpt_info=dict(path={str(folder)!r}, ckpt_type='hf', content=('model',)))\n"
        )
        return path

    run = tmp_path / "run"
    started = train(run, "data.total_steps=2", config=config(tmp_path / "hf"))
    assert f"Loaded hf model weights from {tmp_path / 'hf'}" in started.stdout + started.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2]
    out = tmp_path / "export"
    command = [sys.executable, "-m", "internlm_offload.tools.export", str(run / "checkpoints"), str(out), "--hf"]
    proc = run_python(command, timeout=300)
    assert proc.returncode == 0, proc.stderr
    back, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert type(back) is Qwen3MoeForCausalLM and not any(info.values()), info

    trained = load_weights(run / "checkpoints" / "step_00000002")
    cfg = resolve_config({"model": section, "ckpt": {"load_ckpt_info": {"path": str(out), "ckpt_type": "hf"}}})
    source = foreign_source(cfg.ckpt.load_ckpt_info, cfg.model)
    native = build_model(cfg.model, torch.device("cpu"))
    loaded = read_native_weights(source, cfg.model, {n: t.shape for n, t in native.state_dict().items()})
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[n], trained[n]) for n in trained)
    native.load_state_dict(loaded)
    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = native.eval()(ids).logits, back.eval()(ids).logits
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**json.loads((tmp_path / "hf" / "config.json").read_text()),
                                                   "num_local_experts": 8}))  # fmt: skip
    (wrong / "model.safetensors").symlink_to(tmp_path / "hf" / "model.safetensors")
    proc = train(tmp_path / "run_wrong", "data.total_steps=2", config=config(wrong), check=False)
    assert_clean_error(proc, "num_experts=8 (set model.num_experts to match; it gives 4)")

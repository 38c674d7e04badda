"""Every kind of bad input ends with one `error:` line on stderr, exit code 2, and nothing written."""

import hashlib
import json
import shutil

import pytest
from runner import REPO, TINY, run_python, train

pytestmark = pytest.mark.e2e


def assert_clean_error(proc, *fragments: str) -> str:
    """Exit 2, exactly one `error:` line containing `fragments`, no traceback; returns the line."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def write_config(tmp_path, body: str):
    path = tmp_path / "cfg.py"
    path.write_text(f'_base_ = ["{REPO}/configs/internlm2_tiny.py"]\n{body}\n')
    return path


@pytest.mark.parametrize(
    "options, fragments",
    [
        (["model.num_layer=3"], ["unknown config key 'model.num_layer'", "did you mean 'model.num_layers'"]),
        (["modle.num_layers=3"], ["unknown config key 'modle'", "did you mean 'model'"]),
        (["model.num_layers=abc"], ["model.num_layers='abc'", "valid integer"]),
        (["model.checkpoint=1.5"], ["model.checkpoint=1.5", "less than or equal to 1"]),
        (["model.dtype=torch.int8"], ["model.dtype='torch.int8'", "'torch.float32'"]),
        (["parallel.mode=zero3"], ["parallel.mode='zero3'", "'fsdp2'"]),
        (["cpu_offloading.num_layers=2"], ["cpu_offloading.num_layers=2 needs cpu_offloading.enable=True"]),
        (["selective_checkpoint_offload=True"], ["needs selective_checkpoint=True"]),
        (["swap_optimizer_times=0"], ["swap_optimizer_times=0", "greater than or equal to 1"]),
        (["use_pinned_optimizer_offload=True"], ["use_pinned_optimizer_offload=True", "needs swap_optimizer=True"]),
        (["swap_optimizer=True", "hybrid_optimizer.enable=True"], ["exclude each other"]),
        (["parallel.fsdp_cpu_offload=True"], ["parallel.fsdp_cpu_offload=True needs parallel.mode='fsdp2'"]),
        (
            ["parallel.fsdp_cpu_offload=auto", "memory_budget.device=1GiB"],
            ["parallel.fsdp_cpu_offload='auto' needs parallel.mode='fsdp2'", "got 'none'"],
        ),
        (
            ["parallel.mode=fsdp2", "parallel.fsdp_cpu_offload=True", "swap_optimizer=True"],
            ["fsdp_cpu_offload=True", "excludes swap_optimizer"],
        ),
        (["data.type=text", "data.paths=[/no/such/file.txt]"], ["data.paths", "/no/such/file.txt"]),
        (["nvme_offload.enable=True"], ["nvme_offload.enable=True needs nvme_offload.path"]),
        (["nvme_offload.enable=True", "nvme_offload.path=/tmp"], ["needs swap_optimizer=True or hybrid"]),
        (
            ["swap_optimizer=True", "nvme_offload.enable=True", "nvme_offload.path=/no/such/dir"],
            ["nvme_offload.path='/no/such/dir' is not a writable directory"],
        ),
        (
            ["swap_optimizer=True", "nvme_offload.enable=auto", "memory_budget.device=1GiB"],
            ["nvme_offload.enable='auto' needs nvme_offload.path"],
        ),
        (["model.type=gpt9"], ["model.type", "'gpt9'", "internlm2"]),
        (["model.vocab_size=100"], ["model.vocab_size=100", "259"]),
    ],
)
def test_bad_config_values(tmp_path, options, fragments):
    work_dir = tmp_path / "wd"
    assert_clean_error(train(work_dir, *options, check=False), *fragments)
    assert not work_dir.exists()


def test_missing_config_file(tmp_path):
    proc = train(tmp_path / "wd", config=tmp_path / "nope.py", check=False)
    assert_clean_error(proc, "--config", "nope.py", "not found")


def test_unparsable_config(tmp_path):
    proc = train(tmp_path / "wd", config=write_config(tmp_path, "model = dict(num_layers=4"), check=False)
    assert_clean_error(proc, "cfg.py", "syntax error")
    assert not (tmp_path / "wd").exists()


def test_import_in_config(tmp_path):
    proc = train(tmp_path / "wd", config=write_config(tmp_path, "import torch\nx = 1"), check=False)
    assert_clean_error(proc, "cfg.py line 2", "import statements are not allowed")


def test_world_size_that_does_not_divide_the_batch(tmp_path):
    proc = train(tmp_path / "wd", "parallel.mode=ddp", "data.global_bsz=6", nproc=2, check=False)
    # torchrun reports a failed worker with its own exit code 1; each worker exits 2 with our line.
    assert proc.returncode != 0
    assert "(exitcode: 2)" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error: data.global_bsz=6" in line]
    assert errors and "choose a multiple of 4" in errors[0]
    assert not (tmp_path / "wd").exists()


def tree_digest(folder) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp("saved")
    train(work_dir, "data.total_steps=2")
    return work_dir


def test_checkpoint_of_another_model_is_refused(saved_run, tmp_path):
    ckpt = saved_run / "checkpoints"
    before = tree_digest(ckpt)
    proc = train(tmp_path / "wd", "model.hidden_size=64", f"ckpt.load_ckpt_folder={ckpt}", check=False)
    assert_clean_error(proc, "saved for another model", "shape")
    assert tree_digest(ckpt) == before


@pytest.mark.parametrize("file_list", [True, False], ids=["manifest_lists_files", "older_manifest"])
def test_corrupt_checkpoint_is_refused_and_kept(saved_run, tmp_path, file_list):
    """The only checkpoint torn: named as damaged before loading, or (a manifest from before file lists)
    when DCP cannot read it."""
    work_dir = tmp_path / "wd"
    shutil.copytree(saved_run, work_dir)
    step_dir = work_dir / "checkpoints" / "step_00000002"
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # a torn write
    if not file_list:
        manifest = json.loads((step_dir / "manifest.json").read_text())
        del manifest["files"]
        (step_dir / "manifest.json").write_text(json.dumps(manifest))
    before = tree_digest(work_dir / "checkpoints")
    proc = train(work_dir, "data.total_steps=4", resume=True, check=False)
    if file_list:
        assert_clean_error(proc, "no intact checkpoint", f"step_00000002 is damaged ({shard.name} has 1000 B")
    else:
        assert_clean_error(proc, "step_00000002", "cannot be read")
    assert tree_digest(work_dir / "checkpoints") == before


def test_checkpoint_path_that_does_not_exist(tmp_path):
    proc = train(tmp_path / "wd", f"ckpt.load_ckpt_folder={tmp_path / 'gone'}", check=False)
    assert_clean_error(proc, "checkpoint not found", "gone")
    assert not (tmp_path / "wd").exists()


def test_print_config_resolves_derived_values(tmp_path):
    # a run whose micro_num is derived (global 8 = micro-batch 2 x 4) trains: 2 steps, not the config's 120 (CI time)
    proc = train(tmp_path / "wd", "data.global_bsz=8", "data.total_steps=2", check=False)
    assert proc.returncode == 0
    import json
    import sys

    out = run_python(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--config",
            str(TINY),
            "--print-config",
            "--cfg-options",
            "data.global_bsz=16",
            "data.micro_bsz=4",
            "data.total_steps=7",
        ],
    )
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["data"]["micro_num"] == 4
    assert resolved["lr_scheduler"]["total_steps"] == 7
    assert resolved["model"]["num_kv_attention_heads"] == 2


@pytest.mark.parametrize(
    "body, fragments",
    [
        ('model = dict(_delete_=True, type="hf_causal_lm", hf_path="/no/such/model")',
         ["model.hf_path='/no/such/model' is not a local directory"]),
        # the DeepSeek-V3 family's damaged folders: tests/unit/test_deepseek_folder.py
        ('model = dict(_delete_=True, type="deepseek_v3", hf_path="/no/such/model")',
         ["model.type='deepseek_v3': model.hf_path='/no/such/model' is not a local directory"]),
        ('model = dict(_delete_=True, type="hf_causal_lm", hf_config=dict(model_type="nosuchmodel"))',
         ["model.hf_config.model_type='nosuchmodel' is not a model type transformers"]),
        ('model = dict(_delete_=True, type="hf_causal_lm", hf_config=dict(model_type="phi3", vocab_size=259, '
         'hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, pad_token_id=32000))',
         ["model.hf_config.pad_token_id=32000 is outside the vocabulary (vocab_size=259)"]),
    ],
)  # fmt: skip
def test_bad_hugging_face_model_is_one_line(tmp_path, body, fragments):
    work_dir = tmp_path / "wd"
    assert_clean_error(train(work_dir, config=write_config(tmp_path, body), check=False), *fragments)
    assert not work_dir.exists()


def test_work_dir_that_is_a_file_is_one_line(tmp_path):
    work_file = tmp_path / "wd"
    work_file.write_text("not a folder")
    assert_clean_error(train(work_file, check=False), "--work-dir", "is a file")
    assert work_file.read_text() == "not a folder"


def test_resume_with_another_dtype_is_one_line_and_keeps_the_run(saved_run, tmp_path):
    work_dir = tmp_path / "wd"
    shutil.copytree(saved_run, work_dir)  # a 2-step fp32 run of its own
    before = (work_dir / "metrics.jsonl").read_text()
    proc = train(work_dir, "data.total_steps=4", "model.dtype=torch.bfloat16", resume=True, check=False)
    assert_clean_error(proc, "model.dtype=torch.float32", "this run has model.dtype=torch.bfloat16", "load_ckpt_info")
    assert (work_dir / "metrics.jsonl").read_text() == before


def test_a_run_too_big_for_this_machine_is_refused_in_seconds(tmp_path):
    """The 7B config on this machine: preflight predicts the step, exits 2 before allocating, writes nothing."""
    work_dir = tmp_path / "run"
    proc = train(work_dir, "device=cpu", "preflight=True", config=REPO / "configs" / "internlm2_7b.py", check=False)
    assert_clean_error(
        proc, "preflight: predicted ", "available on this host", "largest: ", "swap_optimizer=True", "preflight=False"
    )
    assert not work_dir.exists()


def test_preflight_runs_before_every_run_unless_turned_off(tmp_path):
    on = train(tmp_path / "on", "data.total_steps=1", "ckpt.enable_save_ckpt=False", "preflight=True")
    off = train(tmp_path / "off", "data.total_steps=1", "ckpt.enable_save_ckpt=False", "preflight=False")
    assert "Preflight: predicted per-rank peak device" in on.stderr and "Preflight" not in off.stderr

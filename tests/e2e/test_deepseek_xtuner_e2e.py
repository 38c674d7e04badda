"""An XTuner v1 config of a DeepSeek-V3 folder (`get_model_config_from_hf` + `load_from`) translates onto the native
`deepseek_v3` family and trains under the FSDP2 it asks for, with the balancing loss XTuner adds, the folder's weights
loaded: a family read from
`model.hf_path` is built on meta under `parallel.mode='fsdp2'` and the folder read into its shards."""

import json
import subprocess
import sys

import pytest
from runner import TINY, losses, metrics, run_python, train
from test_deepseek_family_e2e import transformers_folder

pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

XTUNER = """\
from xtuner.v1.config import AdamWConfig, FSDPConfig
from xtuner.v1.datasets import PretrainTokenizeFunctionConfig
from xtuner.v1.datasets.config import DataloaderConfig, DatasetConfig
from xtuner.v1.model import get_model_config_from_hf
from xtuner.v1.train import TrainerConfig

data = [{{"dataset": DatasetConfig(anno_path={data!r}), "tokenize_fn": PretrainTokenizeFunctionConfig()}}]
trainer = TrainerConfig(
    model_cfg=get_model_config_from_hf({folder!r}),
    load_from={folder!r},
    tokenizer_path="byte",
    optim_cfg=AdamWConfig(lr=1e-3),
    fsdp_cfg=FSDPConfig(recompute_ratio=0.5),
    dataloader_cfg=DataloaderConfig(dataset_config_list=data, pack_max_length=64),
    global_batch_size=2,
    total_step=2,
)
"""


def test_an_xtuner_config_of_the_folder_translates_and_trains_it_under_fsdp2(tmp_path):
    folder = tmp_path / "ds"
    transformers_folder("deepseek_v3", folder)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"content": f"document {i} " * 8}) + "\n" for i in range(16)))
    config, out = tmp_path / "xtuner.py", tmp_path / "translated.py"
    config.write_text(XTUNER.format(folder=str(folder), data=str(data)))
    cmd = [sys.executable, "-m", "internlm_offload.tools.from_xtuner", str(config), "--out", str(out)]
    proc: subprocess.CompletedProcess = run_python(cmd)
    assert proc.returncode == 0, proc.stderr
    assert "'type': 'deepseek_v3'" in out.read_text() and "'mode': 'fsdp2'" in out.read_text()
    # DeepSeekV3Config.from_hf's balancing loss: XTuner's global-batch one at alpha 0.001
    carried = "-> model.balancing_loss='global_batch', loss.moe_loss_coeff=0.001"
    assert sum(line.startswith("carried: ") and carried in line for line in proc.stderr.splitlines()) == 1
    run = train(tmp_path / "run", config=out, fast=False)
    assert f"Loaded 49 tensors from {folder}" in run.stderr
    assert sorted(losses(tmp_path / "run")) == [1, 2]
    assert all(0 < record["moe_aux_loss"] < 0.01 for record in metrics(tmp_path / "run"))  # about 0.001 per block


def test_under_fsdp2_the_folders_weights_are_loaded_not_drawn(tmp_path):
    """One process under FSDP2 starts from the folder: the same step-1 loss as without it (seeded weights differ)."""
    folder = tmp_path / "ds"
    transformers_folder("deepseek_v3", folder)
    config = tmp_path / "ds.py"
    config.write_text(f"_base_ = [{str(TINY)!r}]\nmodel = dict(type='deepseek_v3', hf_path={str(folder)!r})\n")
    first = {}
    for mode in ("none", "fsdp2"):
        train(tmp_path / mode, "data.total_steps=1", f"parallel.mode={mode}", config=config)
        first[mode] = losses(tmp_path / mode)[1]
    assert first["fsdp2"] == pytest.approx(first["none"], rel=0, abs=1e-6), first

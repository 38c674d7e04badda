"""What the DeepSeek-V3 family's e2e files share: its tiny config, the steps of its baselines, and the router biases a
run leaves (test_deepseek_tiers_e2e.py bitwise at one layout, test_deepseek_parallel_e2e.py across layouts)."""

from pathlib import Path

import torch
from runner import REPO

from internlm_offload.tools.export import load_weights

DEEPSEEK = REPO / "configs" / "deepseek_v3_tiny.py"
# 6 steps of a global batch of 8 (4 micro-batches of 2 on one process), checkpoints at 2, 4, 6 (saving moves no bit);
# lr 1e-3 (tensor_parallel_runs.CALM), where the layouts follow one process within a tolerance
STEPS = ["data.total_steps=6", "data.global_bsz=8", "adam.lr=1e-3", "ckpt.checkpoint_every=2", "ckpt.keep_last=0"]
LAST = "step_00000006"
BIAS = "router.e_score_correction_bias"
DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}  # bf16: fp32 masters (model/precision defaults)


def family_baseline(reference_run, dtype: str = "fp32", mode: str = "none") -> Path:
    """The plain run of STEPS under `mode` (one process, or two for DDP / FSDP2), trained once per pytest run."""
    options = [*STEPS, f"model.dtype={DTYPES[dtype]}", f"parallel.mode={mode}"]
    return reference_run(*options, nproc=1 if mode == "none" else 2, config=DEEPSEEK)


def biases(run: Path, step: str = LAST) -> dict[str, torch.Tensor]:
    """The router biases saved at `step`: one (E,) fp32 tensor per sparse block, the multi-token-prediction block's
    last."""
    return {key: value for key, value in load_weights(run / "checkpoints" / step).items() if key.endswith(BIAS)}


def assert_same_biases(base: Path, run: Path, step: str = LAST, *, mtp: bool = True) -> None:
    """`run`'s biases at `step` are `base`'s, bit for bit, and they moved (none is the init's zeros): the 3 sparse
    blocks' and, with `mtp`, the multi-token-prediction block's (its router counts its own choices)."""
    want, have = biases(base, step), biases(run, step)
    assert (
        len(want) == 3 + mtp
        and any(key.startswith("mtp.") for key in want) == mtp
        and all(t.dtype == torch.float32 and t.abs().sum() > 0 for t in want.values())
    )
    assert have.keys() == want.keys(), (sorted(have), sorted(want))
    assert all(torch.equal(have[key], want[key]) for key in want), "router biases differ"

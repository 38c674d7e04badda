"""The `optimizer` section: keys shared by every update rule, which rule steps which parameter, Muon's keys."""

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from internlm_offload.config.base import Section

UpdateRuleName = Literal["adamw", "muon"]  # the rules a config can name (optim/rules.py)


class MuonConfig(Section):
    """Muon's hyper-parameters (torch.optim.Muon's names and defaults, but the lr adjustment)."""

    lr: Optional[float] = Field(
        None, gt=0, description="Muon's peak learning rate; default: the run's (`optimizer.lr` / `adam.lr`)."
    )
    weight_decay: Optional[float] = Field(
        None, ge=0, description="Muon's decoupled weight decay (with the unadjusted lr); default: `adam.weight_decay`."
    )
    momentum: float = Field(0.95, ge=0, lt=1, description="Momentum (torch's EMA form: `buf.lerp_(grad, 1 - mu)`).")
    nesterov: bool = Field(True, description="Nesterov momentum: orthogonalise `grad.lerp(buf, mu)`, else `buf`.")
    ns_coefficients: tuple[float, float, float] = Field(
        (3.4445, -4.775, 2.0315), description="Newton-Schulz quintic coefficients (a, b, c); Keller's by default."
    )
    ns_steps: int = Field(5, ge=0, lt=100, description="Newton-Schulz iterations.")
    eps: float = Field(1e-7, gt=0, description="Lower clamp on the Frobenius norm before Newton-Schulz.")
    clip_grad: bool = Field(
        True,
        description="Whether `hybrid_zero_optimizer.clip_grad_norm` scales Muon's gradients: True (torch's way: "
        "every gradient clipped alike) or False (XTuner's MuonConfig: Muon's gradients count in the norm but are not "
        "scaled, only AdamW's are; `tools.from_xtuner` sets it).",
    )
    ns_dtype: Literal["torch.bfloat16", "torch.float32"] = Field(
        "torch.bfloat16",
        description="The dtype Newton-Schulz runs in (and sharded updates are gathered in): `torch.bfloat16` as "
        "torch.optim.Muon and XTuner run it, or `torch.float32`: about 2x the matmul time and gathered bytes, and "
        "runs of other layouts (DDP, FSDP2, tensor and expert parallel) then keep within fp32 noise of one process, "
        "where bf16 rounds their gradients' last bits apart (~1.5e-5 relative on the loss in 20 steps).",
    )
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = Field(
        "match_rms_adamw",
        description="lr scale per matrix [A, B]: `match_rms_adamw` (Moonlight's 0.2 * sqrt(max(A, B)): the update's "
        "RMS matches AdamW's, so an AdamW-tuned lr and weight decay work as they are) or `original` (Keller's "
        "sqrt(max(1, A / B)), torch's default: wants a ~10x larger lr, 12.8x for a 4096 x 4096 matrix).",
    )

    @field_validator("ns_coefficients", mode="before")
    @classmethod
    def _list_as_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value


class OptimizerConfig(Section):
    type: UpdateRuleName = Field(
        "adamw",
        description="`adamw`: AdamW steps every parameter. `muon`: XTuner's MuonConfig split: every trainable "
        "matrix (ndim >= 2, not [1, n] or [n, 1]) but the embedding and the LM head steps with Muon (`optimizer.muon`; "
        "stacked experts per expert, MLA's fused row blocks apart), the rest (norms, biases, embedding, head) with "
        "AdamW (`adam`); `optimizer.rules` patterns come first. Gradient clipping clips all gradients alike "
        "(XTuner's leaves Muon's unscaled: `optimizer.muon.clip_grad=False`). "
        "docs/optimizer_offload.md, Muon.",
    )
    muon: MuonConfig = Field(default_factory=MuonConfig)
    lr: Optional[float] = Field(
        None,
        gt=0,
        description="Peak learning rate of every update rule; the same key as `adam.lr` (InternEvo's spelling, "
        "which keeps working): give one of the two, or both equal.",
    )
    rules: list[tuple[str, UpdateRuleName]] = Field(
        [],
        description="`(pattern, rule)` pairs choosing each trainable parameter's update rule by its name "
        "(fnmatch, e.g. `('*.experts.*', 'adamw')`): the first match wins; parameters no pattern matches take "
        "`optimizer.type`'s choice. Rules: `adamw`, `muon`.",
    )

    @field_validator("rules", mode="before")
    @classmethod
    def _pairs_as_tuples(cls, value: Any) -> Any:
        # config files and --cfg-options give lists; a pair is a tuple here
        if isinstance(value, (list, tuple)):
            return [tuple(pair) if isinstance(pair, list) else pair for pair in value]
        return value


def shared_lr_problem(optimizer: OptimizerConfig, adam_lr: float, adam_lr_set: bool) -> str | None:
    """Why `optimizer.lr` and `adam.lr` cannot both stand (None when they agree or one is unset)."""
    if optimizer.lr is None or not adam_lr_set or optimizer.lr == adam_lr:
        return None
    return f"optimizer.lr={optimizer.lr} and adam.lr={adam_lr} are one learning rate spelled twice; give one of them"


def uses_muon(optimizer: OptimizerConfig) -> bool:
    """Whether any parameter may step with Muon."""
    return optimizer.type == "muon" or any(rule == "muon" for _, rule in optimizer.rules)


def muon_parallel_problem(
    optimizer: OptimizerConfig, mode: str, tensor_size: int, expert_size: int, offload_tier: str | None
) -> str | None:
    """Muon orthogonalises whole matrices: the plain optimizer and the swap tier gather a sharded (FSDP2, tensor or
    expert parallel) parameter's matrices (optim/muon_sharded.py), the hybrid tier steps local shards and does not:
    one line naming the keys, else None. `offload_tier`: `swap_optimizer` / `hybrid_optimizer`, or None."""
    if not uses_muon(optimizer) or offload_tier != "hybrid_optimizer":
        return None
    if mode == "fsdp2":
        key = "parallel.mode='fsdp2'"
    elif tensor_size > 1:
        key = f"parallel.tensor.size={tensor_size}"
    elif expert_size > 1:
        key = f"parallel.expert.size={expert_size}"
    else:
        return None
    return (
        f"optimizer.type='muon' (or a `muon` rule) with {key} and {offload_tier}: the {offload_tier} tier steps "
        "each rank's shards and does not gather Muon's matrices yet; drop one of them (Muon without an offload tier "
        "or with swap_optimizer gathers them)"
    )

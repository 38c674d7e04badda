"""Activation checkpointing of whole decoder blocks, full or selective (op-level).

Full: a block keeps only its inputs and recomputes everything in backward (saves the most memory,
costs one extra forward of the block). Selective: the block keeps the outputs of the expensive ops
(matmuls, attention) and recomputes only the cheap elementwise ones (norms, activations, RoPE),
which costs little time and still frees most of the saved elementwise intermediates.

Uses torch's composable `checkpoint`, which works through hooks: parameter names are unchanged, so
checkpoints load across plans and FSDP2 can shard the same blocks afterwards.
"""

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from internlm_offload.log import get_logger

logger = get_logger(__name__)

aten = torch.ops.aten

# Ops whose outputs the selective policy keeps: recomputing them costs real FLOPs. In a mixture-of-experts block
# that is the router's logits (mm), the experts' grouped GEMMs (w1, w3, w2: `_grouped_mm`; the loop fallback's
# per-expert slices are mm) and the shared experts' matmuls; the routing itself (softmax, top-k, the capacity
# ranks, the counts, argsort, the permutation gathers) is recomputed: cheap, and deterministic, so the recomputed
# permutation is the forward's.
EXPENSIVE_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.linear.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_cudnn_attention.default,
    }
    | ({aten._grouped_mm.default} if hasattr(aten, "_grouped_mm") else set())
)


# Attention kernels of optional extras, as (op namespace, op name): flash-attn registers torch ops when it is
# imported, torch_npu its fused attention. Looked up when the first block runs, after those imports.
OPTIONAL_EXPENSIVE_OPS = (
    ("flash_attn", "_flash_attn_forward"),
    ("flash_attn", "_flash_attn_varlen_forward"),
    ("npu", "npu_fusion_attention"),
    ("npu", "npu_fusion_attention_v2"),
)


@functools.cache
def expensive_ops() -> frozenset:
    """EXPENSIVE_OPS plus the attention ops of flash-attn and torch_npu that are registered now."""
    found = set()
    for namespace, name in OPTIONAL_EXPENSIVE_OPS:
        try:
            packet = getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):  # not installed / not registered
            continue
        found.update(getattr(packet, overload) for overload in packet.overloads())
    return EXPENSIVE_OPS | frozenset(found)


def _selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in expensive_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn() -> tuple[object, object]:
    """The `context_fn` for torch.utils.checkpoint that implements the selective policy."""
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(layers: nn.ModuleList, indices: Sequence[int], *, selective: bool = False) -> None:
    """Checkpoint `layers[i]` for each i in `indices`, in place."""
    kwargs: dict[str, Callable[[], tuple[object, object]]] = {}
    if selective:
        kwargs["context_fn"] = selective_context_fn
    for i in indices:
        checkpoint(layers[i], **kwargs)
    if indices:
        kind = "selective" if selective else "full"
        logger.info("Applied %s activation checkpointing to %d of %d blocks", kind, len(indices), len(layers))


__all__ = ["apply_activation_checkpointing", "selective_context_fn", "EXPENSIVE_OPS", "expensive_ops"]

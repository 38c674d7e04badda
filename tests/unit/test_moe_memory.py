"""docs/moe.md's count of what a sparse block keeps for backward per token, held to the saved tensors themselves."""

import pytest
import torch

from internlm_offload.model.moe import MoE


def saved_bytes_per_token(moe: MoE, x: torch.Tensor) -> float:
    """Bytes of the distinct storages autograd saves in one forward, less the parameters and the input."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(x)
    for t in (x, *moe.parameters()):
        storages.pop(t.untyped_storage().data_ptr(), None)
    return sum(storages.values()) / x.shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("moe_type", "H", "I", "E", "k"), [("Dropless", 64, 32, 8, 2), ("Dropless", 128, 64, 16, 4),
                                                              ("GShard", 64, 32, 8, 2)])  # fmt: skip
def test_saved_bytes_per_token_are_the_documented_count(dtype, moe_type, H, I, E, k) -> None:
    """k (2H + 4I) b bytes per token, plus at most 4E (fp32 scores), 50 per choice (indices, weights) and, in bf16,
    4H (the router's fp32 input) and the router weight's fp32 copy (4EH per block): docs/moe.md, Memory."""
    torch.manual_seed(0)
    moe = MoE(H, I, E, k, moe_type=moe_type).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(256, H, dtype=dtype, requires_grad=True)
    b = torch.empty((), dtype=dtype).element_size()
    leading = k * (2 * H + 4 * I) * b
    extra = 4 * E + 50 * k + (4 * H + 4 * E * H / x.shape[0] if dtype != torch.float32 else 0)
    assert leading <= saved_bytes_per_token(moe, x) <= leading + extra

"""Query-chunk loops on meta tensors (the planner's and the preflight's trace): the first two chunks traced, the rest's
matrix work counted in one stand-in op.

DSA's indexer and sparse kernel (model/indexer.py, model/sparse_attention.py) loop over query chunks of one size (the
last one shorter), each allocating the same transients and freeing them as the next one replaces them; at 128k tokens
that is thousands of chunks a block, too many ops to trace. Their memory is periodic: the first chunk, and the second
(which runs beside the first one's leftovers, as every later one does beside its predecessor's), hold every peak the
loop reaches, so on meta a loop runs those two and stops. The work of the chunks left out is linear in their queries:
the caller states its FLOPs and `count_skipped_work` runs one matmul whose FLOP formula gives them (stride-0 views of
one element: it allocates one element), so the planner's FLOP count, and the step time it predicts, is the loop's.
"""

import torch

TRACED_CHUNKS = 2


def traced_queries(t: torch.Tensor, length: int, chunk: int) -> int:
    """The queries a chunk loop over `length` runs: all of them, or on meta the first TRACED_CHUNKS chunks."""
    return min(length, TRACED_CHUNKS * chunk) if t.is_meta else length


def count_skipped_work(t: torch.Tensor, flops: int) -> None:
    """On meta, `flops` of matrix work (the chunks `traced_queries` left out) as one (1, k) @ (k, 1) matmul."""
    if not t.is_meta or flops <= 0:
        return
    one = torch.zeros((), dtype=torch.float32, device=t.device)
    torch.mm(one.expand(1, flops // 2), one.expand(flops // 2, 1))

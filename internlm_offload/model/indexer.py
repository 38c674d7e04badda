"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): per query, the `index_topk` earlier keys of
its own document that a small multi-head scorer ranks highest; MLA then attends to those alone (model/dsa.py).

For query t and key s: I[t, s] = sum_h (w[t, h] Hi^-0.5) ReLU(Di^-0.5 q[t, h] . k[s]), with q = wq_b(the MLA query
latent) in Hi heads of Di, k = LayerNorm(wk(x)) one head of Di, w = weights_proj(x) (transformers' and the paper's
constants: positive, so they change no ranking). RoPE rotates the first dr dims of q and k ([rope | nope], the reverse
of MLA's), half-split in DeepSeek-V3.2 and interleaved in GLM-5. Keys of another document and later keys score -inf;
a query with fewer than `index_topk` such keys gets -1 in the slots left over.

Frozen by default, as transformers and XTuner run it: no gradient reaches it (it runs under no_grad and its
parameters have requires_grad False, so the optimizer skips them), its weights are loaded, saved and exported. The
scores are computed in query chunks, so the transient is (chunk x Hi x T) floats, never T x Hi x T.
"""

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from internlm_offload.model.meta_trace import count_skipped_work, traced_queries
from internlm_offload.model.mlp import ParamInit, normal_init
from internlm_offload.model.rope import apply_rope, apply_rope_interleaved

# transformers' k_norm: a LayerNorm with a bias at this eps, whatever the config's rms_norm_eps
KEY_NORM_EPS = 1e-6
# the score elements one query chunk may hold (fp32: 256 MiB); a chunk is at least one query
CHUNK_ELEMENTS = 1 << 26


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document number within each row, from positions restarting at 0 (as model/attention.py numbers them)."""
    return (position_ids == 0).cumsum(-1)


def visible_keys(doc: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """(B, stop - start, T): True where query t of [start, stop) may see key s: s <= t, same document."""
    T = doc.shape[-1]
    queries = torch.arange(start, stop, device=doc.device)
    causal = queries[:, None] >= torch.arange(T, device=doc.device)[None]
    return causal[None] & (doc[:, start:stop, None] == doc[:, None, :])


class LightningIndexer(nn.Module):
    """The indexer of one DSA layer (transformers' `indexer.*` names: wq_b, wk, k_norm, weights_proj)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        rope_dim: int,
        rope_interleave: bool,
        topk: int,
        trainable: bool = False,
    ) -> None:
        """`rope_interleave`: GLM-5's layout (adjacent pairs), else DeepSeek-V3.2's halves; `topk` the keys each query
        keeps. `trainable` False: frozen (no loss trains it here; the paper's KL warm-up is not built)."""
        super().__init__()
        if rope_dim > head_dim:
            raise ValueError(f"index_head_dim={head_dim} must hold the rope slice qk_rope_head_dim={rope_dim}")
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.rope_interleave = rope_interleave
        self.topk = topk
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=KEY_NORM_EPS)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)
        self.requires_grad_(trainable)

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """(B, T, min(topk, T)) int32 key positions per query, best first, -1 where the query sees fewer keys; `x` the
        attention's input (B, T, C), `q_latent` MLA's normed query latent (B, T, qr), `rope` the (cos, sin) of dr
        dims, `position_ids` (B, T) restarting per document (None: one document per row)."""
        B, T, _ = x.shape
        q, k = self._roped(x, q_latent, rope)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5  # (B, T, Hi)
        doc = document_ids(position_ids) if position_ids is not None else x.new_zeros(B, T, dtype=torch.long)
        doc = doc.expand(B, T)
        keys = k.float().transpose(-1, -2)[:, None]  # (B, 1, Di, T)
        count = min(self.topk, T)
        chunk = max(1, CHUNK_ELEMENTS // (self.n_heads * T))
        # written in place chunk by chunk: no list of chunks beside their concatenation
        picks = torch.empty(B, T, count, dtype=torch.int32, device=x.device)
        traced = traced_queries(x, T, chunk)  # on meta the first chunks (model/meta_trace.py)
        for start in range(0, traced, chunk):
            stop = min(start + chunk, T)
            scores = F.relu(torch.matmul(q[:, start:stop].float(), keys) * self.head_dim**-0.5)  # (B, c, Hi, T)
            index = torch.matmul(weights[:, start:stop, None], scores).squeeze(-2)  # (B, c, T)
            index = index.masked_fill(~visible_keys(doc, start, stop), float("-inf"))
            best, where = index.topk(count, dim=-1)
            picks[:, start:stop] = where.masked_fill(best == float("-inf"), -1)
        count_skipped_work(x, 2 * B * (T - traced) * self.n_heads * T * (self.head_dim + 1))  # q.k, then weights
        return picks

    def _roped(
        self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's queries (B, T, Hi, Di) and its one key head (B, T, Di), their first dr dims roped."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))[:, :, None]  # (B, T, 1, Di)
        rotate = apply_rope_interleaved if self.rope_interleave else apply_rope
        cos, sin = rope
        dr = self.rope_dim
        q = torch.cat((rotate(q[..., :dr], cos, sin), q[..., dr:]), dim=-1)
        k = torch.cat((rotate(k[..., :dr], cos, sin), k[..., dr:]), dim=-1)
        return q, k[:, :, 0]

    def param_inits(self, std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """normal(0, std) for the projections, the key norm to ones and zeros; in this order (the seeded draws)."""
        for lin in (self.wq_b, self.wk, self.weights_proj):
            yield lin.weight, normal_init(std)
        yield self.k_norm.weight, nn.init.ones_
        yield self.k_norm.bias, nn.init.zeros_

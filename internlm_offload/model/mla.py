"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash, GLM-5): queries through an optional low-rank
bottleneck, keys and values expanded per head from one normed latent per token, and RoPE on a slice of each head
whose key part all heads share. Module names are transformers' (`DeepseekV3Attention`), so its weights load by name.

Per head, q and k are [nope (dn) | rope (dr)] and v is dv wide; dv may differ from dn + dr (`attend` takes it).

Saved for backward, per token and block (C hidden, H heads, qr / kr the ranks): the input x (C, read by q_a_proj and
kv_a_proj_with_mqa); each latent norm's float32 input and normalised output (2 qr + 2 kr, and 2 rsqrt) and the
projections' inputs after them (qr, kr); the kernel's q and k (H (dn + dr) each), v (H dv) and its output and
logsumexp (flash / efficient sdpa); o_proj's input (H dv). RoPE's (cos, sin) are one pair for all blocks. In
training MLA saves about what multi-head attention of H heads would: the latents shrink only the projections.
"""

from collections.abc import Iterator

import torch
from torch import nn

from internlm_offload.model.attention import Documents, attend, uses_flash
from internlm_offload.model.hooks import ExchangesSequence, SplitsMuonRows
from internlm_offload.model.mlp import ParamInit, normal_init
from internlm_offload.model.norm import RMSNorm
from internlm_offload.model.rope import apply_rope, apply_rope_interleaved

# transformers builds q_a_layernorm and kv_a_layernorm without the config's rms_norm_eps: its RMSNorm's default
LATENT_NORM_EPS = 1e-6


class MultiLatentAttention(nn.Module, ExchangesSequence, SplitsMuonRows):
    """Causal multi-head latent attention over packed documents; under isp it exchanges whole heads of the expanded
    q, k, v for sequence around attending, as `Attention` does (`sequence_exchange`, model/hooks.py)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        n_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        attn_impl: str,
        bias: bool = False,
        rope_interleave: bool = True,
        softmax_mscale: float = 1.0,
    ) -> None:
        """`q_lora_rank` None: one q_proj, no bottleneck (DeepSeek-V2-Lite). `bias` is on q_a_proj, kv_a_proj_with_mqa
        and o_proj (transformers' `attention_bias`). `rope_interleave`: RoPE pairs adjacent dims (DeepSeek), else
        the halves. The softmax scale is (dn + dr)^-0.5 x `softmax_mscale`^2 (YaRN's, model/rope.py
        `softmax_mscale`)."""
        super().__init__()
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={qk_rope_head_dim} must be even: RoPE rotates pairs")
        self.n_heads = n_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.attn_impl = attn_impl
        self.rope_interleave = rope_interleave
        # left to right as transformers' yarn_apply_mscale multiplies, so the float is the same
        self.scale = self.qk_head_dim**-0.5 * softmax_mscale * softmax_mscale
        # registered in transformers' order: state dicts and optimizer groups follow it
        q_width = n_heads * self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_width, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, q_width, bias=False)
        # rows [latent (kr) | k_rope (dr)]: one shared rope key per token, beside the latent
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        # rows per head [k_nope (dn) | v (dv)]
        self.kv_b_proj = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * v_head_dim, hidden_size, bias=bias)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: Documents | None = None
    ) -> torch.Tensor:
        """(B, T, C) -> (B, T, C); `rope` is the (cos, sin) of dr dims (model/rope.py `rope_cos_sin`)."""
        q, k, v, _ = self._heads(x, rope)
        exchange = self.sequence_exchange
        if exchange is not None:  # isp: this rank's tokens of all heads -> all tokens of its heads
            q, k, v = (exchange(t, scatter_dim=2, gather_dim=1) for t in (q, k, v))
        out = attend(q, k, v, documents, flash=uses_flash(self.attn_impl, x), scale=self.scale)  # (B, T, H, dv)
        if exchange is not None:
            out = exchange(out, scatter_dim=1, gather_dim=2)
        return self.o_proj(out.flatten(2))  # (B, T, C)

    def _heads(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The kernel's q, k (B, T, H, dn + dr) and v (B, T, H, dv), roped, and the normed query latent (B, T, qr;
        None without q-LoRA) that DSA's indexer reads (model/dsa.py)."""
        B, T, _ = x.shape
        dn, dr = self.qk_nope_head_dim, self.qk_rope_head_dim
        # -1 heads: under tensor parallel a rank would hold whole heads of q_b_proj and kv_b_proj
        q, q_latent = self._query(x)
        q = q.view(B, T, -1, self.qk_head_dim)  # (B, T, H, dn + dr)
        q_nope, q_rope = q.split([dn, dr], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, dr], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, -1, dn + self.v_head_dim)
        k_nope, v = kv.split([dn, self.v_head_dim], dim=-1)  # (B, T, H, dn), (B, T, H, dv)
        # the kernel saves v for backward: a view would keep all of kv alive, k_nope's H x dn included
        v = v.contiguous()
        rotate = apply_rope_interleaved if self.rope_interleave else apply_rope
        cos, sin = rope
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope[:, :, None], cos, sin)  # k_rope (B, T, 1, dr)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)  # every head's rope key
        return q, k, v, q_latent

    def muon_row_splits(self) -> dict[str, tuple[int, ...]]:
        """Per head (nope, rope) queries, (latent, rope) of the shared key, per head (nope, v): XTuner's MuonSplit."""
        heads, dn, dr, dv = self.n_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        query = "q_proj.weight" if self.q_proj is not None else "q_b_proj.weight"
        return {
            query: (dn, dr) * heads,
            "kv_a_proj_with_mqa.weight": (self.kv_lora_rank, dr),
            "kv_b_proj.weight": (dn, dv) * heads,
        }

    def _query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, H x (dn + dr)) through the normed low-rank bottleneck, and that normed latent (B, T, qr); or one
        projection without it (latent None)."""
        if self.q_proj is not None:
            return self.q_proj(x), None
        latent = self.q_a_layernorm(self.q_a_proj(x))
        return self.q_b_proj(latent), latent

    def _projections(self) -> list[nn.Linear]:
        """The projections that read the block's input or a latent, in registration order."""
        q = [self.q_proj] if self.q_proj is not None else [self.q_a_proj, self.q_b_proj]
        return [*q, self.kv_a_proj_with_mqa, self.kv_b_proj]

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """normal(0, std) for the q and kv projections; normal(0, out_std) for o_proj, which writes into the residual
        stream; biases (if any) to zero; the latent norms to ones. In this order: the seeded draws follow it."""
        for lin in self._projections():
            yield lin.weight, normal_init(std)
        yield self.o_proj.weight, normal_init(out_std)
        for lin in (*self._projections(), self.o_proj):
            if lin.bias is not None:
                yield lin.bias, nn.init.zeros_
        for norm in (self.q_a_layernorm, self.kv_a_layernorm):
            if norm is not None:
                yield from norm.param_inits()

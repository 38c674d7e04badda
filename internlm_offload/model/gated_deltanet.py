"""Gated DeltaNet, the linear-attention mixer of Qwen3-Next and Qwen3.5 (three of every four blocks), in torch.

Per value head a dk x dv state S decays by alpha_t = exp(g_t) and is corrected towards v_t along k_t (the delta
rule): S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t. Training runs the chunked
form (chunks of 64 tokens: a UT transform inside a chunk, a scan over chunks) with autograd for the backward.

Over ranks it splits by whole key-head groups (key head j with its value heads r*j .. r*j+r-1): tensor parallel
shards the fused projections' groups (`head_groups`, set by engine/tensor_parallel.py), isp exchanges the local
sequence chunk of every group for the whole sequence of this rank's groups (`sequence_exchange`, Ulysses), so the
conv and the recurrence always run on whole sequences; the conv's channels, A_log and dt_bias are taken for the
groups this rank holds.

Packed rows keep their documents apart: the causal conv's taps stop at a document's first token and the state
restarts at zero, from `Documents` (position ids restarting at 0). The rule lays every document out on its own
chunks (each padded to a multiple of the chunk size), so a chunk never straddles two documents and the state is
zeroed at the first chunk of each.
"""

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from internlm_offload.model.attention import Documents
from internlm_offload.model.fla_kernels import fla_delta_rule, run_fla
from internlm_offload.model.hooks import ExchangesSequence, SplitsHeadGroups
from internlm_offload.model.meta_trace import count_skipped_work, traced_queries
from internlm_offload.model.mlp import ParamInit, normal_init

CHUNK_SIZE = 64


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times silu(z): w * rmsnorm(o) * silu(z), one plain weight (init 1) shared by
    every head; the normalised value is cast back to the input dtype before the weight, silu(z) is fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32, or float64 in the tests
        h = x.to(wide)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(z.to(wide))).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the flash-linear-attention kernels' formula)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of x (B, T, C) with weight (C, 1, K), each tap cut at its document's first token
    (a tap reaching k tokens back counts only where the position is at least k), then SiLU."""
    K = weight.shape[-1]
    T = x.shape[1]
    padded = F.pad(x, (0, 0, K - 1, 0))  # (B, K-1+T, C); the slices below are views of it
    out = padded[:, K - 1 :] * weight[:, 0, K - 1]
    for back in range(1, K):
        tap = padded[:, K - 1 - back : K - 1 - back + T] * weight[:, 0, K - 1 - back]
        out = out + tap * (position_ids >= back).unsqueeze(-1).to(x.dtype)
    return F.silu(out)


class ChunkLayout:
    """Where each token of the flattened rows sits when every document is padded to whole chunks: `index` (N,)
    its slot, `padded` the slots in all, `resets` per chunk whether a document starts there."""

    def __init__(self, position_ids: torch.Tensor, chunk_size: int) -> None:
        starts = position_ids == 0
        if position_ids.is_meta:
            # a trace on meta (the preflight, the planner) cannot read where documents start: it takes one document
            # a row, so it misses the padding of the documents after the first (under chunk_size slots each)
            starts = torch.zeros(position_ids.shape, dtype=torch.bool, device="cpu")
        starts[:, 0] = True  # every row begins a document
        starts = starts.flatten()
        begin = starts.nonzero().flatten()  # one host sync per forward
        ends = torch.cat([begin[1:], begin.new_tensor([starts.numel()])])
        lengths = ends - begin
        padded_lengths = (lengths + chunk_size - 1) // chunk_size * chunk_size
        offsets = torch.cumsum(padded_lengths, 0) - padded_lengths
        doc = torch.cumsum(starts.long(), 0) - 1
        token = torch.arange(starts.numel(), device=starts.device)
        self.index = (offsets[doc] + (token - begin[doc])).to(position_ids.device)
        self.padded = int(padded_lengths.sum())
        resets = torch.zeros(self.padded // chunk_size, dtype=torch.bool, device="cpu")
        resets[(offsets // chunk_size).cpu()] = True
        self.resets: list[bool] = resets.tolist()

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) tokens -> (padded, ...) slots, zeros between documents."""
        return x.new_zeros((self.padded, *x.shape[1:])).index_copy(0, self.index, x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(padded, ...) slots -> (N, ...) tokens."""
        return x.index_select(0, self.index)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: list[bool],
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The gated delta rule over (H, N, d) fp32 inputs (g, beta: (H, N)), N a multiple of `chunk_size`, q and k
    L2-normalised and q scaled; the state restarts at zero on every chunk `resets` marks. Returns (H, N, dv)."""
    H, N, _ = k.shape
    dv = v.shape[-1]
    n_chunks = N // chunk_size
    q, k, v = (t.reshape(H, n_chunks, chunk_size, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(H, n_chunks, chunk_size) for t in (g, beta))
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    gamma = g.cumsum(-1)  # log of the decay from the chunk's start to each token
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # Γ_ij, j <= i
    # UT transform: (I + L) U = diag(β) V and (I + L) W = diag(β e^γ) K, L the strictly lower part of (βK)Kᵀ ⊙ Γ;
    # the solve reads only the strictly lower triangle (unitriangular)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gamma.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # within a chunk, the diagonal included
    q_decayed = q * gamma.exp().unsqueeze(-1)
    k_decayed = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # (H, n_chunks, 1, 1)
    out = DeltaScan.apply(u, w, q_decayed, attn, k_decayed, chunk_decay, resets)
    return out.reshape(H, N, dv)


def _scan_flops(H: int, c: int, dk: int, dv: int) -> tuple[int, int]:
    """The matmul FLOPs of one chunk of `DeltaScan`: its forward (W S, Q S, A V, Kᵀ V) and its backward (Aᵀ dO,
    K dS, dO Vᵀ, dO Sᵀ, V dSᵀ, dV Sᵀ, Qᵀ dO, Wᵀ dV)."""
    forward = 2 * H * (c * dk * dv * 3 + c * c * dv)
    backward = 2 * H * (c * dk * dv * 6 + c * c * dv * 2)
    return forward, backward


class DeltaScan(torch.autograd.Function):
    """The scan over chunks, per chunk i (S_i the state it starts from, zero where `resets[i]`):
    V_i = U_i - W_i S_i, O_i = Qd_i S_i + A_i V_i, S_i+1 = c_i S_i + Kd_iᵀ V_i. Returns O (H, n, c, dv).

    One autograd node for the whole scan (autograd through the loop kept one node per chunk and op, each input's
    chunk gradient a zero-filled copy of the whole input): the states and V_i go into buffers allocated before
    the loop and saved, the gradients into buffers allocated before the backward's loop, so each chunk allocates
    only its own transients, the same for every chunk. On meta (the planner's trace) both loops therefore run their
    first `meta_trace.TRACED_CHUNKS` chunks and count the rest's matmuls in one stand-in op (model/meta_trace.py)."""

    @staticmethod
    def forward(ctx, u, w, q_decayed, attn, k_decayed, chunk_decay, resets: list[bool]):
        H, n, c, dv = u.shape
        dk = w.shape[-1]
        states = u.new_zeros(H, n, dk, dv)  # S_i, each chunk's start
        v_new = torch.empty_like(u)
        out = torch.empty_like(u)
        traced = traced_queries(u, n, 1)  # on meta the first chunks
        for i in range(traced):
            state = states[:, i]
            if resets[i]:
                state.zero_()  # a document starts: nothing of the previous one carries over
            v_new[:, i] = u[:, i] - w[:, i] @ state
            out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ v_new[:, i]
            if i + 1 < n:
                states[:, i + 1] = state * chunk_decay[:, i] + k_decayed[:, i].transpose(-1, -2) @ v_new[:, i]
        forward, _ = _scan_flops(H, c, dk, dv)
        count_skipped_work(u, forward * (n - traced) - 2 * H * dk * c * dv * (traced < n))  # no S_n after the last
        ctx.save_for_backward(w, q_decayed, attn, k_decayed, chunk_decay, states, v_new)
        ctx.resets = resets
        return out

    @staticmethod
    def backward(ctx, grad_out):
        w, q_decayed, attn, k_decayed, chunk_decay, states, v_new = ctx.saved_tensors
        H, n, c, dv = v_new.shape
        dk = w.shape[-1]
        grad_u = torch.empty_like(v_new)  # dU_i = dV_i
        grad_w, grad_q, grad_k = torch.empty_like(w), torch.empty_like(q_decayed), torch.empty_like(k_decayed)
        grad_attn = torch.empty_like(attn)
        grad_decay = torch.empty_like(chunk_decay)
        grad_state = states.new_zeros(H, dk, dv)  # dS_i+1, carried backwards (S_n is not an output)
        traced = traced_queries(v_new, n, 1)
        for i in range(n - 1, n - 1 - traced, -1):
            state, d_out, v_i = states[:, i], grad_out[:, i], v_new[:, i]
            d_v = attn[:, i].transpose(-1, -2) @ d_out + k_decayed[:, i] @ grad_state
            grad_u[:, i] = d_v
            grad_attn[:, i] = d_out @ v_i.transpose(-1, -2)
            grad_q[:, i] = d_out @ state.transpose(-1, -2)
            grad_k[:, i] = v_i @ grad_state.transpose(-1, -2)
            grad_w[:, i] = -(d_v @ state.transpose(-1, -2))
            grad_decay[:, i] = (state * grad_state).sum((-1, -2), keepdim=True)
            grad_state = (
                grad_state * chunk_decay[:, i]
                + q_decayed[:, i].transpose(-1, -2) @ d_out
                - w[:, i].transpose(-1, -2) @ d_v
            )
            if ctx.resets[i]:
                grad_state.zero_()  # S_i was zero: nothing flows into the previous document
        _, backward = _scan_flops(H, c, dk, dv)
        count_skipped_work(v_new, backward * (n - traced))
        return grad_u, grad_w, grad_q, grad_attn, grad_k, grad_decay, None


class GatedDeltaNet(nn.Module, ExchangesSequence, SplitsHeadGroups):
    """Qwen3-Next / Qwen3.5 linear attention: projections to q, k, v, z, b, a; the causal conv over q, k, v; the
    chunked gated delta rule per value head (key heads shared by `n_value_heads / n_key_heads` consecutive value
    heads); the gated RMSNorm with z; the output projection.

    `fused=True` is Qwen3-Next's layout (`in_proj_qkvz`, `in_proj_ba`, grouped per key head: q, k, r value heads
    of v, of z; then b, a); `fused=False` Qwen3.5's (`in_proj_qkv` rows [Q | K | V], `in_proj_z`, `in_proj_b`,
    `in_proj_a`)."""

    def __init__(
        self,
        hidden_size: int,
        n_key_heads: int,
        n_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        *,
        conv_kernel: int = 4,
        norm_eps: float = 1e-6,
        fused: bool = True,
        chunk_size: int = CHUNK_SIZE,
        attn_impl: str = "auto",
    ) -> None:
        super().__init__()
        if n_value_heads % n_key_heads:
            raise ValueError(f"n_value_heads={n_value_heads} must be a multiple of n_key_heads={n_key_heads}")
        self.n_key_heads, self.n_value_heads = n_key_heads, n_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.key_dim, self.value_dim = n_key_heads * key_head_dim, n_value_heads * value_head_dim
        self.fused = fused
        self.chunk_size = chunk_size
        self.attn_impl = attn_impl  # "auto" / "flash": fla's kernels on cuda where installed; "sdpa": torch's ops
        conv_dim = 2 * self.key_dim + self.value_dim
        if fused:
            self.in_proj_qkvz = nn.Linear(hidden_size, conv_dim + self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * n_value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, n_value_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, n_value_heads, bias=False)
        # depthwise: one K-tap filter per channel of [Q | K | V], the checkpoints' Conv1d layout
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(n_value_heads))
        self.A_log = nn.Parameter(torch.empty(n_value_heads))
        self.norm = GatedRMSNorm(value_head_dim, norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, T, C) -> per key-head group q, k (B, T, h, dk), v, z (B, T, h * r, dv), b, a (B, T, h * r), h the
        groups this rank's projections hold: all of them, or its tensor shard (the fused projections' rows split
        evenly, -1 groups; the split in_proj_qkv's rows of its groups taken from the whole weight)."""
        B, T, _ = x.shape
        r, dk, dv = self.n_value_heads // self.n_key_heads, self.key_head_dim, self.value_head_dim
        if not self.fused:
            h, split = self.n_key_heads, self.head_groups
            if split is None:
                qkv = self.in_proj_qkv(x)
            else:  # whole on every rank: this rank's rows [Q | K | V] of its groups, its input gradient summed
                h = self.n_key_heads // split.size
                qkv = F.linear(split.local_input(x), self.group_rows(self.in_proj_qkv.weight, split.rank * h, h))
            q, k, v = qkv.split([h * dk, h * dk, h * r * dv], dim=-1)
            z, b, a = self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
            return q.view(B, T, h, dk), k.view(B, T, h, dk), v.view(B, T, -1, dv), z.view(B, T, -1, dv), b, a
        groups = self.in_proj_qkvz(x).view(B, T, -1, 2 * dk + 2 * r * dv)
        h = groups.shape[2]
        q, k, v, z = groups.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, h, 2 * r).split([r, r], dim=-1)
        v, z = v.reshape(B, T, h * r, dv), z.reshape(B, T, h * r, dv)
        return q, k, v, z, b.reshape(B, T, h * r), a.reshape(B, T, h * r)

    def exchange_groups(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """isp: this rank's sequence chunk of every key-head group -> the whole sequence of its groups (one
        all-to-all of the groups packed: q, k, v, z, b, a per key head)."""
        q, k, v, z, b, a = tensors
        B, S, Hk, _ = q.shape
        r = self.n_value_heads // self.n_key_heads
        per_group = (v, z, b.unsqueeze(-1), a.unsqueeze(-1))
        packed = torch.cat([q, k, *(t.reshape(B, S, Hk, -1) for t in per_group)], dim=-1)
        packed = self.sequence_exchange(packed, scatter_dim=2, gather_dim=1)
        T, h = packed.shape[1], packed.shape[2]
        dk, dv = self.key_head_dim, self.value_head_dim
        q, k, v, z, b, a = packed.split([dk, dk, r * dv, r * dv, r, r], dim=-1)
        v, z = v.reshape(B, T, h * r, dv), z.reshape(B, T, h * r, dv)
        return q, k, v, z, b.reshape(B, T, h * r), a.reshape(B, T, h * r)

    def own_groups(self, n_groups: int) -> int:
        """The first key-head group this rank computes (`n_groups` of them): 0 when it holds them all, else its
        tensor shard's or its isp rank's."""
        if n_groups == self.n_key_heads:
            return 0
        split = self.sequence_exchange if self.sequence_exchange is not None else self.head_groups
        if split is None or split.size * n_groups != self.n_key_heads:
            raise ValueError(f"{n_groups} of {self.n_key_heads} key-head groups here without a split that says which")
        return split.rank * n_groups

    def group_rows(self, weight: torch.Tensor, first: int, n_groups: int) -> torch.Tensor:
        """The rows of a [Q | K | V] weight (the conv's, Qwen3.5's in_proj_qkv) of key-head groups first ..
        first + n_groups - 1: their Q, K and V rows."""
        if n_groups == self.n_key_heads:
            return weight
        r, dk, dv = self.n_value_heads // self.n_key_heads, self.key_head_dim, self.value_head_dim
        q, k, v = weight.split([self.key_dim, self.key_dim, self.value_dim])
        keys = slice(first * dk, (first + n_groups) * dk)
        return torch.cat([q[keys], k[keys], v[first * r * dv : (first + n_groups) * r * dv]])

    def forward(self, x: torch.Tensor, rope: object = None, documents: Documents | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); `rope` is not read (a decoder block's mixer signature: linear attention has no
        positions beyond its conv), `documents` (the whole sequence's) keeps packed documents apart."""
        tensors = self.project(x)
        if self.sequence_exchange is not None:  # isp: all tokens of this rank's groups
            tensors = self.exchange_groups(tensors)
        q, k, v, z, b, a = tensors
        B, T, n_groups, _ = q.shape
        first = self.own_groups(n_groups)
        heads = slice(first * (self.n_value_heads // self.n_key_heads), None)
        A_log, dt_bias = (t[heads][: v.shape[2]] for t in (self.A_log, self.dt_bias))
        if documents is None:
            position_ids = torch.arange(T, device=q.device).expand(B, T)
        else:
            position_ids = documents.position_ids
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)  # [Q | K | V]
        qkv = causal_conv(qkv, self.group_rows(self.conv_weight, first, n_groups), position_ids)
        key_width = n_groups * self.key_head_dim
        q, k, v = qkv.split([key_width, key_width, qkv.shape[-1] - 2 * key_width], dim=-1)
        r = self.n_value_heads // self.n_key_heads
        # value heads r*j .. r*j+r-1 read key head j
        q = q.reshape(B * T, -1, self.key_head_dim).repeat_interleave(r, dim=1)
        k = k.reshape(B * T, -1, self.key_head_dim).repeat_interleave(r, dim=1)
        v = v.reshape(B * T, -1, self.value_head_dim)
        beta = b.sigmoid().reshape(B * T, -1)
        # the decay and the rule in fp32 (or float64 in the tests): g = -e^A softplus(a + dt_bias) <= 0
        dtype = torch.promote_types(x.dtype, torch.float32)
        g = (-A_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias)).reshape(B * T, -1)
        kernel = fla_delta_rule(self.attn_impl, x)
        if kernel is not None:
            out = run_fla(kernel, *(t.view(B, T, *t.shape[1:]) for t in (q, k, v, g, beta)), position_ids)
        else:
            out = self.torch_rule(q, k, v, g, beta, position_ids).view(B, T, -1, self.value_head_dim)
        out = self.norm(out.to(z.dtype), z)
        if self.sequence_exchange is not None:  # back: this rank's tokens of every head
            out = self.sequence_exchange(out, scatter_dim=1, gather_dim=2)
        return self.out_proj(out.flatten(2))

    def torch_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The chunked rule in torch over (N, H, d) q, k, v and (N, H) g, beta, in g's dtype: q and k L2-normalised,
        q scaled by dk^-1/2, each document on its own chunks. Returns (N, H, dv)."""
        dtype = g.dtype
        q = l2norm(q.to(dtype)) * self.key_head_dim**-0.5
        k = l2norm(k.to(dtype))
        layout = ChunkLayout(position_ids, self.chunk_size)
        q, k, v, g, beta = (layout.scatter(t.to(dtype)).transpose(0, 1) for t in (q, k, v, g, beta))
        out = chunk_gated_delta_rule(q, k, v, g, beta, layout.resets, self.chunk_size)
        return layout.gather(out.transpose(0, 1))

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """normal(0, std) for the input projections and the conv, normal(0, out_std) for out_proj; dt_bias 1,
        A_log = log U(0.01, 16) (transformers' init), the gated norm's weight 1."""
        for name in ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            lin = getattr(self, name, None)
            if lin is not None:
                yield lin.weight, normal_init(std)
        yield self.conv_weight, normal_init(std)
        yield self.out_proj.weight, normal_init(out_std)
        yield self.dt_bias, nn.init.ones_
        yield self.A_log, _log_uniform(0.01, 16.0)
        yield self.norm.weight, nn.init.ones_


def _log_uniform(low: float, high: float) -> ParamInit:
    """log of U(low, high) in place (A_log: the decay rates' logs)."""

    def init(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return t.uniform_(low, high).log_()

    return init

"""
The columns of `SCHEMES` (model.py) taken from other codebases, each the plain PyTorch of its paper's equation:
PaLM's z-loss, Gemma 2's soft caps, Kimi K2's QK-Clip, ResFormer's value residual, the x0 mix of modded-nanogpt
and nanochat, hyper-connections (Zhu et al.) with DeepSeek's mHC, gated attention (Qiu et al.), gpt-oss's learned
attention sink and Kimi's Attention Residuals. Nothing here reads a config or imports the model: model.py passes
plain values. Their reference code and readings: docs/schemes.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

# ----------------------------------------------------------------------------- logits, losses, attention scores


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft cap (Gemma Team, 2024): cap * tanh(x / cap), in float32 at least. |out| < cap, and
    out = x - x^3 / (3 cap^2) + ...: the identity to first order near 0."""
    return cap * torch.tanh(x.to(torch.promote_types(x.dtype, torch.float32)) / cap)


def z_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -1) -> torch.Tensor:
    """PaLM's auxiliary z-loss (Chowdhery et al., 2022, training setup): the mean over the targeted tokens of log(Z)^2,
    Z = sum_j exp(logit_j) the softmax's normalizer, in float32 at least (as OLMo-core computes it)."""
    log_z = torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    valid = targets != ignore_index
    return (log_z.square() * valid).sum() / valid.sum().clamp_min(1)


class QKClip(nn.Module):
    """QK-Clip of MuonClip (Kimi K2, arXiv 2507.20534): after each optimizer step, each head h whose largest
    pre-softmax logit S_h in that step's forward passes exceeded tau gets W_q and W_k (its rows of them, and of
    the biases) times sqrt(tau / S_h), so that the same inputs give it logits of at most tau; heads at or below
    tau are left untouched. `record` keeps the running max per head (causal pairs, training forwards only, every
    micro-batch of the step); `constrain_` (GPT.apply_parameter_constraints, after every step) takes it over all
    ranks, rescales and starts the next step's record. The projections are held in a tuple, not registered here."""

    def __init__(self, tau: float, n_head: int, q_proj: nn.Linear, k_proj: nn.Linear):
        super().__init__()
        self.tau, self.projections = tau, (q_proj, k_proj)
        self.register_buffer("max_logit", torch.full((n_head,), -math.inf), persistent=False)

    @torch.no_grad()
    def record(self, scores: torch.Tensor, causal: torch.Tensor) -> None:
        """Fold the largest logit of each head of `scores` (B, heads, T, T) over the causal pairs into the record."""
        top = scores.detach().float().masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))
        self.max_logit.copy_(torch.maximum(self.max_logit, top))

    @torch.no_grad()
    def forget_step(self) -> None:
        """Drop the record of a step whose update was skipped (a non-finite batch): the next step starts anew."""
        self.max_logit.fill_(-math.inf)

    @torch.no_grad()
    def constrain_(self) -> None:
        top = self.max_logit
        if dist.is_available() and dist.is_initialized() and not (top.device.type == "cpu"
                                                                 and dist.get_backend() == "nccl"):
            dist.all_reduce(top, op=dist.ReduceOp.MAX)  # (at init, on the CPU under NCCL, nothing is recorded yet)
        # a non-finite record (a batch that overflowed, skipped or diverged) leaves the weights as they are
        scale = (self.tau / top.nan_to_num(nan=self.tau, posinf=self.tau).clamp_min(self.tau)).sqrt()  # 1 at <= tau
        for proj in self.projections:
            rows = scale.repeat_interleave(proj.weight.shape[0] // scale.numel())
            proj.weight.mul_(rows[:, None].to(proj.weight.dtype))
            if proj.bias is not None:
                proj.bias.mul_(rows.to(proj.bias.dtype))
        top.fill_(-math.inf)


# ----------------------------------------------------------------------------- attention: output gate, sink

GATE_KINDS = ("headwise", "elementwise")


class AttentionGate(nn.Module):
    """Gated attention (Qiu et al., NeurIPS 2025, arXiv 2505.06708), their best placement G1: each head's attention
    output Y, before the output projection, times sigmoid(X W_theta), X the attention's input (the block's normalized
    x): Y' = Y * sigmoid(X W_theta), one gate per head ("headwise", W_theta d x heads, broadcast over the head's
    channels) or per channel ("elementwise", d x d). The sigmoid is taken in float32 at least, as OLMo-core's
    full-precision gate; W_theta is drawn as the row's other maps, so the gate starts near 1/2."""

    def __init__(self, kind: str, d: int, n_head: int, bias: bool):
        super().__init__()
        self.n_head = n_head
        self.proj = nn.Linear(d, n_head if kind == "headwise" else d, bias=bias)

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y: the heads' outputs (B, heads, T, head_dim); x: the attention's input (B, T, d)."""
        gate = torch.sigmoid(wide(self.proj(x))).to(y.dtype)  # (B, T, heads) or (B, T, d)
        return y * gate.unflatten(-1, (self.n_head, -1)).transpose(1, 2)  # (B, heads, T, 1 or head_dim)


class AttentionSink(nn.Module):
    """gpt-oss's learned attention sink: one logit s_h per head joins every query's softmax as one more key without a
    value, takes its share of the mass, and is dropped: weights exp(a_ij) / (sum_j exp(a_ij) + exp(s_h)). Computed as
    torchtitan's gpt-oss computes it, the plain attention's output times Z / (Z + e^s) = sigmoid(logsumexp_j a_ij -
    s_h): the same numbers, and at s = -inf exactly the output without a sink (sigmoid(+inf) = 1). Starts at s = 0
    (x-transformers' head_learned_sink)."""

    def __init__(self, n_head: int):
        super().__init__()
        self.logit = nn.Parameter(torch.zeros(n_head))

    def kept(self, scores: torch.Tensor) -> torch.Tensor:
        """The share of each query's mass the real keys keep, (B, heads, T, 1), from the masked scores (B, heads, T,
        T) in float32."""
        return torch.sigmoid(scores.logsumexp(-1, keepdim=True) - self.logit.view(-1, 1, 1))

    def forward(self, out: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return out * self.kept(scores).to(out.dtype)


class ValueResidual(nn.Module):
    """ResFormer's value residual (Zhou et al., arXiv 2410.17897): v_l <- lambda_l v_l + (1 - lambda_l) v_1, v_1 the
    first block's values (kept in the forward pass's `ctx`), lambda_l one learnable scalar per block from 1/2, the
    paper's fixed value (its U_n = A_n (V_n + V_1) / 2; modded-nanogpt's learned lambda also starts at 0.5). The
    first block only stores its values."""

    def __init__(self, first: bool, init: float = 0.5):
        super().__init__()
        self.first = first
        self.lam = None if first else nn.Parameter(torch.tensor(init))

    def forward(self, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        if self.lam is None:
            ctx["v1"] = v
            return v
        lam = self.lam.to(v.dtype)
        return lam * v + (1 - lam) * ctx["v1"]


def x0_mix_init(init: str, layer: int, n_layer: int) -> tuple[float, float]:
    """(lambda_resid, lambda_x0) of block `layer` (0-based) at init: the identity (1, 0), as modded-nanogpt's
    records began (2024-11-06), or with init="nanochat" nanochat's depth ramp, 1.15 -> 1.05 and 0.20 -> 0.05."""
    if init != "nanochat":
        return 1.0, 0.0
    t = layer / max(n_layer - 1, 1)
    return 1.15 - 0.10 * t, 0.20 - 0.15 * t


class X0Mix(nn.Module):
    """The residual and x0 scalars of nanochat and modded-nanogpt: before each block x <- lambda_resid x +
    lambda_x0 x0, x0 the stream as it entered the first block, both learnable scalars of this block, starting at
    `x0_mix_init` of the row's init."""

    def __init__(self, init: str, layer: int, n_layer: int):
        super().__init__()
        resid, x0 = x0_mix_init(init, layer, n_layer)
        self.resid, self.x0 = nn.Parameter(torch.tensor(resid)), nn.Parameter(torch.tensor(x0))

    def forward(self, x: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        return self.resid.to(x.dtype) * x + self.x0.to(x.dtype) * x0


# ----------------------------------------------------------------------------- Attention Residuals


class AttentionResidual(nn.Module):
    """Attention Residuals (Kimi Team, arXiv 2603.15031), the full form: residual update j reads a softmax over depth
    in place of the sum of the earlier updates,

        h_j = sum_i alpha_ij v_i,   alpha_ij = softmax_i(w_j . RMSNorm(v_i)),   i = 0..j-1

    over the sources v_0 = the embedding and v_i = the output of update i (its pre-norm, sub-layer and mid-norm; the
    keys are the values, RMS-normalized with a gain so that a large source does not win by its size), w_j a learned
    pseudo-query of update j that starts at 0 (the sources averaged); update j's output becomes source j. The stream
    is the stack of sources (B, T, S, d), so memory grows with depth (the paper's O(L d)); `read` alone is the
    aggregation before the final norm, with its own pseudo-query."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(d))  # w_j
        self.key_gain = nn.Parameter(torch.ones(d))

    def read(self, sources: torch.Tensor) -> torch.Tensor:
        """h = sum_i alpha_i v_i over the sources (B, T, S, d), the weights in float32 at least."""
        keys = F.rms_norm(wide(sources), (sources.shape[-1],), self.key_gain.to(wide(sources).dtype), self.eps)
        alpha = torch.softmax(keys @ self.query.to(keys.dtype), dim=-1)  # (B, T, S)
        return (alpha.unsqueeze(-1) * sources).sum(-2).to(sources.dtype)

    def forward(self, sources: torch.Tensor, branch: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        y = branch(self.read(sources), *args)
        return torch.cat([sources, y.to(sources.dtype).unsqueeze(-2)], dim=-2)


# ----------------------------------------------------------------------------- hyper-connections
# Hyper-connections (Zhu et al., *Hyper-Connections*, ICLR 2025, arXiv 2409.19606): n copies of the residual
# stream, H (B, T, n, d), which each residual update reads through a learned mix and writes back with learned
# weights; and DeepSeek's manifold-constrained hyper-connections (mHC, arXiv 2512.24880), whose stream-mixing
# matrix is kept doubly stochastic. For one residual update with branch f (the row's pre-norm, sub-layer and
# mid-norm):
#
#     h  = sum_s read_s H_s                  HC: A_m^T H          mHC: H_pre x
#     H' = mix H + write f(h)                HC: A_r^T H + B^T f   mHC: H_res x + H_post^T f
#
# `expand` makes the n copies of the embedding before the first block, `reduce` sums them after the last (the
# paper's "sum of the rows", before the final norm). With n = 1 and the identity init (read 1, mix 1, write 1)
# static and dynamic are exactly the row's x + f(x); mHC's read is a sigmoid and cannot start at 1 (below).
# Every coefficient vector is stored 1-D and so never weight-decayed (optim.split_params); the dynamic
# projections are matrices and are decayed like the embeddings, toward the static connection.

KINDS = ("static", "dynamic", "mhc")
SINKHORN_ITERS = 20  # mHC's t_max: alternating normalizations per projection
GATE_INIT = 0.01  # HC's s_alpha, s_beta and mHC's alpha gates start here (lucidrains' and x-transformers' 1e-2)


def expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T, d) -> (B, T, n, d): n copies of the stream (a view; every update writes a new tensor)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])


def reduce(x: torch.Tensor) -> torch.Tensor:
    """(B, T, n, d) -> (B, T, d): the streams summed (Zhu et al. §3: the last hidden matrix summed row-wise)."""
    return x.sum(-2)


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32 at least (a bf16 coefficient under autocast)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def sinkhorn_knopp(logits: torch.Tensor, iters: int = SINKHORN_ITERS) -> torch.Tensor:
    """mHC's projection of (..., n, n) logits onto the doubly stochastic matrices (Sinkhorn-Knopp): exp, then
    alternately every column and every row scaled to sum 1. Done on the logarithms (each scaling subtracts a
    logsumexp), which is the same map: exp then divide would underflow to a column of zeros, and 0/0, once a
    matrix's logits span more than ~100 (seen at rate 3e-2). It ends on the rows: they sum to 1 to rounding, the
    columns to the method's convergence."""
    log_m = wide(logits)
    for _ in range(iters):
        log_m = log_m - log_m.logsumexp(-2, keepdim=True)
        log_m = log_m - log_m.logsumexp(-1, keepdim=True)
    return log_m.exp()


def hyper_update(H: torch.Tensor, read: torch.Tensor, mix: torch.Tensor, write: torch.Tensor,
                 branch: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """One residual update on the streams H (..., n, d): read (..., n), mix (..., n_out, n_in), write (..., n).
    Elementwise products and sums (no matmul): the stream keeps its dtype under autocast, and at n = 1 every
    coefficient 1 multiplies exactly."""
    h = (read.unsqueeze(-1) * H).sum(-2)
    y = branch(h, *args)
    return (mix.unsqueeze(-1) * H.unsqueeze(-3)).sum(-2) + write.unsqueeze(-1) * y.unsqueeze(-2)


class HyperConnection(nn.Module):
    """The connection of residual update k (0-based over all the blocks' attention and MLP updates).

    static (Zhu et al., SHC): learned A_m (read), B (write) and A_r (stream mix), starting at the paper's
    Pre-Norm-equivalent init e_(k mod n), 1 and I, so that update k reads stream k mod n.
    dynamic (Zhu et al., DHC): those plus s_alpha tanh(norm(H) W_m), s_beta tanh(norm(H) W_beta), s_alpha tanh(norm(H)
    W_r), per token and stream; W starts at 0 and s_alpha, s_beta at GATE_INIT; norm is a parameter-free RMSNorm
    (the paper's is a LayerNorm, whose gain W absorbs).
    mhc (mHC): from the RMS-normalized flattened streams x (n d), H_pre = sigmoid(a_pre x phi_pre + b_pre),
    H_post = 2 sigmoid(a_post x phi_post + b_post), H_res = Sinkhorn-Knopp(a_res x phi_res + b_res); phi starts at 0,
    the gates a at GATE_INIT, b_pre at e_(k mod n) and b_res at I (as lucidrains' mHC), b_post at 0 so that H_post
    starts at HC's B = 1. H_pre = sigmoid(1) = 0.73 on the read stream cannot be 1: with n = 1, mhc reads 0.73 x
    (a pre-norm removes that scale up to its eps).
    """

    def __init__(self, kind: str, n: int, d: int, k: int, eps: float):
        super().__init__()
        self.kind, self.n, self.eps = kind, n, eps
        first = F.one_hot(torch.tensor(k % n), n).float()  # e_(k mod n)
        identity = torch.eye(n).flatten()
        if kind == "mhc":
            self.bias = nn.Parameter(torch.cat([first, torch.zeros(n), identity]))  # b_pre, b_post, b_res
            self.proj = nn.Parameter(torch.zeros(n * d, 2 * n + n * n))  # phi_pre, phi_post, phi_res
            self.gates = nn.Parameter(torch.full((3,), GATE_INIT))  # a_pre, a_post, a_res
        else:
            self.static = nn.Parameter(torch.cat([first, torch.ones(n), identity]))  # A_m, B, A_r
            if kind == "dynamic":
                self.proj = nn.Parameter(torch.zeros(d, 2 + n))  # W_m, W_beta, W_r
                self.gates = nn.Parameter(torch.full((2,), GATE_INIT))  # s_alpha, s_beta

    def coefficients(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """read (..., n), mix (..., n_out, n_in) and write (..., n) for the streams H (B, T, n, d); static: no
        batch dimensions."""
        n = self.n
        if self.kind == "mhc":
            x = F.rms_norm(H.flatten(-2), (H.shape[-2] * H.shape[-1],), eps=self.eps)
            c = wide(x @ self.proj.to(x.dtype))
            read = torch.sigmoid(self.gates[0] * c[..., :n] + self.bias[:n])
            write = 2 * torch.sigmoid(self.gates[1] * c[..., n:2 * n] + self.bias[n:2 * n])
            mix = sinkhorn_knopp((self.gates[2] * c[..., 2 * n:] + self.bias[2 * n:]).unflatten(-1, (n, n)))
            return read, mix, write
        read, write, mix = self.static[:n], self.static[n:2 * n], self.static[2 * n:].view(n, n)
        if self.kind == "dynamic":
            h = F.rms_norm(H, (H.shape[-1],), eps=self.eps)
            c = wide(torch.tanh(h @ self.proj.to(H.dtype)))  # (B, T, n, 2 + n)
            read = read + self.gates[0] * c[..., 0]
            write = write + self.gates[1] * c[..., 1]
            mix = mix + self.gates[0] * c[..., 2:]
        return read, mix.transpose(-2, -1), write  # HC's A_r[s, t] takes stream s to stream t: mix = A_r^T

    def forward(self, H: torch.Tensor, branch: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        return hyper_update(H, *self.coefficients(H), branch, *args)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, n={self.n}"


# ----------------------------------------------------------------------------- which rows each column fits


def check_columns(s, hypersphere: bool) -> None:
    """The values of these columns in a scheme `s` (model.Scheme) and the rows they fit; hypersphere: nGPT's."""
    for key, bad, need in [(k, getattr(s, k) is not None and not getattr(s, k) > 0, "positive, or None (off)")
                           for k in ("logit_softcap", "attn_softcap", "qk_clip")] + [
            ("z_loss", not 0 <= s.z_loss < math.inf, "a finite weight >= 0 (0: off)"),
            ("residual_streams", s.residual_streams < 1, ">= 1 (1: one stream, off)")]:
        if bad:
            raise ValueError(f"{key}={getattr(s, key)} must be {need}")
    hyper_on = s.hyper_connections != "none"
    if s.residual_streams > 1 and not hyper_on:
        raise ValueError(f"residual_streams={s.residual_streams} needs hyper_connections (static, dynamic or mhc)")
    if hyper_on and (s.combine != "add" or s.normalizes("post", "post_attn") or s.first_blocks == "post"):
        raise ValueError("hyper_connections replace the residual add: give them a row with combine='add' and no post "
                         "norm (as pre, peri, sandwich, dnt, lns)")
    if s.qk_clip is not None and s.normalizes("qk", "qk_all", "qkv", "k"):
        raise ValueError("qk_clip rescales W_q and W_k, which a q/k norm undoes: give it a row without qk norms")
    if s.combine == "attn_res" and (s.normalizes("post", "post_attn") or s.first_blocks == "post" or s.x0_mix):
        raise ValueError("combine='attn_res' reads every earlier update's output in place of the stream: give it a row "
                         "with no post norm (as pre, peri, sandwich, dnt, lns) and no x0_mix")
    if hypersphere and (hyper_on or s.attn_softcap or s.qk_clip or s.value_residual or s.x0_mix or s.attn_sink
                        or s.attn_gate != "none" or s.normalizes("k", "v")):
        raise ValueError("combine='nlerp' (nGPT) keeps its stream and attention on the sphere: it takes none of "
                         "hyper_connections, attn_softcap, qk_clip, value_residual, x0_mix, attn_gate, attn_sink and "
                         "the norms k, v")

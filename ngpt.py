"""
nGPT (Loshchilov et al., ICLR 2025) keeps the residual stream and every weight vector along the
embedding axis at unit L2 norm; learned scalings (alpha, s_qk, s_u, s_v, s_z) restore the ranges
that normalization takes away. Checked against the paper and NVIDIA/ngpt's model.py and train.py;
where they differ, the docstrings below say which one is followed and why it does not matter.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.nn import functional as F

from fused import fast_normalized_lerp, fast_unit_norm, fused
from layers import apply_rope, register_rope, softmax_scale


def unit_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """nGPT's Norm: x / ||x|| over the last axis, no gain; the floor eps only guards a zero vector (`F.normalize`)."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


def normalized_lerp(h: torch.Tensor, y: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """nGPT's residual update (eq. 10, 11): h <- Norm(h + alpha (Norm(y) - h)), in h's dtype (a bf16 sub-layer
    output under autocast is normalized in float32)."""
    return unit_norm(h + alpha * (unit_norm(y.to(h.dtype), eps) - h), eps)


def unit(x: torch.Tensor) -> torch.Tensor:
    """`unit_norm` with the floor 1e-12 (`F.normalize`'s), as nGPT's modules apply it."""
    return fused(fast_unit_norm, unit_norm, x, 1e-12)


@torch.no_grad()
def unit_(weight: torch.Tensor, dim: int) -> None:
    """Scale the weight's vectors along `dim` to unit norm in place (`F.normalize`'s division, without its
    temporaries): the constraint `SphereLinear` and `SphereEmbedding` restore after every step."""
    weight.div_(torch.linalg.vector_norm(weight, dim=dim, keepdim=True).clamp_min_(1e-12))


class LearnedScale(nn.Module):
    """A learnable vector in nGPT's parameterization (§2.5): stored as `scale` and read as
    stored * init / scale, so it starts at `init` and an Adam step of size lr moves it by
    lr * init / scale (scale 1/sqrt(d) lets alpha, s_qk and s_z move as fast as the unit weights)."""

    def __init__(self, size: int, init: float, scale: float):
        super().__init__()
        self.init, self.scale = init, scale
        self.param = nn.Parameter(torch.full((size,), float(scale)))

    def forward(self) -> torch.Tensor:
        return self.param * (self.init / self.scale)

    def extra_repr(self) -> str:
        return f"size={self.param.numel()}, init={self.init:.4g}, scale={self.scale:.4g}"


class SphereLinear(nn.Linear):
    """A linear map whose weight vectors along the embedding axis have unit norm (nGPT §2.6), so a map
    that reads the unit stream outputs cosines. `unit_dim` is the weight's axis of length n_embd: 1 for
    maps that read the stream (q, k, v and the MLP's inputs: unit rows), 0 for maps that write it
    (out_proj and the MLP's proj: unit columns), as NVIDIA/ngpt's `normalize_matrices` does.
    `constrain_` restores the norms; `GPT.apply_parameter_constraints` calls it at init and after
    every optimizer step. Biases (off in the paper) are left as they are."""

    def __init__(self, in_features: int, out_features: int, bias: bool, unit_dim: int):
        super().__init__(in_features, out_features, bias=bias)
        self.unit_dim = unit_dim

    def forward(self, x: torch.Tensor, out_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b), each output multiplied by its entry of `out_scale` (nGPT's s_u, s_v, s_z). The scale
        is applied to W's rows (and b) instead of to the output: (x W^T) s = x (s W)^T, the same values and
        gradients, from a product over the weight's out x in entries instead of over every token's outputs."""
        if out_scale is None:
            return super().forward(x)
        bias = None if self.bias is None else self.bias * out_scale
        return F.linear(x, self.weight * out_scale[:, None], bias)

    @torch.no_grad()
    def constrain_(self) -> None:
        unit_(self.weight, self.unit_dim)


class SphereEmbedding(nn.Embedding):
    """An embedding table with unit rows (nGPT §2.1), restored by `constrain_` like `SphereLinear`."""

    @torch.no_grad()
    def constrain_(self) -> None:
        unit_(self.weight, 1)


class SphereHead(SphereLinear):
    """nGPT's output head (§2.1, eq. 3): unit rows make the logits cosines in [-1, 1]; a learned scale
    per vocabulary entry, s_z (init 1, scale 1/sqrt(d)), gives them back a usable temperature."""

    def __init__(self, n_embd: int, vocab_size: int):
        super().__init__(n_embd, vocab_size, bias=False, unit_dim=1)
        self.s_z = LearnedScale(vocab_size, 1.0, n_embd**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x, self.s_z())


class NormalizedLerp(nn.Module):
    """nGPT's residual update (eq. 10, 11): step from h toward the sub-layer's normalized output by a
    learned amount per channel (the eigen learning rates alpha_A, alpha_M), then back onto the sphere:

        h <- Norm(h + |alpha| * (Norm(y) - h))        alpha: init 0.05, scale 1/sqrt(d)

    alpha enters as |alpha|, as in NVIDIA/ngpt's model.py (the paper asks for alpha > 0). That code also
    normalizes h before the step ("normally not needed": h is a unit vector already, as the embeddings
    are unit rows and every update ends in Norm); the paper does not, and neither does this (one
    normalization fewer per update). With learned positions (not in the paper) the first update starts
    from token + position, of norm near sqrt(2), and ends on the sphere like every other.
    """

    def __init__(self, dim: int, alpha_init: float, alpha_scale: float):
        super().__init__()
        self.alpha = LearnedScale(dim, alpha_init, alpha_scale)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return fused(fast_normalized_lerp, normalized_lerp, x, y, self.alpha().abs().to(x.dtype), 1e-12)


class SphereAttention(nn.Module):
    """nGPT's attention (§2.3.2): q, k, v and out are unit-norm maps; after RoPE, q and k are put on the
    unit sphere per head and multiplied by s_qk (eq. 15, 16: a vector of d_k per head, init 1, scale
    1/sqrt(d)); the row's attn_scale "sqrt(d)" replaces 1/sqrt(d_k) for these unit vectors.

    s_qk acts after RoPE, as in NVIDIA/ngpt (the paper's equations leave RoPE out). That code rotates
    adjacent channel pairs, `apply_rope` the two halves: the same model up to a fixed permutation of
    each head's channels. qk_norm=False drops the normalization and s_qk (the paper's Table 6 ablation).
    """

    def __init__(self, n_embd: int, n_head: int, bias: bool, qk_norm: bool, attn_scale: str, dropout: float,
                 rope_length: int | None = None, rope_base: float = 10000.0):
        super().__init__()
        d, self.n_head = n_embd, n_head
        self.head_dim = d // n_head
        self.q_proj, self.k_proj, self.v_proj = (SphereLinear(d, d, bias, unit_dim=1) for _ in range(3))
        self.out_proj = SphereLinear(d, d, bias, unit_dim=0)
        self.s_qk = LearnedScale(d, 1.0, d**-0.5) if qk_norm else None
        self.scale = softmax_scale(attn_scale, self.head_dim)
        self.dropout = dropout
        self.rope = rope_length is not None  # RoPE tables for rope_length positions; None: no RoPE
        if self.rope:
            register_rope(self, self.head_dim, rope_length, rope_base)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values, (B, heads, T, head_dim), as the softmax sees them."""
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.rope:
            q = apply_rope(q, self.rope_cos, self.rope_sin)
            k = apply_rope(k, self.rope_cos, self.rope_sin)
        if self.s_qk is not None:
            s_qk = self.s_qk().view(self.n_head, 1, self.head_dim).to(q.dtype)  # one vector per head
            q, k = unit(q) * s_qk, unit(k) * s_qk
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class SphereMLP(nn.Module):
    """nGPT's MLP (§2.4.2): unit-norm maps, and u <- s_u * sqrt(d) * u, v <- s_v * sqrt(d) * v before
    u * SiLU(v) (s_u, s_v init 1, scale 1). The sqrt(d) lifts v, a cosine of order 1/sqrt(d), out of
    SiLU's near-linear range.

    The sqrt(d) on u is NVIDIA/ngpt's (its s_uv times sqrt(n_embd) multiplies u and v); the paper's eq. 20
    has u <- s_u * u. Without biases (nGPT has none) the two are one model: the MLP's output is used only
    after Norm (eq. 11), which makes it 0-homogeneous in u. With `bias=True` (an option of this project)
    they differ, through the output projection's bias, and this follows the released code. With
    mlp="gelu" or "relu2" (not in nGPT) the one input map feeds the nonlinearity and takes v's scaling.
    """

    def __init__(self, n_embd: int, hidden: int, bias: bool, swiglu: bool, act: Callable | None = None):
        super().__init__()
        d, self.swiglu, self.act = n_embd, swiglu, act or F.gelu  # act: the one-matrix MLP's nonlinearity
        self.fc = SphereLinear(d, hidden, bias, unit_dim=1)  # u (GELU: the nonlinearity's input)
        self.gate = SphereLinear(d, hidden, bias, unit_dim=1) if swiglu else None  # v
        self.proj = SphereLinear(hidden, d, bias, unit_dim=0)
        self.s_u = LearnedScale(hidden, 1.0, 1.0) if self.swiglu else None
        self.s_v = LearnedScale(hidden, 1.0, 1.0)
        self.sqrt_d = math.sqrt(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v_scale = self.s_v() * self.sqrt_d
        if not self.swiglu:
            return self.proj(self.act(self.fc(x, v_scale)))
        return self.proj(self.fc(x, self.s_u() * self.sqrt_d) * F.silu(self.gate(x, v_scale)))

"""
GeoNorm's geodesic step and RMSNorm as single autograd nodes with backwards written by hand.

Autograd through a chain of eager ops saves every intermediate and makes a pass over the tensor
for each op and each op's gradient; on a CPU, where these elementwise passes are memory bound and
nothing fuses them, that made GeoNorm's step and QK-norm the slowest parts of their schemes. Each
node here computes its reductions once and builds each gradient in a few passes. model.py uses
them (`GeodesicStep`, `RMSNorm`, `HeadwiseRMSNorm`); tests/test_speed_paths.py checks forward and
gradients against the plain formulas, in float64 and with gradcheck.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable


class RMSNormFunction(torch.autograd.Function):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, as one autograd node.

    On a CPU torch's rms_norm is a chain of eager ops whose backward makes a dozen passes over x
    and allocates as many tensors; this makes three passes forward and six backward, and the
    backward allocates one tensor, its output. It runs in x's dtype with the weight cast to it, so
    a bf16 input under autocast stays on bf16 kernels (torch's rms_norm falls back to a slower,
    mixed-dtype path); reductions accumulate in float32 inside torch's kernels. `weight` has x's
    last dim (one gain per channel) or its last two (HeadwiseRMSNorm: (n_head, head_dim)).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps)).to(x.dtype)
        out = x * rstd
        out.mul_(weight.to(x.dtype))
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        w = weight.to(x.dtype)
        gx = grad * x  # summed over channels: <g w, x>; over tokens, scaled by rstd: the weight's gradient
        with torch.autocast(x.device.type, enabled=False):
            if w.dim() == 1:  # two matrix-vector products, no temporaries
                dot = (gx @ w).unsqueeze(-1)
                grad_weight = rstd.flatten() @ gx.flatten(0, -2)
            else:
                dot = torch.linalg.vecdot(gx, w).unsqueeze(-1)
                grad_weight = (gx * rstd).reshape(-1, *w.shape).sum(0)
        # dx = rstd g w - rstd^3 <g w, x> x / d, written over gx
        grad_x = torch.mul(grad, w, out=gx).mul_(rstd).addcmul_(x, rstd.pow(3).mul_(dot).div_(-x.shape[-1]))
        return grad_x, grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None, None


class GeodesicTerms(NamedTuple):
    """Per-token quantities of one geodesic step; every field but `v` has shape (..., 1)."""

    x_norm: torch.Tensor  # ||x||
    radius: torch.Tensor  # ||x|| clamped below at 1e-6
    dot: torch.Tensor  # <x, s>
    v: torch.Tensor  # the tangent component of s at x, shape (..., d)
    v_norm_raw: torch.Tensor  # ||v||
    v_norm: torch.Tensor  # ||v|| clamped below at 1e-8
    ratio: torch.Tensor  # ||v|| / ||x||, the angle eq. 3 would take
    scaled: torch.Tensor  # (a * min(ratio, c) + b) * decay, before the final clamp
    theta: torch.Tensor  # the applied angle theta'


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """<a, b> over the last dim, kept as size 1: a batched matrix-vector product (no a * b
    temporary), in the inputs' dtype whatever autocast says."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).squeeze(-1)


def geodesic_terms(x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   decay: float, clamp: float) -> GeodesicTerms:
    """Tangent, its norm and the applied angle of GeoNorm eq. 5 (see `GeodesicStep`), in the wider
    dtype of x and s (a bf16 sub-layer output meets a float32 stream under autocast)."""
    x = x.to(torch.promote_types(x.dtype, s.dtype))
    s_wide = s.to(x.dtype)
    x_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    radius = x_norm.clamp_min(1e-6)
    dot = row_dot(x, s_wide)
    q = dot / radius.square()
    # v = s - <x,s>/||x||^2 x, written over s_wide when that is already a copy of s
    v = s_wide.addcmul_(x, -q) if s_wide is not s else torch.addcmul(s, x, -q)
    v_norm_raw = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    v_norm = v_norm_raw.clamp_min(1e-8)
    ratio = v_norm / radius
    scaled = torch.addcmul(b, a, ratio.clamp_max(clamp)).mul_(decay)
    return GeodesicTerms(x_norm, radius, dot, v, v_norm_raw, v_norm, ratio, scaled, scaled.clamp(-clamp, clamp))


class GeodesicStepFunction(torch.autograd.Function):
    """GeoNorm eq. 5 as one autograd node with a backward written by hand.

    It makes six passes over the stream forward (two norms, one dot product, the tangent, the output
    in two) and eight backward (the dot products <g,x> and <g,v>, then each gradient as a combination
    of g, v and x in three), and saves x, v and per-token scalars only: about half the time of
    autograd through the same ops on a CPU, which saves and re-reads every intermediate.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                decay: float, clamp: float) -> torch.Tensor:
        t = geodesic_terms(x, s, a, b, decay, clamp)
        cos, sin = torch.cos(t.theta), torch.sin(t.theta)
        step = t.radius * sin / t.v_norm  # x_new = cos(theta') x + step v
        out = x * cos
        out.addcmul_(t.v, step)
        ctx.dtypes, ctx.decay, ctx.clamp = (x.dtype, s.dtype), decay, clamp
        ctx.save_for_backward(x.to(out.dtype), a, cos, sin, step, *t)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, a, cos, sin, step, x_norm, radius, dot, v, v_norm_raw, v_norm, ratio, scaled, theta = ctx.saved_tensors
        decay, clamp = ctx.decay, ctx.clamp
        grad = grad.to(x.dtype)
        grad_x_dot, grad_v_dot = row_dot(grad, x), row_dot(grad, v)
        # back through theta' = clamp((a min(ratio, c) + b) decay, -c, c) and ratio = ||v|| / ||x||
        d_theta = (radius * cos / v_norm * grad_v_dot - sin * grad_x_dot) * (scaled.abs() <= clamp)
        d_ratio = d_theta * decay * a * (ratio <= clamp)
        d_v_norm = (d_ratio / radius - grad_v_dot * step / v_norm) * (v_norm_raw >= 1e-8)
        d_radius = grad_v_dot * sin / v_norm - d_ratio * ratio / radius
        v_coef = (d_v_norm / v_norm_raw).masked_fill(v_norm_raw == 0, 0)  # grad of ||v|| is v / ||v||
        # back through v = s - q x with q = <x,s> / ||x||^2; <v, x> = <x,s> - q ||x||^2
        q = dot / radius.square()
        d_q = -(step * grad_x_dot + v_coef * (dot - q * x_norm.square()))
        d_dot = d_q / radius.square()
        d_radius = (d_radius - 2 * q * d_q / radius) * (x_norm >= 1e-6)
        x_coef = (d_radius / x_norm).masked_fill(x_norm == 0, 0)
        # ds = step g + v_coef v + d_dot x;  dx = cos g - q ds + d_dot s + x_coef x, with s = v + q x
        grad_s = grad * step
        grad_s.addcmul_(v, v_coef).addcmul_(x, d_dot)
        grad_x = grad * (cos - q * step)
        grad_x.addcmul_(v, d_dot - q * v_coef).addcmul_(x, d_dot * q + x_coef)
        d_scaled = d_theta * decay
        grad_a = (d_scaled * ratio.clamp_max(clamp)).sum().to(a.dtype) if ctx.needs_input_grad[2] else None
        grad_b = d_scaled.sum().to(a.dtype) if ctx.needs_input_grad[3] else None
        return grad_x.to(ctx.dtypes[0]), grad_s.to(ctx.dtypes[1]), grad_a, grad_b, None, None

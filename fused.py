"""
Hand-written autograd nodes for the CPU: each computes one primitive of layers.py or ngpt.py (RMSNorm,
nGPT's unit norm and residual update, DyT/Derf, GeoNorm's geodesic step) with its backward pass written
out, and `fused` picks between a node and its plain formula. The math lives with the plain formulas;
here is only how to compute it fast. tests/test_fused.py checks each node against its formula: the
forward, gradcheck in float64, and autograd's gradients of the formula.

Why: autograd through a chain of eager ops saves every intermediate and makes a pass over the tensor
for each op and each op's gradient; on a CPU, where these elementwise passes are memory bound and
nothing fuses them, that made GeoNorm's step and QK-norm the slowest parts of their schemes. Each node
computes its reductions once and builds each gradient in a few passes (docs/speed.md).

This module imports nothing of the project's: layers.py and ngpt.py import it, never the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable


def fused(fast: Callable[..., torch.Tensor], plain: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """`fast(*args)`, a node with its hand-written backward, in eager mode; under torch.compile `plain(*args)`,
    the same math in plain ops, whose backward inductor derives and fuses by itself. (A traced
    autograd.Function that writes its output in place gets its gradient routed to the wrong input in torch
    2.11, pytorch/pytorch#180642: compiled GeoNorm and nGPT gradients were wrong on a GPU. Plain ops leave
    nothing of the kind to trace.)"""
    return plain(*args) if torch.compiler.is_compiling() else fast(*args)


def row_dot(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """<a, b> over the last dim, kept as size 1 (a multiply and a sum, as `vecdot`). `scratch`, a tensor
    of a's shape and dtype whose contents may be lost, takes the products instead of a new tensor: a
    buffer written again soon after is still in cache, a fresh one is not."""
    return torch.mul(a, b, out=scratch).sum(-1, keepdim=True)


# ----------------------------------------------------------------------------- RMSNorm


class RMSNormFunction(torch.autograd.Function):
    """layers.rms_norm: x / sqrt(mean(x^2) + eps) * weight over the last dim, as one autograd node.

    On a CPU torch's rms_norm is a chain of eager ops whose backward makes a dozen passes over x
    and allocates as many tensors; this makes three passes forward and six backward, and the
    backward allocates one tensor, its output. It runs in x's dtype with the weight cast to it, so
    a bf16 input under autocast stays on bf16 kernels (torch's rms_norm falls back to a slower,
    mixed-dtype path); reductions accumulate in float32 inside torch's kernels. `weight` has x's
    last dim (one gain per channel) or its last two (HeadwiseRMSNorm: (n_head, head_dim)); None
    leaves the gain out (two passes fewer backward).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps)).to(x.dtype)
        out = x * rstd
        if weight is not None:
            out.mul_(weight.to(x.dtype))
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        gx = grad * x  # summed over channels: <g w, x>; over tokens, scaled by rstd: the weight's gradient
        if weight is None:  # dx = rstd g - rstd^3 <g, x> x / d: two passes fewer, no weight gradient
            coef = rstd.pow(3).mul_(gx.sum(-1, keepdim=True)).div_(-x.shape[-1])
            return torch.mul(grad, rstd, out=gx).addcmul_(x, coef), None, None
        w = weight.to(x.dtype)
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


def fast_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


# ----------------------------------------------------------------------------- nGPT


class UnitNormFunction(torch.autograd.Function):
    """ngpt.unit_norm: x / max(||x||, eps) over the last dim (`F.normalize`, nGPT's Norm) as one autograd node.

    With u = x / ||x||, the gradient is (g - <g, u> u) / ||x||: the component of g along u is dropped
    (u does not change when x is scaled). Below the eps floor x / eps is linear and g / eps passes
    unprojected. Forward: a norm and a scaling; backward: a dot product and two passes, against the
    eight or so of autograd through `F.normalize`. Only u and the per-token 1 / ||x|| are saved.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        inverse = norm.clamp_min(eps).reciprocal()
        out = x * inverse
        ctx.save_for_backward(out, inverse, norm >= eps)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        out, inverse, above_floor = ctx.saved_tensors
        return unit_backward(grad.to(out.dtype), out, inverse, above_floor), None


def unit_backward(grad: torch.Tensor, u: torch.Tensor, inverse: torch.Tensor,
                  above_floor: torch.Tensor) -> torch.Tensor:
    """The gradient through u = x / max(||x||, eps), from u, 1 / max(||x||, eps) and ||x|| >= eps."""
    out = torch.empty_like(grad)  # takes the dot product's products first (see `row_dot`)
    along = row_dot(grad, u, out) * above_floor
    return torch.addcmul(grad, u, along, value=-1, out=out).mul_(inverse)


def fast_unit_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return UnitNormFunction.apply(x, eps)


class NormalizedLerpFunction(torch.autograd.Function):
    """ngpt.normalized_lerp: Norm(h + w (Norm(y) - h)) (nGPT eq. 10, 11; w the per-channel |alpha|) as one
    autograd node, in h's dtype (a bf16 sub-layer output under autocast is normalized in float32).

    With n = Norm(y), m = h + w (n - h) and u = Norm(m) the output: grad_m = (g - <g,u> u) / ||m|| as in
    `UnitNormFunction`, then grad_h = (1 - w) grad_m, grad_w = sum over tokens of grad_m (n - h), and
    grad_y is w grad_m taken back through Norm(y) the same way. Saves h, n and u. Against the chain it
    replaces (`lerp` between two `UnitNormFunction`s, Norm(y) cast to h's dtype) it makes one pass fewer
    forward and as many backward, keeps one copy of n instead of two, and computes Norm(y) in float32
    where the chain took it in bf16 (which CPU kernels run no faster).
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        y_norm = torch.linalg.vector_norm(y, dim=-1, keepdim=True, dtype=h.dtype)
        y_inverse = y_norm.clamp_min(eps).reciprocal()
        n = torch.mul(y, y_inverse)  # in h's dtype, which y_inverse has
        out = torch.lerp(h, n, w)
        m_norm = torch.linalg.vector_norm(out, dim=-1, keepdim=True)
        m_inverse = m_norm.clamp_min(eps).reciprocal()
        out.mul_(m_inverse)
        ctx.y_dtype = y.dtype
        ctx.save_for_backward(h, n, out, w, y_inverse, m_inverse, y_norm >= eps, m_norm >= eps)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        h, n, out, w, y_inverse, m_inverse, y_above, m_above = ctx.saved_tensors
        grad_m = unit_backward(grad.to(out.dtype), out, m_inverse, m_above)
        grad_h = grad_m * (1 - w)
        grad_w = torch.sub(n, h).mul_(grad_m).flatten(0, -2).sum(0) if ctx.needs_input_grad[2] else None
        grad_y = unit_backward(grad_m.mul_(w), n, y_inverse, y_above)
        return grad_h, grad_y.to(ctx.y_dtype), grad_w, None


def fast_normalized_lerp(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return NormalizedLerpFunction.apply(h, y, w, eps)


# ----------------------------------------------------------------------------- DyT and Derf


class SquashFunction(torch.autograd.Function):
    """layers.dyt and layers.derf: weight * f(alpha * x + shift) + bias, f = tanh or erf, as one autograd node.

    Autograd through the chain of eager ops saves three tensors of x's size for Derf (x, z and erf(z))
    and allocates a new one for each of its nine passes backward, five of them for erf's gradient (a
    square, a negation, an exponential, two products). This node saves x and f(z) only, recomputes z
    for Derf, writes most of its backward passes in place, and takes alpha's gradient as one dot
    product (no temporary). It computes where the formula would: in x's dtype up to f(z),
    then promoted by the float32 weight.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: torch.Tensor, shift: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None, erf: bool) -> torch.Tensor:
        squashed = SquashFunction.argument(x, alpha, shift)
        squashed = squashed.erf_() if erf else squashed.tanh_()
        ctx.erf = erf
        ctx.save_for_backward(x, alpha, shift, weight, bias, squashed)
        return squashed * weight if bias is None else torch.addcmul(bias, squashed, weight)

    @staticmethod
    def argument(x: torch.Tensor, alpha: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
        """z = alpha * x + shift, in two passes: addcmul with two 0-dim operands takes a slower, unvectorized path."""
        z = x * alpha
        return z if shift is None else z.add_(shift)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, alpha, shift, weight, bias, squashed = ctx.saved_tensors
        rows = (-1, x.shape[-1])
        grad_weight = (grad * squashed).reshape(rows).sum(0)
        grad_bias = grad.reshape(rows).sum(0) if bias is not None else None
        if ctx.erf:  # erf'(z) = 2/sqrt(pi) exp(-z^2), the constant folded into the weight
            grad_f = (grad * (weight * (2 / math.sqrt(math.pi)))).to(x.dtype)
            grad_z = SquashFunction.argument(x, alpha, shift).square_().neg_().exp_().mul_(grad_f)
        else:  # tanh'(z) = 1 - tanh(z)^2, from the saved tanh(z) in one pass
            grad_z = torch.ops.aten.tanh_backward((grad * weight).to(x.dtype), squashed)
        wide = torch.promote_types(x.dtype, torch.float32)  # alpha's gradient sums every entry: not in bf16
        with torch.autocast(x.device.type, enabled=False):
            grad_alpha = torch.dot(grad_z.flatten().to(wide), x.flatten().to(wide))
        grad_shift = grad_z.sum().to(shift.dtype) if shift is not None else None
        return (grad_z.mul_(alpha.to(x.dtype)), grad_alpha.to(alpha.dtype), grad_shift,
                grad_weight.to(weight.dtype), grad_bias.to(bias.dtype) if bias is not None else None, None)


def fast_dyt(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return SquashFunction.apply(x, alpha, None, weight, bias, False)


def fast_derf(x: torch.Tensor, alpha: torch.Tensor, shift: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    return SquashFunction.apply(x, alpha, shift, weight, bias, True)


# ----------------------------------------------------------------------------- GeoNorm's geodesic step


class GeodesicTerms(NamedTuple):
    """Per-token quantities of one geodesic step; every field but `v` has shape (..., 1)."""

    x_norm: torch.Tensor  # ||x||
    radius: torch.Tensor  # r = ||x|| clamped below at 1e-6
    radius_sq: torch.Tensor  # r^2
    dot: torch.Tensor  # <x, s>
    q: torch.Tensor  # <x, s> / r^2
    v: torch.Tensor  # the tangent component of s at x, v = s - q x, shape (..., d)
    v_norm_raw: torch.Tensor  # ||v||
    v_norm: torch.Tensor  # n = ||v|| clamped below at 1e-8
    ratio: torch.Tensor  # n / r, the angle eq. 3 would take
    ratio_c: torch.Tensor  # min(n / r, c)
    scaled: torch.Tensor  # (a * min(n / r, c) + b) * decay, before the final clamp
    theta: torch.Tensor  # the applied angle theta'


def geodesic_terms(x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor, decay: float,
                   clamp: float, lowest: float, scratch: torch.Tensor | None = None) -> GeodesicTerms:
    """Tangent, its norm and the applied angle of layers.geodesic_step, with every intermediate the backward
    needs, in the wider dtype of x and s (a bf16 sub-layer output meets a float32 stream under autocast)."""
    x = x.to(torch.promote_types(x.dtype, s.dtype))
    v = s.to(x.dtype, copy=True)  # s now, the tangent below (built in place)
    x_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    radius = x_norm.clamp_min(1e-6)
    radius_sq = radius.square()
    dot = row_dot(x, v, scratch)
    q = dot / radius_sq
    v.addcmul_(x, q, value=-1)
    v_norm_raw = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    v_norm = v_norm_raw.clamp_min(1e-8)
    ratio = v_norm / radius
    ratio_c = ratio.clamp_max(clamp)
    scaled = torch.addcmul(b, a, ratio_c).mul_(decay)
    theta = scaled.clamp(lowest, clamp)
    return GeodesicTerms(x_norm, radius, radius_sq, dot, q, v, v_norm_raw, v_norm, ratio, ratio_c, scaled, theta)


class GeodesicStepFunction(torch.autograd.Function):
    """layers.geodesic_step (GeoNorm eq. 5) as one autograd node with a backward written by hand.

    It saves x, the tangent v and per-token scalars only, and makes eight passes over the stream
    forward (a copy of s, two norms, a dot product as a product and a sum, the tangent, the output in
    two) and ten backward (the dot products <g,x> and <g,v>, each gradient as a combination of g, v
    and x in three), plus one under autocast to cast the bf16 sub-layer's gradient. The dot products'
    products go into the buffers the outputs are then built in, which are still in cache. Autograd
    through the same eager ops saves and re-reads every intermediate, and takes about twice as long on
    a CPU (docs/speed.md).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                decay: float, clamp: float, lowest: float) -> torch.Tensor:
        out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, s.dtype))
        t = geodesic_terms(x, s, a, b, decay, clamp, lowest, scratch=out)
        cos, sin = torch.cos(t.theta), torch.sin(t.theta)
        step = t.radius * sin / t.v_norm  # x_new = cos(theta') x + step v
        torch.mul(x, cos, out=out).addcmul_(t.v, step)
        ctx.dtypes, ctx.decay, ctx.clamp = (x.dtype, s.dtype), decay, clamp
        ctx.save_for_backward(x.to(out.dtype), a, cos, sin, step, *t)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        # Notation of `GeodesicTerms`: r, q, v, n, theta'; k = step; g = grad; D_y = dL/dy.
        x, a, cos, sin, k, x_norm, r, r_sq, dot, q, v, n_raw, n, ratio, ratio_c, scaled, theta = ctx.saved_tensors
        decay, clamp = ctx.decay, ctx.clamp
        g = grad.to(x.dtype)
        scratch = torch.empty_like(x)
        g_x = row_dot(g, x, scratch)  # <g, x>
        g_w = row_dot(g, v, scratch) / n  # <g, v> / n
        # out = cos(theta') x + k v with k = r sin(theta') / n:  D_theta' = r e
        e = torch.addcmul(cos * g_w, sin, g_x / r, value=-1)
        # theta' = clamp((a min(ratio, c) + b) decay); theta' == scaled exactly where the clamp let it through
        d_affine = e * (theta == scaled) * (r * decay)  # D of a min(ratio, c) + b
        d_ratio_r = d_affine * (ratio <= clamp) * (a / r)  # D_ratio / r
        # n enters through ratio = n / r and k:  D_n = D_ratio / r - k <g,v> / n;  D_v = k g + v_coef v
        v_coef = torch.addcmul(d_ratio_r, k, g_w, value=-1).mul_(n_raw >= 1e-8).div_(n)
        # v = s - q x:  D_q = -<D_v, x>, with <v, x> = <x,s> - q ||x||^2 (zero unless ||x|| < 1e-6)
        d_q = torch.addcmul(k * g_x, v_coef, torch.addcmul(dot, q, x_norm.square(), value=-1)).neg_()
        d_dot = d_q / r_sq
        # r enters through ratio, k and q = <x,s> / r^2 (k <g,v> / r = sin(theta') <g,v> / n)
        d_r = torch.addcmul(sin * g_w, d_ratio_r, ratio, value=-1).addcdiv_(q * d_q, r, value=-2)
        x_coef = d_r.mul_(x_norm >= 1e-6).div_(r)  # D_||x|| x / ||x||, through r = max(||x||, 1e-6)
        # ds = D_v + D_<x,s> x;  dx = cos g - q D_v + D_<x,s> s + x_coef x, written with s = v + q x.
        # A float32 ds for a bf16 s is built in the scratch buffer, cast, and the buffer reused for dx.
        grad_s = torch.mul(g, k, out=scratch if ctx.dtypes[1] != x.dtype else None)
        grad_s = grad_s.addcmul_(v, v_coef).addcmul_(x, d_dot).to(ctx.dtypes[1])
        grad_x = torch.mul(g, torch.addcmul(cos, q, k, value=-1), out=scratch)
        grad_x.addcmul_(v, torch.addcmul(d_dot, q, v_coef, value=-1)).addcmul_(x, torch.addcmul(x_coef, q, d_dot))
        grad_a = torch.vdot(d_affine.flatten(), ratio_c.flatten()).to(a.dtype) if ctx.needs_input_grad[2] else None
        grad_b = d_affine.sum().to(a.dtype) if ctx.needs_input_grad[3] else None
        return grad_x.to(ctx.dtypes[0]), grad_s, grad_a, grad_b, None, None, None


def fast_geodesic_step(x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor, decay: float,
                       clamp: float, lowest: float) -> torch.Tensor:
    return GeodesicStepFunction.apply(x, s, a, b, decay, clamp, lowest)

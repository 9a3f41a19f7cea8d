"""
The building blocks the rows of `SCHEMES` (model.py) are made of: the norm types, the residual combine
rules (GeoNorm's geodesic step among them), the Lipschitz block's gained linear map, the attention logit
scale, RoPE and the MLP's width. None of them holds a config; `register_rope` and `mlp_width` only read
a few attributes of one.

GeoNorm's geodesic step, RMSNorm, nGPT's unit norm and residual update, and DyT/Derf run as single autograd
nodes with backwards written by hand (`GeodesicStepFunction`, `RMSNormFunction`, `UnitNormFunction`,
`NormalizedLerpFunction`, `SquashFunction`) in eager mode, and as each node's `formula` in plain ops under
torch.compile (`fused`); tests/test_speed_paths.py checks their forward passes and gradients against the plain
formulas, in float64 and with gradcheck.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

if TYPE_CHECKING:
    from model import GPTConfig


# ----------------------------------------------------------------------------- fused autograd nodes
#
# Autograd through a chain of eager ops saves every intermediate and makes a pass over the tensor
# for each op and each op's gradient; on a CPU, where these elementwise passes are memory bound and
# nothing fuses them, that made GeoNorm's step and QK-norm the slowest parts of their schemes. Each
# node here computes its reductions once and builds each gradient in a few passes. `GeodesicStep`,
# `RMSNorm`, `HeadwiseRMSNorm`, `DynamicTanh` and `DynamicErf` below (and ngpt.py) use them.


def fused(node: type[torch.autograd.Function], *args):
    """`node` with its hand-written backward in eager mode; under torch.compile its `formula`, the same math in
    plain ops, whose backward inductor derives and fuses by itself. (A traced autograd.Function that writes its
    output in place gets its gradient routed to the wrong input in torch 2.11, pytorch/pytorch#180642: compiled
    GeoNorm and nGPT gradients were wrong on a GPU. Plain ops leave nothing of the kind to trace.)"""
    return node.formula(*args) if torch.compiler.is_compiling() else node.apply(*args)


class RMSNormFunction(torch.autograd.Function):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, as one autograd node.

    On a CPU torch's rms_norm is a chain of eager ops whose backward makes a dozen passes over x
    and allocates as many tensors; this makes three passes forward and six backward, and the
    backward allocates one tensor, its output. It runs in x's dtype with the weight cast to it, so
    a bf16 input under autocast stays on bf16 kernels (torch's rms_norm falls back to a slower,
    mixed-dtype path); reductions accumulate in float32 inside torch's kernels. `weight` has x's
    last dim (one gain per channel) or its last two (HeadwiseRMSNorm: (n_head, head_dim)); None
    leaves the gain out (two passes fewer backward).
    """

    @staticmethod
    def formula(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).to(torch.promote_types(x.dtype, torch.float32))
        out = x * torch.rsqrt(norm.square() / x.shape[-1] + eps).to(x.dtype)
        return out if weight is None else out * weight.to(x.dtype)

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


class UnitNormFunction(torch.autograd.Function):
    """x / max(||x||, eps) over the last dim (`F.normalize`, nGPT's Norm) as one autograd node.

    With u = x / ||x||, the gradient is (g - <g, u> u) / ||x||: the component of g along u is dropped
    (u does not change when x is scaled). Below the eps floor x / eps is linear and g / eps passes
    unprojected. Forward: a norm and a scaling; backward: a dot product and two passes, against the
    eight or so of autograd through `F.normalize`. Only u and the per-token 1 / ||x|| are saved.
    """

    @staticmethod
    def formula(x: torch.Tensor, eps: float) -> torch.Tensor:
        return x * torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps).reciprocal()

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


class NormalizedLerpFunction(torch.autograd.Function):
    """nGPT's residual update Norm(h + w (Norm(y) - h)) (eq. 10, 11; w the per-channel |alpha|) as one
    autograd node, in h's dtype (a bf16 sub-layer output under autocast is normalized in float32).

    With n = Norm(y), m = h + w (n - h) and u = Norm(m) the output: grad_m = (g - <g,u> u) / ||m|| as in
    `UnitNormFunction`, then grad_h = (1 - w) grad_m, grad_w = sum over tokens of grad_m (n - h), and
    grad_y is w grad_m taken back through Norm(y) the same way. Saves h, n and u. Against the chain it
    replaces (`lerp` between two `UnitNormFunction`s, Norm(y) cast to h's dtype) it makes one pass fewer
    forward and as many backward, keeps one copy of n instead of two, and computes Norm(y) in float32
    where the chain took it in bf16 (which CPU kernels run no faster).
    """

    @staticmethod
    def formula(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        y_inverse = torch.linalg.vector_norm(y, dim=-1, keepdim=True, dtype=h.dtype).clamp_min(eps).reciprocal()
        return UnitNormFunction.formula(torch.lerp(h, y * y_inverse, w), eps)

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


class SquashFunction(torch.autograd.Function):
    """DyT's and Derf's weight * f(alpha * x + shift) + bias, f = tanh or erf, as one autograd node.

    Autograd through the chain of eager ops saves three tensors of x's size for Derf (x, z and erf(z))
    and allocates a new one for each of its nine passes backward, five of them for erf's gradient (a
    square, a negation, an exponential, two products). This node saves x and f(z) only, recomputes z
    for Derf, writes most of its backward passes in place, and takes alpha's gradient as one dot
    product (no temporary). It computes where the formula would: in x's dtype up to f(z),
    then promoted by the float32 weight.
    """

    @staticmethod
    def formula(x: torch.Tensor, alpha: torch.Tensor, shift: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None, erf: bool) -> torch.Tensor:
        z = x * alpha if shift is None else x * alpha + shift
        squashed = torch.erf(z) if erf else torch.tanh(z)
        return squashed * weight if bias is None else torch.addcmul(bias, squashed, weight)

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


def row_dot(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """<a, b> over the last dim, kept as size 1 (a multiply and a sum, as `vecdot`). `scratch`, a tensor
    of a's shape and dtype whose contents may be lost, takes the products instead of a new tensor: a
    buffer written again soon after is still in cache, a fresh one is not."""
    return torch.mul(a, b, out=scratch).sum(-1, keepdim=True)


def geodesic_terms(x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor, decay: float,
                   clamp: float, lowest: float, scratch: torch.Tensor | None = None) -> GeodesicTerms:
    """Tangent, its norm and the applied angle of GeoNorm eq. 5 (see `GeodesicStep`), in the wider
    dtype of x and s (a bf16 sub-layer output meets a float32 stream under autocast). The applied
    angle is clamped to [lowest, clamp]: lowest is -inf (eq. 5's min(., c)) or -clamp."""
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
    """GeoNorm eq. 5 as one autograd node with a backward written by hand.

    It saves x, the tangent v and per-token scalars only, and makes eight passes over the stream
    forward (a copy of s, two norms, a dot product as a product and a sum, the tangent, the output in
    two) and ten backward (the dot products <g,x> and <g,v>, each gradient as a combination of g, v
    and x in three), plus one under autocast to cast the bf16 sub-layer's gradient. The dot products'
    products go into the buffers the outputs are then built in, which are still in cache. Autograd
    through the same eager ops saves and re-reads every intermediate, and takes about twice as long on
    a CPU (BENCHMARKS.md).
    """

    @staticmethod
    def formula(x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor, decay: float, clamp: float,
                lowest: float) -> torch.Tensor:
        x = x.to(torch.promote_types(x.dtype, s.dtype))  # `geodesic_terms` without its in-place steps
        radius = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-6)
        v = s - (x * s).sum(-1, keepdim=True) / radius.square() * x  # the tangent: s less its part along x
        v_norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(1e-8)
        theta = ((a * (v_norm / radius).clamp_max(clamp) + b) * decay).clamp(lowest, clamp)
        return torch.cos(theta) * x + (radius * torch.sin(theta) / v_norm) * v

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


# ----------------------------------------------------------------------------- norms


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm (same parameters and state dict), computed by `RMSNormFunction`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight)

    def normalize(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """x normalized by this norm's eps and shape, times `weight` in place of its own (None: no gain)."""
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        dims = len(self.normalized_shape)
        if dims == 1:
            return fused(RMSNormFunction, x, weight, eps)
        # over several trailing dims (OLMo 2's q/k norm over all heads): the same node on their flattening
        flat_weight = None if weight is None else weight.flatten()
        return fused(RMSNormFunction, x.flatten(-dims), flat_weight, eps).view(x.shape)


class HeadwiseRMSNorm(nn.Module):
    """The anisotropic, head-aligned LayerNorm proposed by the geometric account of LN/MHA/FFN, as we read it.

    The paper proposes normalizing on a product of per-head spheres instead of one sphere; it
    gives no reference implementation. Here: split the vector into n_head contiguous groups
    (the attention heads' slices), RMS-normalize each group on its own, then apply one
    learnable gain per channel.
    """

    def __init__(self, dim: int, n_head: int, eps: float = 1e-5):
        super().__init__()
        self.n_head, self.eps = n_head, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.unflatten(-1, (self.n_head, -1))
        return fused(RMSNormFunction, groups, self.weight.view(self.n_head, -1), self.eps).flatten(-2)


class DynamicTanh(nn.Module):
    """DyT (Zhu et al., 2025): gamma * tanh(alpha * x) + beta in place of a norm; alpha is one learnable scalar.

    Elementwise: no statistics over the channels. The bias beta exists when `config.bias` is set, as
    for LayerNorm here (the DyT LLaMA code has none). Computed by `SquashFunction`.
    """

    erf = False

    def __init__(self, dim: int, alpha_init: float, bias: bool):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(alpha_init))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.register_parameter("shift", None)  # Derf's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused(SquashFunction, x, self.alpha, self.shift, self.weight, self.bias, self.erf)


class DynamicErf(DynamicTanh):
    """Derf (Chen et al., 2025): gamma * erf(alpha * x + s) + beta, with a learnable scalar shift s (init 0)."""

    erf = True

    def __init__(self, dim: int, alpha_init: float, bias: bool):
        super().__init__(dim, alpha_init, bias)
        self.shift = nn.Parameter(torch.tensor(0.0))


# ----------------------------------------------------------------------------- combine rules


def combine_coefficients(rule: str, j: int, n_layer: int) -> tuple[float, float]:
    """(alpha, beta) of the residual update x <- alpha * x + beta * y for residual update j.

    j in 1..2L counts residual updates (attention of block l is 2l+1, its MLP 2l+2).
    """
    if rule == "add":
        return 1.0, 1.0
    if rule == "pre_alt":  # GeoNorm App. B eq. 13: x_j / sqrt(j+1) of the Pre-Norm stream
        return math.sqrt(j / (j + 1)), 1.0 / math.sqrt(j + 1)
    if rule == "deepnorm":  # DeepNet: alpha = (2L)^(1/4) for a decoder-only model
        return (2 * n_layer) ** 0.25, 1.0
    if rule == "convex":  # Bir et al. §4.3: x <- (L-1)/L x + block(x)/L
        return (n_layer - 1) / n_layer, 1.0 / n_layer
    raise ValueError(f"combine={rule!r} has no linear coefficients")


class ScaledAdd(nn.Module):
    """x <- alpha * x + beta * y with constants fixed at construction."""

    def __init__(self, alpha: float, beta: float):
        super().__init__()
        self.alpha, self.beta = alpha, beta

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.alpha == 1.0 and self.beta == 1.0:
            return x + y
        return torch.add(x * self.alpha, y, alpha=self.beta)  # two passes over the stream, not three

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:.4g}, beta={self.beta:.4g}"


class ScalarGain(nn.Module):
    """x -> g * x, g one learnable scalar: ReZero's residual gate (init 0), DyT's embedding scale (init sqrt(d))."""

    def __init__(self, init: float):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * x


class ReZeroAdd(nn.Module):
    """ReZero (Bachlechner et al., eq. 1): x <- x + alpha * y, alpha learnable and 0 at init, so every update
    starts as the identity. The paper's "one parameter per layer" reads two ways: `rezero_gate="update"` (the
    default) gives each residual update its own alpha; "block" shares one between a block's attention and
    MLP updates, as the released rztx.py does."""

    def __init__(self):
        super().__init__()
        self.alpha = ScalarGain(0.0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + self.alpha(y)


def geonorm_decay(schedule: str, layer: int, n_layer: int) -> float:
    """Step-size decay of GeoNorm §3.2 for 0-based block index `layer`."""
    if schedule == "harmonic":
        return 1.0 / (layer + 1)
    if schedule == "sqrt":
        return 1.0 / math.sqrt(layer + 1)
    if schedule == "linear":
        return (n_layer - layer) / n_layer
    return 1.0


class GeodesicStep(nn.Module):
    """GeoNorm's residual update (eq. 5): move x along the sphere of radius ||x||
    in the direction of the sub-layer output s, by an angle that is clamped and decays with depth.

        v      = s - (<x,s> / ||x||^2) x              tangent component of s at x
        theta  = min(||v|| / ||x||, c)
        theta' = min((a * theta + b) * decay(l), c)           a, b learnable (init 1, 0)
        x_new  = cos(theta') x + ||x|| sin(theta') v / ||v||  so ||x_new|| = ||x||

    The paper clamps theta' from above only (App. D: `clamp(..., max=clamp)`), which is the default
    (`sides="upper"`); a learned a < 0 can then turn the step backwards by more than c.
    `sides="both"` (`geonorm_clamp_sides="both"`, an option of this project) clamps to [-c, c] and so
    bounds the step's length |theta'|. The two agree whenever (a * theta + b) * decay(l) >= -c, as at init.
    `GeodesicStepFunction` computes it as one autograd node (the paper calls its cost negligible;
    as a chain of eager ops it was the slowest part of a GeoNorm step on a CPU).

    Where the sphere lies is left open by the paper: it calls the stream's constraint set "the
    sphere defined by the normalization radius ||x_k||", and never says where the embedding starts.
    Three readings, each an option (the first is the default only because it was this model's
    behaviour before the others existed):

    - `geonorm_radius="embedding"` (default): each token keeps its embedding's norm through the
      stack. Follows "the token embeddings serve as the initial state" (§3.1), taken as they are
      (with GPT-2's N(0, 0.02) token and position embeddings, RMS about 0.03).
    - `geonorm_radius="sqrt_d"`: the embedding is projected, without parameters, onto the sphere of
      radius sqrt(d) before the first block. Follows "we reformulate the post-normalized Transformer
      layer (1)" (§3.2) with App. B's RMSNorm, which "normalizes vectors to have norm sqrt(D)": the
      Post-Norm stream eq. 5 replaces sits on that sphere.
    - `pre_norm="attn+mlp"`: the sub-layers see N(x) instead of x. Follows "Pre-Norm can be regarded
      as a special case of GeoNorm" (§3.3), whose sub-layers take Norm(x) (App. B, eq. 8). The
      angles are still measured against the stream's own radius: with the embedding's, the MLP's
      update is already 1.4 ||x|| at init (CPU bench shape), past the clamp.

    The paper's App. D listing has bugs that this module does not copy: its "harmonic" branch
    assigns to `theta_attn`, so neither the decay nor `scale` and `bias` (a and b) are applied;
    `__init__` ignores its `clamp` argument (always pi/4); `nn.Parameter(torch.tensor(1))` is an
    integer tensor, which cannot require grad; the default method name is misspelled "harnomic";
    and `math` is not imported. What the listing computes, theta' = min(||v|| / ||x||, pi/4), is
    `geonorm_decay="none"` with `geonorm_affine=False` (a, b fixed at 1, 0); `geonorm_decay="none"`
    alone still learns a and b.
    """

    def __init__(self, decay: float, clamp: float, affine: bool = True, sides: str = "upper"):
        super().__init__()
        self.decay, self.clamp, self.sides = decay, clamp, sides
        self.lowest = -clamp if sides == "both" else -math.inf
        if affine:
            self.a = nn.Parameter(torch.tensor(1.0))
            self.b = nn.Parameter(torch.tensor(0.0))
        else:  # fixed at the identity map theta' = theta * decay
            self.register_buffer("a", torch.tensor(1.0))
            self.register_buffer("b", torch.tensor(0.0))

    def angle(self, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The applied angle theta', the radius ||x||, the tangent v and ||v|| (per token)."""
        t = geodesic_terms(x, s, self.a, self.b, self.decay, self.clamp, self.lowest)
        return t.theta, t.radius, t.v, t.v_norm

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return fused(GeodesicStepFunction, x, s, self.a, self.b, self.decay, self.clamp, self.lowest)

    def extra_repr(self) -> str:
        return f"decay={self.decay:.4g}, clamp={self.clamp:.4g}, sides={self.sides}"


# ----------------------------------------------------------------------------- sub-layers


class GainLinear(nn.Linear):
    """A linear map followed by a learnable diagonal gain kept in [1e-3, cap] (Bir et al. §6.2).

    The gain is clamped in place after every optimizer step (`constrain_`, through
    GPT.apply_parameter_constraints), as Bir et al.'s code clamps the parameter itself: a clamp
    inside forward would give a gain above the cap zero gradient, and it would stay there."""

    def __init__(self, in_features: int, out_features: int, bias: bool, cap: float):
        super().__init__(in_features, out_features, bias=bias)
        self.cap = cap
        self.gain = nn.Parameter(torch.full((out_features,), min(1.0, cap)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain

    @torch.no_grad()
    def constrain_(self) -> None:
        self.gain.clamp_(1e-3, self.cap)


def softmax_scale(attn_scale: str, head_dim: int) -> float:
    """The factor on q.k: 1/sqrt(d_h) (standard), 1/d_h (Bir et al. §4.3) or sqrt(d_h) (nGPT §2.3.2,
    for unit q and k, whose dot products have variance 1/d_h)."""
    return {"1/sqrt(d)": 1.0 / math.sqrt(head_dim), "1/d": 1.0 / head_dim, "sqrt(d)": math.sqrt(head_dim)}[attn_scale]


def rope_tables(head_dim: int, length: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def register_rope(module: nn.Module, config: GPTConfig, head_dim: int) -> bool:
    """Give an attention module the RoPE tables as buffers when config.pos is "rope"; True if it has them."""
    if config.pos != "rope":
        return False
    cos, sin = rope_tables(head_dim, config.block_size, 10000.0)
    module.register_buffer("rope_cos", cos, persistent=False)
    module.register_buffer("rope_sin", sin, persistent=False)
    return True


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's channels by position (RoFormer)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def mlp_width(config: GPTConfig) -> int:
    if config.mlp_hidden is not None:
        return config.mlp_hidden
    d = config.n_embd  # SwiGLU: 2/3 of 4d (rounded up to 64) keeps GELU's parameter count
    return 64 * math.ceil(8 * d / 3 / 64) if config.mlp == "swiglu" else 4 * d

"""The hand-written autograd nodes (GeoNorm's geodesic step, RMSNorm, nGPT's unit norm and update, DyT/Derf) against
the formulas they replace, and GeoNorm's named readings (the sqrt(d) sphere, the App. D listing's computation)."""

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.nn import functional as F

from layers import (
    DynamicErf,
    DynamicTanh,
    GeodesicStep,
    GeodesicStepFunction,
    HeadwiseRMSNorm,
    NormalizedLerpFunction,
    RMSNorm,
    RMSNormFunction,
    SquashFunction,
    UnitNormFunction,
)
from model import GPT, GPTConfig


def eq5_autograd(x, s, a, b, decay: float, clamp: float, lowest: float = -math.inf) -> torch.Tensor:
    """GeoNorm eq. 5 as a chain of eager ops, differentiated by autograd (the step before it was fused);
    the applied angle clamped to [lowest, clamp]."""
    radius = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-6)
    dot = (x * s).sum(-1, keepdim=True)
    v = torch.addcmul(s, x, -dot / radius.square())
    v_norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(1e-8)
    theta = (v_norm / radius).clamp_max(clamp)
    theta = ((a * theta + b) * decay).clamp(lowest, clamp)
    return torch.addcmul(torch.cos(theta) * x, v, radius * torch.sin(theta) / v_norm)


def step_inputs(dtype=torch.float64, shape=(2, 6, 16), seed=0, parallel_token=False):
    """x, s with small angles and the clamp saturated (s much longer than x) in one batch; optionally a token
    with s parallel to x (zero tangent up to rounding, where the 1e-8 guard acts)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype)
    s = torch.randn(shape, generator=g, dtype=dtype) * torch.linspace(0.05, 5.0, shape[1], dtype=dtype)[:, None]
    if parallel_token:
        s[0, 0] = 3 * x[0, 0]
    return x, s


def upper_clamp_binds(x, s, a: float, b: float, decay: float, clamp: float) -> torch.Tensor:
    """Per token: whether eq. 5's final min(., c) cuts the angle, (a min(||v|| / ||x||, c) + b) decay > c."""
    radius = torch.linalg.vector_norm(x, dim=-1)
    tangent = s - ((x * s).sum(-1) / radius**2)[..., None] * x
    ratio = torch.linalg.vector_norm(tangent, dim=-1) / radius
    return (a * ratio.clamp_max(clamp) + b) * decay > clamp


# upper_binds: on how many tokens of `step_inputs` the upper clamp sets theta' = c ("none", "some", "all");
# there theta' does not depend on a, b or the tangent's length, so their gradients through the angle vanish
@pytest.mark.parametrize("a, b, decay, clamp, upper_binds", [
    (1.0, 0.0, 1.0, math.pi / 4, "none"), (0.7, 0.05, 0.5, math.pi / 4, "none"),
    (1.3, -0.4, 1 / 3, math.pi / 8, "none"), (-2.0, 0.1, 1.0, math.pi / 2, "none"),
    (10.0, 0.0, 1.0, math.pi / 4, "some"),  # long tangents clamped, the two short ones (angle ~0.04) not
    (1.0, 1.0, 1.0, math.pi / 4, "all"),  # every token, the short-tangent ones included
])
@pytest.mark.parametrize("sides", ["upper", "both"])
def test_geodesic_step_forward_and_gradients_equal_eq5(a, b, decay, clamp, upper_binds, sides):
    lowest = -clamp if sides == "both" else -math.inf
    x, s = step_inputs()
    binds = upper_clamp_binds(x, s, a, b, decay, clamp)
    n_bound = int(binds.sum())
    assert {"none": n_bound == 0, "some": 0 < n_bound < binds.numel(), "all": n_bound == binds.numel()}[upper_binds]
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for fn in (GeodesicStepFunction.apply, eq5_autograd):
        xs = [x.clone().requires_grad_(), s.clone().requires_grad_(),
              torch.tensor(a, dtype=torch.float64, requires_grad=True),
              torch.tensor(b, dtype=torch.float64, requires_grad=True)]
        out = fn(*xs, decay, clamp, lowest)
        out.backward(grad_out)
        results.append([out.detach()] + [t.grad for t in xs])
    # float64, same formula, different summation order: 1e-12 relative leaves room for ~1e-15 rounding
    for name, fused, reference in zip(("out", "dx", "ds", "da", "db"), *results, strict=True):
        torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12, msg=name)


def test_geodesic_step_guards_a_zero_tangent_like_eq5():
    """s parallel to x: the tangent is rounding noise, ||v|| is clamped to 1e-8 and the step leaves x
    where it is (the gradient there is noise over 1e-8, so only the forward is compared)."""
    x, s = step_inputs(parallel_token=True)
    a, b = torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    out = GeodesicStepFunction.apply(x, s, a, b, 1.0, math.pi / 4, -math.inf)
    torch.testing.assert_close(out, eq5_autograd(x, s, a, b, 1.0, math.pi / 4), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0, 0], x[0, 0], rtol=1e-12, atol=1e-12)


def test_geodesic_step_gradients_at_the_norm_floors_equal_eq5():
    """Where a floor acts, r = max(||x||, 1e-6) and n = max(||v||, 1e-8) are constants in x and v: a token
    with ||x|| = 1e-8 and one whose tangent has norm 1e-10 take the same gradients as autograd through
    eq. 5, which passes through the same floors. At the second token b = 0.05 makes the step k = r
    sin(theta') / n large, and the term a missing n floor would add to ds is about (||v|| / n)^2 = 1e-4
    of k g: far above rounding. (With a tangent of rounding noise, 1e-15, it would be 1e-14 of it.)"""
    x, s = step_inputs()
    x[1, 2] *= 1e-8 / torch.linalg.vector_norm(x[1, 2])
    across = torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    across -= (across @ x[0, 0]) / (x[0, 0] @ x[0, 0]) * x[0, 0]
    s[0, 0] = 3 * x[0, 0] + 1e-10 * across / torch.linalg.vector_norm(across)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for fn in (GeodesicStepFunction.apply, eq5_autograd):
        xs = [x.clone().requires_grad_(), s.clone().requires_grad_(),
              torch.tensor(0.7, dtype=torch.float64, requires_grad=True),
              torch.tensor(0.05, dtype=torch.float64, requires_grad=True)]
        out = fn(*xs, 0.5, math.pi / 4, -math.inf)
        out.backward(grad_out)
        results.append([out.detach()] + [t.grad for t in xs])
    # float64, the same formula with its terms in another order: rounding only
    for name, fused, reference in zip(("out", "dx", "ds", "da", "db"), *results, strict=True):
        torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12, msg=name)


def test_geodesic_step_passes_gradcheck():
    x, s = step_inputs(shape=(1, 5, 8))
    a = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    inputs = (x.requires_grad_(), s.requires_grad_(), a, b)
    assert torch.autograd.gradcheck(lambda *t: GeodesicStepFunction.apply(*t, 0.5, math.pi / 4, -math.inf), inputs)


def test_geodesic_step_float32_forward_equals_todays_formula():
    x, s = step_inputs(torch.float32, shape=(4, 64, 256))
    a, b = torch.tensor(0.9), torch.tensor(0.02)
    fused = GeodesicStepFunction.apply(x, s, a, b, 0.5, math.pi / 4, -math.inf)
    # float32, sums taken in another order: a few ulps of the output's scale
    torch.testing.assert_close(fused, eq5_autograd(x, s, a, b, 0.5, math.pi / 4), rtol=2e-6, atol=2e-6)


def test_geodesic_step_takes_bf16_sublayer_outputs_under_autocast():
    x, s = step_inputs(torch.float32, shape=(2, 8, 64))
    s = s.bfloat16()
    step = GeodesicStep(decay=0.5, clamp=math.pi / 4)
    xr, sr = x.clone().requires_grad_(), s.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = step(xr, sr)
    out.sum().backward()
    assert out.dtype == torch.float32 and xr.grad.dtype == torch.float32 and sr.grad.dtype == torch.bfloat16
    # the bf16 output is widened exactly, so the step is the float32 step on s.float() (float32 rounding)
    torch.testing.assert_close(out, eq5_autograd(x, s.float(), step.a, step.b, 0.5, math.pi / 4),
                               rtol=2e-6, atol=2e-6)


# ----------------------------------------------------------------------------- RMSNorm


def rms_reference(x: torch.Tensor, weight: torch.Tensor | float, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("weight_shape", [(16,), (4, 16)])  # per channel; per head slice (HeadwiseRMSNorm)
def test_rms_norm_function_passes_gradcheck(weight_shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.3 * torch.randn(weight_shape, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFunction.apply(x, w, 1e-5), (x, w))
    torch.testing.assert_close(RMSNormFunction.apply(x, w, 1e-5), rms_reference(x, w, 1e-5), rtol=1e-12, atol=1e-12)


def test_rms_norm_function_without_a_gain_passes_gradcheck():
    """The keys' norm when their gain rides on the queries: x / sqrt(mean(x^2) + eps), no multiply."""
    x = torch.randn(3, 5, 4, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: RMSNormFunction.apply(x, None, 1e-5), (x,))
    torch.testing.assert_close(RMSNormFunction.apply(x, None, 1e-5), rms_reference(x, 1.0, 1e-5), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("shape", [64, (4, 64)])  # over the last dim; over all heads (OLMo 2's q/k norm)
def test_rms_norm_matches_torch_rmsnorm_in_float32(shape):
    torch.manual_seed(0)
    ours, theirs = RMSNorm(shape, eps=1e-5), nn.RMSNorm(shape, eps=1e-5)
    nn.init.normal_(theirs.weight, 1.0, 0.2)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(8, 32, 4, 64)
    outs = []
    for norm in (ours, theirs):
        xr = x.clone().requires_grad_()
        y = norm(xr)
        (y * torch.linspace(-1, 1, 64)).sum().backward()
        outs.append((y.detach(), xr.grad, norm.weight.grad))
    # float32 with a different summation order: 1e-5 relative; the weight's gradient sums 1024 terms of
    # either sign (their absolute values add to ~800), which reordering moves by up to ~1e-4
    for fused, reference, atol in zip(*outs, (1e-5, 1e-5, 1e-4), strict=True):
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=atol)


def test_rms_norm_stays_on_bf16_kernels_under_autocast():
    """A bf16 input meets the float32 gain inside the node: no mixed-dtype fallback warning, a bf16
    output, and values within bf16 rounding of the float64 formula."""
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5)
    nn.init.normal_(norm.weight, 1.0, 0.2)
    x = torch.randn(8, 32, 4, 64).bfloat16().requires_grad_()
    upstream = torch.randn(8, 32, 4, 64).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's rms_norm warns "Mismatch dtype between input and weight"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(x)
        y.backward(upstream)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.float32
    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    y64 = rms_reference(x64, w64, 1e-5)
    y64.backward(upstream.double())
    # bf16 keeps 8 significant bits (relative step 2^-8 = 0.4%): the norm, rstd and the product each round
    # once, and the input gradient's two terms partly cancel, so allow 4 steps of the tensor's scale
    for ours, exact in ((y, y64), (x.grad, x64.grad), (norm.weight.grad, w64.grad)):
        scale = exact.abs().max().item()
        assert (ours.double() - exact).abs().max().item() < 4 * 2**-8 * scale


def unit_inputs() -> torch.Tensor:
    """Rows of several lengths, one of them below the floor eps = 0.1 used with it (x / eps there)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(0.2, 3.0, 5, dtype=torch.float64)[:, None]
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64) * lengths
    x[0, 0] *= 1e-3
    return x.requires_grad_()


def test_unit_norm_function_equals_f_normalize_and_passes_gradcheck():
    x, eps = unit_inputs(), 0.1
    assert torch.linalg.vector_norm(x[0, 0]) < eps < torch.linalg.vector_norm(x[0, 1])
    assert torch.autograd.gradcheck(lambda x: UnitNormFunction.apply(x, eps), (x,))
    upstream = torch.randn_like(x)
    fused, reference = UnitNormFunction.apply(x, eps), F.normalize(x, dim=-1, eps=eps)
    (grad_fused,) = torch.autograd.grad(fused, x, upstream)
    (grad_reference,) = torch.autograd.grad(reference, x, upstream)
    # float64, the same operations in another order: rounding only
    torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_fused, grad_reference, rtol=1e-10, atol=1e-12)


def test_unit_norm_function_in_bf16_is_within_rounding_of_float64():
    torch.manual_seed(0)
    x = torch.randn(8, 4, 32, 64).bfloat16().requires_grad_()
    upstream = torch.randn(8, 4, 32, 64).bfloat16()
    y = UnitNormFunction.apply(x, 1e-12)
    y.backward(upstream)
    x64 = x.detach().double().requires_grad_()
    y64 = F.normalize(x64, dim=-1)
    y64.backward(upstream.double())
    assert y.dtype == x.grad.dtype == torch.bfloat16
    # bf16 keeps 8 significant bits (relative step 2^-8): u rounds once; the gradient (g - <g,u> u) / ||x||
    # rounds the products of the dot product, the difference and the scaling, so allow 4 steps of its scale
    for ours, exact in ((y, y64), (x.grad, x64.grad)):
        scale = exact.abs().max().item()
        assert (ours.double() - exact).abs().max().item() < 4 * 2**-8 * scale


def normalized_lerp_formula(h, y, w, eps):
    """nGPT eq. 10/11 as eager ops: Norm(h + w (Norm(y) - h)), Norm = F.normalize."""
    return F.normalize(torch.lerp(h, F.normalize(y, dim=-1, eps=eps).to(h.dtype), w), dim=-1, eps=eps)


def test_normalized_lerp_function_equals_eq_10_11_and_passes_gradcheck():
    eps = 0.1
    y = unit_inputs()  # row [0, 0] below the floor: Norm(y) = y / eps there
    g = torch.Generator().manual_seed(1)
    h = F.normalize(torch.randn(3, 5, 16, generator=g, dtype=torch.float64), dim=-1)
    h[1, 2] *= 1e-3  # with |w| < 0.1 and ||Norm(y)|| <= 1, h + w (Norm(y) - h) falls below the floor here
    w = (0.01 + 0.09 * torch.rand(16, generator=g, dtype=torch.float64)).requires_grad_()
    h.requires_grad_()
    m = torch.lerp(h, F.normalize(y, dim=-1, eps=eps), w)
    assert torch.linalg.vector_norm(m[1, 2]) < eps < torch.linalg.vector_norm(m[0, 1])
    assert torch.autograd.gradcheck(lambda h, y, w: NormalizedLerpFunction.apply(h, y, w, eps), (h, y, w))
    fused, reference = NormalizedLerpFunction.apply(h, y, w, eps), normalized_lerp_formula(h, y, w, eps)
    upstream = torch.randn(fused.shape, generator=g, dtype=torch.float64)
    grads_fused = torch.autograd.grad(fused, (h, y, w), upstream)
    grads_reference = torch.autograd.grad(reference, (h, y, w), upstream)
    # float64, the same operations in another order: rounding only
    torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
    for ours, theirs in zip(grads_fused, grads_reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_normalized_lerp_takes_a_bf16_sublayer_output_into_a_float32_stream():
    torch.manual_seed(0)
    h = F.normalize(torch.randn(4, 32, 64), dim=-1).requires_grad_()
    y = torch.randn(4, 32, 64).bfloat16().requires_grad_()
    w = (0.05 * torch.rand(64)).requires_grad_()
    upstream = torch.randn(4, 32, 64)
    out = NormalizedLerpFunction.apply(h, y, w, 1e-12)
    out.backward(upstream)
    assert out.dtype == h.grad.dtype == w.grad.dtype == torch.float32 and y.grad.dtype == torch.bfloat16
    exact = [t.detach().double().requires_grad_() for t in (h, y, w)]
    out64 = normalized_lerp_formula(*exact, 1e-12)
    out64.backward(upstream.double())
    # the bf16 values of y are read exactly and everything runs in float32 (relative rounding 2^-24 per op,
    # a few dozen ops): 1e-5 of each tensor's scale; y's gradient is then rounded once to bf16 (2^-8)
    for ours, reference, bound in ((out, out64, 1e-5), (h.grad, exact[0].grad, 1e-5),
                                   (w.grad, exact[2].grad, 1e-5), (y.grad, exact[1].grad, 2**-8)):
        scale = reference.abs().max().item()
        assert (ours.double() - reference).abs().max().item() < bound * scale


def test_qk_norm_and_headwise_norm_use_the_fused_node():
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32, norm_scheme="dnt",
                          norm="headwise"))
    attn = model.blocks[0].attn.sublayer
    assert isinstance(attn.q_norm, RMSNorm) and isinstance(model.input_norm, HeadwiseRMSNorm)
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    headwise = HeadwiseRMSNorm(32, 2).double()
    nn.init.normal_(headwise.weight, 1.0, 0.2)
    # per-head RMS, then a per-channel gain (float64: rounding only)
    expected = rms_reference(x.unflatten(-1, (2, 16)), headwise.weight.view(2, 16), 1e-5).flatten(-2)
    torch.testing.assert_close(headwise(x), expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- DyT and Derf


def squash_reference(x, alpha, shift, weight, bias, erf: bool) -> torch.Tensor:
    """DyT / Derf as the chain of eager ops autograd differentiates (the modules before the fused node)."""
    z = alpha * x if shift is None else alpha * x + shift
    out = (torch.erf(z) if erf else torch.tanh(z)) * weight
    return out if bias is None else out + bias


def squash_inputs(erf: bool, bias: bool):
    """x spread so that tanh and erf saturate on some entries; parameters away from their init (float64)."""
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(3, 5, 16, generator=g, dtype=torch.float64)).requires_grad_()
    params = [torch.tensor(0.7), torch.tensor(0.3) if erf else None, torch.linspace(0.5, 2.0, 16),
              torch.linspace(-1.0, 1.0, 16) if bias else None]
    return x, [p if p is None else p.double().requires_grad_() for p in params]


@pytest.mark.parametrize("erf", [False, True], ids=["dyt", "derf"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_squash_function_equals_the_formula_and_passes_gradcheck(erf, bias):
    x, params = squash_inputs(erf, bias)  # alpha, shift (Derf), weight, bias (optional)
    present = [i for i, p in enumerate(params) if p is not None]
    inputs = (x, *(params[i] for i in present))

    def fused(x, *given):
        full = list(params)
        for i, p in zip(present, given, strict=True):
            full[i] = p
        return SquashFunction.apply(x, *full, erf)

    assert torch.autograd.gradcheck(fused, inputs)
    upstream = torch.randn(3, 5, 16, dtype=torch.float64)
    ours, reference = fused(*inputs), squash_reference(x, *params, erf)
    # float64, the same operations regrouped: rounding only
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    for grad, exact in zip(torch.autograd.grad(ours, inputs, upstream),
                           torch.autograd.grad(reference, inputs, upstream), strict=True):
        torch.testing.assert_close(grad, exact, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", [DynamicTanh, DynamicErf])
def test_dyt_and_derf_modules_squash_bf16_inputs_in_bf16_within_rounding(kind):
    """A bf16 input (a sub-layer output under autocast, at a Sandwich mid-norm) is squashed in bf16, then
    promoted by the float32 weight, as the eager formula does."""
    norm = kind(16, 0.7, bias=True)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
        if kind.erf:
            norm.shift.fill_(0.3)
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 16, generator=g)).bfloat16().requires_grad_()
    y = norm(x)
    assert y.grad_fn.name() == "SquashFunctionBackward" and y.dtype == torch.float32
    upstream = torch.randn(4, 16, generator=g)
    y.backward(upstream)
    assert x.grad.dtype == torch.bfloat16 and norm.alpha.grad.dtype == torch.float32
    x64 = x.detach().double().requires_grad_()
    y64 = squash_reference(x64, *(p if p is None else p.detach().double()
                                  for p in (norm.alpha, norm.shift, norm.weight, norm.bias)), kind.erf)
    y64.backward(upstream.double())
    # bf16 keeps 8 significant bits (relative step 2^-8): z and f(z) round once each before the float32 product,
    # and the input gradient's f'(z) and two products round in bf16, so allow 4 steps of each tensor's scale
    for ours, exact in ((y, y64), (x.grad, x64.grad)):
        scale = exact.abs().max().item()
        assert (ours.double() - exact).abs().max().item() < 4 * 2**-8 * scale


# ----------------------------------------------------------------------------- GeoNorm's readings


def geonorm_stream(**kw) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=4, n_head=2, n_embd=32, norm_scheme="geonorm",
                          **kw)).double()
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    stream = [model.embed(idx)]
    for block in model.blocks:
        stream.append(block(stream[-1]))
    return stream


def test_geonorm_sqrt_d_keeps_every_token_at_norm_sqrt_d():
    for x in geonorm_stream(geonorm_radius="sqrt_d"):
        # the projection and every rotation change nothing but rounding: 1e-12 relative in float64
        torch.testing.assert_close(x.norm(dim=-1), torch.full(x.shape[:-1], math.sqrt(32), dtype=torch.float64),
                                   rtol=1e-12, atol=0)
    # the default reading keeps the embedding's own, much smaller norm (GPT-2 init: RMS ~ 0.02 * sqrt(2))
    assert geonorm_stream()[-1].norm(dim=-1).max() < 0.1 * math.sqrt(32)


def test_geonorm_radius_is_checked():
    with pytest.raises(ValueError, match="geonorm_radius='unit' is not valid; choose one of: embedding, sqrt_d"):
        GPTConfig(geonorm_radius="unit")


def app_d_listing(x: np.ndarray, g: np.ndarray, clamp: float = math.pi / 4) -> np.ndarray:
    """What GeoNorm App. D's listing computes in its default ("harnomic") branch, whose decayed angle goes to
    an unused variable: theta = min(||v|| / ||x||, clamp) with neither decay nor scale and bias."""
    gradient = g - (x * g).sum(-1, keepdims=True) / np.linalg.norm(x, axis=-1, keepdims=True) ** 2 * x
    safe_tangent_norm = np.maximum(np.linalg.norm(gradient, axis=-1, keepdims=True), 1e-8)
    safe_r = np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)
    theta = np.minimum(safe_tangent_norm / safe_r, clamp)
    return x * np.cos(theta) + gradient / safe_tangent_norm * safe_r * np.sin(theta)


def test_listing_computation_needs_no_decay_and_fixed_a_b():
    x, s = (t.numpy() for t in step_inputs(parallel_token=True))
    listing = app_d_listing(x, s)
    config = dict(block_size=16, vocab_size=50, n_layer=3, n_head=2, n_embd=32, norm_scheme="geonorm")
    steps = [GeodesicStep(1.0, math.pi / 4, False).double() for _ in range(3)]  # a, b fixed at 1, 0; no decay
    assert not any(p.requires_grad for step in steps for p in (step.a, step.b))  # buffers, not parameters
    for step in steps:  # float64, same arithmetic: rounding only
        out = step(torch.from_numpy(x), torch.from_numpy(s)).numpy()
        np.testing.assert_allclose(out, listing, rtol=1e-12, atol=1e-12)
    # geonorm_decay="none" alone keeps a and b learnable: once they move, the listing is no longer computed
    learned = GPT(GPTConfig(geonorm_decay="none", **config)).double()
    step = next(m for m in learned.modules() if isinstance(m, GeodesicStep))
    assert step.a.requires_grad and step.b.requires_grad
    with torch.no_grad():
        step.a.fill_(1.1)
    assert not np.allclose(step(torch.from_numpy(x), torch.from_numpy(s)).detach().numpy(), listing, atol=1e-6)


FAULTS_PER_STEP = """
import resource, statistics, torch
import guards
from layers import GeodesicStep
torch.manual_seed(0)
torch.set_num_threads(1)
reused = guards.reuse_freed_memory()
x, s = torch.randn(2048, 256, requires_grad=True), torch.randn(2048, 256, requires_grad=True)
step = GeodesicStep(0.5, 0.7)
faults = []
for _ in range(13):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(x, s).backward(torch.ones(2048, 256))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(reused, statistics.median(faults[3:]))
"""


def test_reusing_freed_memory_stops_page_faults_in_a_cpu_step(tmp_path):
    """`guards.reuse_freed_memory`: once freed blocks stay on the heap, a step that allocates the same
    2 MiB tensors every time (the geodesic step at the CPU bench shape) reuses them instead of
    page-faulting fresh memory in. It runs in a fresh interpreter: malloc's settings are per process,
    and an earlier test's training run has already changed this one's. The median over ten steps after
    three of warm-up: a step in which the heap grows once takes a block's worth of faults (about 513)
    either way. Bound: under glibc's defaults every step takes hundreds (one per 4 KiB page of each
    re-mapped block: medians of 752 to 1,024 in four processes on a 2-core x86-64 Linux machine, the
    call left out); reused, 0 in eight; 50 separates them."""
    import platform

    from guards import MALLOC_SETTINGS

    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("no glibc malloc to configure on this platform")
    if os.environ.keys() & MALLOC_SETTINGS:
        pytest.skip("the user's malloc settings take precedence")
    script = tmp_path / "faults.py"
    script.write_text(FAULTS_PER_STEP)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    reused, per_step = out.stdout.split()[-2:]
    assert reused == "True", "mallopt refused the settings on Linux with glibc"
    assert float(per_step) < 50


# ----------------------------------------------------------------------------- under torch.compile

def node_cases() -> list[tuple]:
    """Each hand-written node with float64 inputs that reach its branches: a gain or none, a shift, a binding clamp."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_()

    def scalar(value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float64, requires_grad=True)

    x, y, clamps = r(3, 5, 8), r(3, 5, 8), (math.pi / 4, -math.pi / 4)
    return [(RMSNormFunction, (x, r(8), 1e-6)), (RMSNormFunction, (x, None, 1e-6)),
            (RMSNormFunction, (r(3, 5, 2, 4), r(2, 4), 1e-6)), (UnitNormFunction, (x, 1e-12)),
            (NormalizedLerpFunction, (x, y, r(8, scale=0.1).abs().detach().requires_grad_(), 1e-12)),
            (SquashFunction, (x, r(), None, r(8), r(8), False)), (SquashFunction, (x, r(), r(), r(8), None, True)),
            # |s| / |x| ~ 0.6: theta' = 0.7 (1.5 ratio + 0.5) clamped at pi/4 for most tokens;
            # |s| / |x| ~ 1: the ratio clamped at pi/4 for some, theta' = 0.7 (0.3 ratio + 0.1) never
            (GeodesicStepFunction, (x, r(3, 5, 8, scale=0.6), scalar(1.5), scalar(0.5), 0.7, *clamps)),
            (GeodesicStepFunction, (x, r(3, 5, 8), scalar(0.3), scalar(0.1), 0.7, *clamps))]


@pytest.mark.parametrize("case", range(len(node_cases())))
def test_each_nodes_formula_is_its_math(case):
    """`fused` runs a node's `formula` under torch.compile: in float64 it gives the node's output and gradients
    to rounding (the same expressions in another order: 1e-12 relative)."""
    node, args = node_cases()[case]
    tensors = [a for a in args if torch.is_tensor(a)]
    out, reference = node.formula(*args), node.apply(*args)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), tensors)
    expected = torch.autograd.grad((reference * weights).sum(), tensors)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_compiled_models_trace_the_formulas_not_the_nodes():
    """Under torch.compile no hand-written node is traced (GeoNorm's step and nGPT's update, the two whose
    compiled gradients torch 2.11 got wrong, among them): dynamo's graph holds plain ops only."""
    graphs = []

    def keep(gm, inputs):
        graphs.append(gm.code)
        return gm.forward

    for scheme, norm in (("geonorm", "layernorm"), ("ngpt", "layernorm"), ("dnt", "rmsnorm"), ("pre", "derf")):
        torch._dynamo.reset()
        graphs.clear()
        model = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16, norm_scheme=scheme,
                              norm=norm))
        idx = torch.randint(0, 32, (2, 8))
        torch.compile(model, backend=keep)(idx, idx)
        assert len(graphs) == 1 and "autograd_function_apply" not in graphs[0], scheme

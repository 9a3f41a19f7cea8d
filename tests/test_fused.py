"""Each hand-written autograd node of fused.py against the plain formula it computes (layers.py, ngpt.py): the
forward to rounding, torch.autograd.gradcheck in float64, and autograd's gradients through the formula."""

import math

import pytest
import torch
from torch.nn import functional as F

from fused import (
    GeodesicStepFunction,
    fast_derf,
    fast_dyt,
    fast_geodesic_step,
    fast_normalized_lerp,
    fast_rms_norm,
    fast_unit_norm,
    fused,
)
from layers import derf, dyt, geodesic_step, rms_norm
from ngpt import normalized_lerp, unit_norm


def rand(*shape, scale=1.0, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_()


def gain(*shape) -> torch.Tensor:
    """A per-channel gain around 1, away from its init."""
    return (1 + rand(*shape, scale=0.3, seed=1)).detach().requires_grad_()


def scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64, requires_grad=True)


def unit_inputs() -> torch.Tensor:
    """Rows of several lengths, one of them below the floor eps = 0.1 used with it (x / eps there)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(0.2, 3.0, 5, dtype=torch.float64)[:, None]
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64) * lengths
    x[0, 0] *= 1e-3
    return x.requires_grad_()


def lerp_inputs() -> tuple:
    """h on the sphere, y (one row below the floor eps = 0.1: Norm(y) = y / eps there) and per-channel w; one
    row of h shrunk so that h + w (Norm(y) - h) falls below the floor too."""
    y = unit_inputs()
    g = torch.Generator().manual_seed(1)
    h = F.normalize(torch.randn(3, 5, 16, generator=g, dtype=torch.float64), dim=-1)
    h[1, 2] *= 1e-3
    w = 0.01 + 0.09 * torch.rand(16, generator=g, dtype=torch.float64)
    m = torch.lerp(h, F.normalize(y, dim=-1, eps=0.1), w)
    assert torch.linalg.vector_norm(m[1, 2]) < 0.1 < torch.linalg.vector_norm(m[0, 1])
    assert torch.linalg.vector_norm(y[0, 0]) < 0.1 < torch.linalg.vector_norm(y[0, 1])
    return h.requires_grad_(), y, w.requires_grad_(), 0.1


def squash_inputs(shift: bool, bias: bool) -> tuple:
    """x spread so that tanh and erf saturate on some entries; parameters away from their init."""
    x = rand(3, 5, 16, scale=3.0)
    alpha, weight = scalar(0.7), torch.linspace(0.5, 2.0, 16, dtype=torch.float64).requires_grad_()
    b = torch.linspace(-1.0, 1.0, 16, dtype=torch.float64).requires_grad_() if bias else None
    return (x, alpha, scalar(0.3), weight, b) if shift else (x, alpha, weight, b)


def step_inputs(shape=(2, 6, 16), seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """x, and s from much shorter than x to much longer (small angles and a saturated clamp in one batch)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    lengths = torch.linspace(0.05, 5.0, shape[1], dtype=torch.float64)[:, None]
    s = torch.randn(shape, generator=g, dtype=torch.float64) * lengths
    return x, s


def upper_clamp_binds(x, s, a: float, b: float, decay: float, clamp: float) -> torch.Tensor:
    """Per token: whether eq. 5's final min(., c) cuts the angle, (a min(||v|| / ||x||, c) + b) decay > c."""
    radius = torch.linalg.vector_norm(x, dim=-1)
    tangent = s - ((x * s).sum(-1) / radius**2)[..., None] * x
    ratio = torch.linalg.vector_norm(tangent, dim=-1) / radius
    return (a * ratio.clamp_max(clamp) + b) * decay > clamp


# upper_binds: on how many tokens of `step_inputs` the upper clamp sets theta' = c ("none", "some", "all");
# there theta' does not depend on a, b or the tangent's length, so their gradients through the angle vanish
STEPS = {
    "identity": (1.0, 0.0, 1.0, math.pi / 4, "none"), "decayed": (0.7, 0.05, 0.5, math.pi / 4, "none"),
    "pi/8": (1.3, -0.4, 1 / 3, math.pi / 8, "none"), "backwards": (-2.0, 0.1, 1.0, math.pi / 2, "none"),
    "some_clamped": (10.0, 0.0, 1.0, math.pi / 4, "some"),  # long tangents clamped, the two short ones not
    "all_clamped": (1.0, 1.0, 1.0, math.pi / 4, "all"),
}


def step_case(name: str, sides: str) -> tuple:
    a, b, decay, clamp, upper_binds = STEPS[name]
    x, s = step_inputs()
    n_bound = int(upper_clamp_binds(x, s, a, b, decay, clamp).sum())
    assert {"none": n_bound == 0, "some": 0 < n_bound < 12, "all": n_bound == 12}[upper_binds]
    lowest = -clamp if sides == "both" else -math.inf
    return x.requires_grad_(), s.requires_grad_(), scalar(a), scalar(b), decay, clamp, lowest


# (node, its plain formula, inputs that reach its branches)
CASES = {
    "rms_norm": (fast_rms_norm, rms_norm, lambda: (rand(3, 5, 8), gain(8), 1e-6)),
    "rms_norm-no_gain": (fast_rms_norm, rms_norm, lambda: (rand(3, 5, 8), None, 1e-6)),
    "rms_norm-per_head": (fast_rms_norm, rms_norm, lambda: (rand(3, 5, 2, 4), gain(2, 4), 1e-6)),
    "rms_norm-eps": (fast_rms_norm, rms_norm, lambda: (rand(3, 5, 8, scale=0.1), None, 0.01)),
    "unit_norm": (fast_unit_norm, unit_norm, lambda: (unit_inputs(), 0.1)),
    "normalized_lerp": (fast_normalized_lerp, normalized_lerp, lerp_inputs),
    "dyt": (fast_dyt, dyt, lambda: squash_inputs(shift=False, bias=False)),
    "dyt-bias": (fast_dyt, dyt, lambda: squash_inputs(shift=False, bias=True)),
    "derf": (fast_derf, derf, lambda: squash_inputs(shift=True, bias=False)),
    "derf-bias": (fast_derf, derf, lambda: squash_inputs(shift=True, bias=True)),
    **{f"geodesic_step-{name}-{sides}": (fast_geodesic_step, geodesic_step, lambda n=name, s=sides: step_case(n, s))
       for name in STEPS for sides in ("upper", "both")},
}


def tensors(args: tuple) -> list[torch.Tensor]:
    return [a for a in args if torch.is_tensor(a) and a.requires_grad]


@pytest.mark.parametrize("case", CASES)
def test_node_forward_equals_its_formula(case):
    fast, plain, inputs = CASES[case]
    args = inputs()
    # float64, the same math with its operations regrouped: each op rounds at 1e-16 relative, and a few
    # dozen of them stay far below 1e-12
    torch.testing.assert_close(fast(*args), plain(*args), rtol=1e-12, atol=1e-12)


# At a = 1, b = 0, decay 1 (a GeoNorm step at init) a token whose ratio is clamped has theta' = c exactly, on
# the kink of the outer clamp: finite differences in a and b there see half of each side. The two cases are
# checked against the formula's gradients above and below, only not by gradcheck.
@pytest.mark.parametrize("case", [case for case in CASES if not case.startswith("geodesic_step-identity")])
def test_node_passes_gradcheck(case):
    fast, _, inputs = CASES[case]
    args = inputs()
    given = tensors(args)

    def node(*ts):
        it = iter(ts)
        return fast(*(next(it) if torch.is_tensor(a) and a.requires_grad else a for a in args))

    assert torch.autograd.gradcheck(node, given)


# "identity" puts saturated tokens exactly on the clamp's kink (theta' = c at a = 1, b = 0), where the node and
# autograd may pick different subgradients; the other step cases lie on either side of it
@pytest.mark.parametrize("case", [case for case in CASES if not case.startswith("geodesic_step-identity")])
def test_node_gradients_equal_autograd_through_its_formula(case):
    fast, plain, inputs = CASES[case]
    args = inputs()
    given = tensors(args)
    out = fast(*args)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = torch.autograd.grad(out, given, upstream)
    expected = torch.autograd.grad(plain(*args), given, upstream)
    # float64, both sides sums of the same terms in another order; the gradients sum over up to 240
    # entries, each rounding at 1e-16 relative: 1e-10 leaves room for the cancellations among them
    for i, (got, want) in enumerate(zip(grads, expected, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"{case}: input {i}")


def test_fused_runs_the_node_in_eager_mode_and_the_formula_under_compile():
    x = rand(2, 8)
    assert fused(fast_unit_norm, unit_norm, x, 1e-12).grad_fn.name() == "UnitNormFunctionBackward"
    seen = []

    def plain(x, eps):
        seen.append(torch.compiler.is_compiling())
        return unit_norm(x, eps)

    torch.compile(lambda x: fused(fast_unit_norm, plain, x, 1e-12), backend="eager", fullgraph=True)(x)
    assert seen == [True]


# ----------------------------------------------------------------------------- edges the cases above avoid


def test_geodesic_step_guards_a_zero_tangent_like_eq5():
    """s parallel to x: the tangent is rounding noise, ||v|| is clamped to 1e-8 and the step leaves x
    where it is (the gradient there is noise over 1e-8, so only the forward is compared)."""
    x, s = step_inputs()
    s[0, 0] = 3 * x[0, 0]
    a, b = torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    out = GeodesicStepFunction.apply(x, s, a, b, 1.0, math.pi / 4, -math.inf)
    # float64, rounding only
    torch.testing.assert_close(out, geodesic_step(x, s, a, b, 1.0, math.pi / 4), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0, 0], x[0, 0], rtol=1e-12, atol=1e-12)


def test_geodesic_step_gradients_at_the_norm_floors_equal_eq5():
    """Where a floor acts, r = max(||x||, 1e-6) and n = max(||v||, 1e-8) are constants in x and v: a token
    with ||x|| = 1e-8 and one whose tangent has norm 1e-10 take the same gradients as autograd through
    eq. 5, which passes through the same floors. At the second token b = 0.05 makes the step k = r
    sin(theta') / n large, and the term a missing n floor would add to ds is about (||v|| / n)^2 = 1e-4
    of k g: far above rounding. (With a tangent of rounding noise, 1e-15, it would be 1e-14 of it.)
    gradcheck's steps of 1e-6 would cross both floors, so only autograd's gradients are compared.
    The tangent of norm 1e-10 carries the rounding of s - q x (|s| ~ 10: ~1e-15, a relative 1e-5), which the
    step k ~ 1e7 multiplies: the node and the formula, which round it differently, differ there by up to
    1e-8 in the output and b's gradient (ds ~ 1e7 takes it within rtol). atol 1e-7 allows that and is
    ten orders of magnitude below what a missing floor would add."""
    x, s = step_inputs()
    x[1, 2] *= 1e-8 / torch.linalg.vector_norm(x[1, 2])
    across = torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    across -= (across @ x[0, 0]) / (x[0, 0] @ x[0, 0]) * x[0, 0]
    s[0, 0] = 3 * x[0, 0] + 1e-10 * across / torch.linalg.vector_norm(across)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for fn in (GeodesicStepFunction.apply, geodesic_step):
        xs = [x.clone().requires_grad_(), s.clone().requires_grad_(), scalar(0.7), scalar(0.05)]
        out = fn(*xs, 0.5, math.pi / 4, -math.inf)
        out.backward(grad_out)
        results.append([out.detach()] + [t.grad for t in xs])
    for name, fast, reference in zip(("out", "dx", "ds", "da", "db"), *results, strict=True):
        torch.testing.assert_close(fast, reference, rtol=1e-12, atol=1e-7, msg=name)


def test_geodesic_step_float32_forward_equals_its_formula():
    x, s = (t.float() for t in step_inputs(shape=(4, 64, 256)))
    a, b = torch.tensor(0.9), torch.tensor(0.02)
    # float32, sums taken in another order: a few ulps of the output's scale
    torch.testing.assert_close(fast_geodesic_step(x, s, a, b, 0.5, math.pi / 4, -math.inf),
                               geodesic_step(x, s, a, b, 0.5, math.pi / 4), rtol=2e-6, atol=2e-6)


def test_unit_norm_equals_f_normalize():
    x, upstream = unit_inputs(), torch.randn(3, 5, 16, dtype=torch.float64)
    fast, reference = fast_unit_norm(x, 0.1), F.normalize(x, dim=-1, eps=0.1)
    # float64, the same operations in another order: rounding only
    torch.testing.assert_close(fast, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(fast, x, upstream)[0],
                               torch.autograd.grad(reference, x, upstream)[0], rtol=1e-10, atol=1e-12)


def test_unit_norm_in_bf16_is_within_rounding_of_float64():
    torch.manual_seed(0)
    x = torch.randn(8, 4, 32, 64).bfloat16().requires_grad_()
    upstream = torch.randn(8, 4, 32, 64).bfloat16()
    y = fast_unit_norm(x, 1e-12)
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


def test_normalized_lerp_takes_a_bf16_sublayer_output_into_a_float32_stream():
    torch.manual_seed(0)
    h = F.normalize(torch.randn(4, 32, 64), dim=-1).requires_grad_()
    y = torch.randn(4, 32, 64).bfloat16().requires_grad_()
    w = (0.05 * torch.rand(64)).requires_grad_()
    upstream = torch.randn(4, 32, 64)
    out = fast_normalized_lerp(h, y, w, 1e-12)
    out.backward(upstream)
    assert out.dtype == h.grad.dtype == w.grad.dtype == torch.float32 and y.grad.dtype == torch.bfloat16
    exact = [t.detach().double().requires_grad_() for t in (h, y, w)]
    out64 = normalized_lerp(*exact, 1e-12)
    out64.backward(upstream.double())
    # the bf16 values of y are read exactly and everything runs in float32 (relative rounding 2^-24 per op,
    # a few dozen ops): 1e-5 of each tensor's scale; y's gradient is then rounded once to bf16 (2^-8)
    for ours, reference, bound in ((out, out64, 1e-5), (h.grad, exact[0].grad, 1e-5),
                                   (w.grad, exact[2].grad, 1e-5), (y.grad, exact[1].grad, 2**-8)):
        scale = reference.abs().max().item()
        assert (ours.double() - reference).abs().max().item() < bound * scale

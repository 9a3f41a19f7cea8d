"""The primitives as the model runs them in lower precision (GeoNorm's geodesic step, RMSNorm, DyT/Derf under
autocast, RMSNorm against torch's own), GeoNorm's named readings (the sqrt(d) sphere, the App. D listing's
computation), and one implementation per primitive: no hand-written backward anywhere in the model."""

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from model import (
    GPT,
    DynamicErf,
    DynamicTanh,
    GeodesicStep,
    GPTConfig,
    HeadwiseRMSNorm,
    RMSNorm,
    geodesic_step,
)


def step_inputs(dtype=torch.float64, shape=(2, 6, 16), seed=0, parallel_token=False):
    """x, s with small angles and the clamp saturated (s much longer than x) in one batch; optionally a token
    with s parallel to x (zero tangent up to rounding, where the 1e-8 guard acts)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype)
    s = torch.randn(shape, generator=g, dtype=dtype) * torch.linspace(0.05, 5.0, shape[1], dtype=dtype)[:, None]
    if parallel_token:
        s[0, 0] = 3 * x[0, 0]
    return x, s


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
    torch.testing.assert_close(out, geodesic_step(x, s.float(), step.a, step.b, 0.5, math.pi / 4),
                               rtol=2e-6, atol=2e-6)


# ----------------------------------------------------------------------------- RMSNorm


def rms_reference(x: torch.Tensor, weight: torch.Tensor | float, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


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


def test_headwise_norm_is_per_head_rms_then_a_per_channel_gain():
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


@pytest.mark.parametrize("kind", [DynamicTanh, DynamicErf])
def test_dyt_and_derf_modules_squash_bf16_inputs_in_bf16_within_rounding(kind):
    """A bf16 input (a sub-layer output under autocast, at a Sandwich mid-norm) is squashed in bf16, then
    promoted by the float32 weight, as the eager formula does."""
    norm = kind(16, 0.7, bias=True)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
        if kind is DynamicErf:
            norm.shift.fill_(0.3)
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 16, generator=g)).bfloat16().requires_grad_()
    y = norm(x)
    assert y.dtype == torch.float32
    upstream = torch.randn(4, 16, generator=g)
    y.backward(upstream)
    assert x.grad.dtype == torch.bfloat16 and norm.alpha.grad.dtype == torch.float32
    x64 = x.detach().double().requires_grad_()
    p = {name: param.detach().double() for name, param in norm.named_parameters()}
    if kind is DynamicErf:  # Derf: gamma erf(alpha x + s) + beta
        y64 = p["weight"] * torch.erf(p["alpha"] * x64 + p["shift"]) + p["bias"]
    else:  # DyT eq. 1: gamma tanh(alpha x) + beta
        y64 = p["weight"] * torch.tanh(p["alpha"] * x64) + p["bias"]
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
from nanonorm import guards
from model import GeodesicStep
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

    from nanonorm.guards import MALLOC_SETTINGS

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

def test_the_model_has_no_hand_written_backward():
    """Each primitive has one implementation, the formula autograd differentiates: no torch.autograd.Function in
    model.py or the columns it imports (speed comes from torch.compile)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for path in (root / "model.py", root / "nanonorm" / "columns.py"):
        tree = ast.parse(path.read_text())
        bases = [ast.unparse(b) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for b in node.bases]
        assert not [b for b in bases if b.endswith("Function")], path.name
        assert "backward" not in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}

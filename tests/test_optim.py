"""Tests for optim.py: each optimizer against its formula or torch's reference, msign against
the SVD, Manifold Muon's constraint and dual ascent, checkpoints, routing and sharding."""

import io
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_run_args
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import optim
import train
from optim import (
    OPTIMIZERS,
    SGDW,
    ManifoldMuon,
    Muon,
    build_optimizer,
    msign,
    split_params,
    zeropower_newton_schulz,
)

FLOAT32_EPS = torch.finfo(torch.float32).eps
SHAPES = {"tall": (24, 8), "wide": (8, 24), "square": (12, 12)}


class TinyGPT(nn.Module):
    """The parameter kinds of a GPT: blocks of Linear layers (a tall and a wide weight), norms,
    a 0-D scalar, an embedding tied to the head. Task: predict a fixed function of the token."""

    def __init__(self, vocab: int = 11, d: int = 8, n_layer: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(ln=nn.LayerNorm(d), fc=nn.Linear(d, 2 * d),
                               proj=nn.Linear(2 * d, d, bias=False)))
            for _ in range(n_layer))
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = x + self.scale * block["proj"](torch.tanh(block["fc"](block["ln"](x))))
        return self.lm_head(self.ln_f(x))


def tiny_batch(step: int, rank: int = 0, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    idx = torch.randint(0, vocab, (16,), generator=g)
    return idx, (3 * idx + 1) % vocab


def tiny_loss(model: nn.Module, step: int, rank: int = 0) -> torch.Tensor:
    idx, target = tiny_batch(step, rank)
    return nn.functional.cross_entropy(model(idx), target)


# Learning rates at which each optimizer trains TinyGPT (lr: AdamW side; matrix_lr: Muons').
TINY_SETTINGS = {
    "adamw": dict(lr=1e-2),
    "sgdw": dict(lr=0.03),
    "muon": dict(lr=1e-2, matrix_lr=0.05),
    "manifold_muon": dict(lr=1e-2, matrix_lr=0.2),
}


def build_tiny(name: str, model: nn.Module, **extra) -> torch.optim.Optimizer:
    settings = {**TINY_SETTINGS[name], **extra}
    lr = settings.pop("lr")
    return build_optimizer(model, name, lr=lr, weight_decay=0.1, betas=(0.9, 0.95),
                           device_type="cpu", **settings)


def train_tiny(model, optimizer, steps, start=0, rank=0, ddp=None):
    for step in range(start, start + steps):
        loss = tiny_loss(ddp or model, step, rank)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return loss.item()


# ----------------------------------------------------------------------------------------------
# SGDW


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sgdw_matches_msgdw_formula(nesterov, weight_decay):
    torch.manual_seed(0)
    lr, mu = 0.3, 0.9
    p = nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    w, buf = p.detach().clone(), torch.zeros_like(p)
    optimizer = SGDW([p], lr=lr, momentum=mu, weight_decay=weight_decay, nesterov=nesterov)
    for _ in range(6):
        g = torch.randn_like(w)
        p.grad = g.clone()
        optimizer.step()
        buf = mu * buf + g  # DNT's mSGDW, dampening 0
        direction = g + mu * buf if nesterov else buf
        w = w * (1 - lr * weight_decay) - lr * direction
        # float64 and the same operations; only a fused multiply-add in p - lr*d may round
        # differently (1 ulp ~ 2e-16 per step on values of order 1), hence 1e-13.
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-13)
    assert list(optimizer.state[p]) == ["momentum_buffer"]  # one state tensor per parameter


# ----------------------------------------------------------------------------------------------
# Muon


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("adjust_lr", optim.MUON_LR_ADJUSTMENTS)
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matrix_update_equals_torch_muon(shape, adjust_lr, nesterov):
    torch.manual_seed(0)
    ours = nn.Parameter(torch.randn(shape))
    ref = nn.Parameter(ours.detach().clone())
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, ns_steps=5)
    ours_opt = Muon([ours], adjust_lr=adjust_lr, ns_dtype="bfloat16", **settings)  # torch.optim.Muon's dtype
    ref_opt = torch.optim.Muon([ref], adjust_lr_fn=adjust_lr, **settings)
    for _ in range(5):
        g = torch.randn(shape)
        ours.grad, ref.grad = g.clone(), g.clone()
        ours_opt.step()
        ref_opt.step()
        # Exact: the same sequence of bfloat16 / float32 operations on the same inputs.
        assert torch.equal(ours, ref)
    assert torch.equal(ours_opt.state[ours]["momentum_buffer"],
                       ref_opt.state[ref]["momentum_buffer"])


@pytest.mark.parametrize("batch_size", [16, 2])
def test_muon_batches_equal_shapes_bit_for_bit_as_torch_muon(batch_size):
    torch.manual_seed(0)
    shapes = [(24, 8), (8, 24), (24, 8), (12, 12), (24, 8), (8, 24), (12, 12)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
    ours_opt = Muon(ours, ns_dtype="bfloat16", **settings)
    ours_opt.BATCH_SIZE = batch_size
    ref_opt = torch.optim.Muon(ref, adjust_lr_fn="original", **settings)
    batches = ours_opt._batches([(p, ours_opt.param_groups[0], False) for p in ours])
    expected = [3, 2, 2] if batch_size == 16 else [2, 1, 2, 2]  # by exact shape: tall apart from wide
    assert [len(b) for b in batches] == expected
    for _ in range(3):
        for p, q in zip(ours, ref, strict=True):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        ours_opt.step()
        ref_opt.step()
        # exact: the CPU's batched bfloat16 matmuls give the bits of one matrix at a time
        for p, q in zip(ours, ref, strict=True):
            assert torch.equal(p, q)


def test_muon_runs_newton_schulz_in_the_dtype_the_hardware_multiplies():
    """"auto": bfloat16 on a GPU or a CPU with native bfloat16 matmuls, float32 where they are emulated (30-40x
    slower there); the step is then exactly the one of that dtype given by name."""
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert optim.newton_schulz_dtype(torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert optim.newton_schulz_dtype(torch.device("cuda")) == torch.bfloat16
    torch.manual_seed(0)
    start, grads = torch.randn(16, 8), [torch.randn(16, 8) for _ in range(3)]
    steps = {}
    for dtype in ("auto", "bfloat16", "float32"):
        p = nn.Parameter(start.clone())
        opt = Muon([p], lr=0.02, ns_dtype=dtype)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        steps[dtype] = p.detach()
    assert torch.equal(steps["auto"], steps["bfloat16" if native else "float32"])
    assert not torch.equal(steps["bfloat16"], steps["float32"])
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([nn.Parameter(start.clone())], ns_dtype="fp8")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_muon_on_cuda_matches_the_cpu_step():
    torch.manual_seed(0)
    shapes = [(24, 8), (24, 8), (8, 24), (11,), (5, 3)]  # matrices, then a gain and an embedding
    cpu = [nn.Parameter(torch.randn(s)) for s in shapes]
    gpu = [nn.Parameter(p.detach().cuda()) for p in cpu]

    def build(params):
        return Muon(params[:3], lr=0.02, weight_decay=0.1, adamw_lr=3e-3, ns_dtype="bfloat16",
                    adamw_params=[{"params": [params[3]]}, {"params": [params[4]], "weight_decay": 0.1}])

    cpu_opt, gpu_opt = build(cpu), build(gpu)
    for _ in range(5):
        for p, q in zip(cpu, gpu, strict=True):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.cuda()
        cpu_opt.step()
        gpu_opt.step()
    assert all(gpu_opt.state[p]["step"].is_cuda for p in gpu[3:])  # the fused kernel's state
    # AdamW: the fused kernel and the CPU's for-loop differ by float32 rounding only (~1e-7)
    for p, q in zip(cpu[3:], gpu[3:], strict=True):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-6)
    # Muon: bfloat16 Newton-Schulz, whose rounding a GPU's matmuls may place differently: each of
    # 5 steps moves entries by lr * O(1), a few bfloat16 ulps (0.4% each) of that, so 2e-3.
    for p, q in zip(cpu[:3], gpu[:3], strict=True):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=0, atol=2e-3)


def muon_scalar_map(s: np.ndarray, steps: int = 5) -> np.ndarray:
    """What Muon's iteration does to a relative singular value s/||G||_F, in float64."""
    a, b, c = optim.MUON_NS_COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def test_muon_band_of_the_scalar_map():
    # Over s/||G||_F in [0.006, 1] the 5-step map ranges over [0.682, 1.134]: the literature's
    # [0.68, 1.13]. Below 0.006 it overshoots (up to 1.20 near s = 0.004); below 0.0015 it
    # undershoots 0.68.
    s = np.logspace(math.log10(0.006), 0, 20001)
    out = muon_scalar_map(s)
    assert 0.68 < out.min() < 0.685 and 1.13 < out.max() < 1.135


@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (48, 48)], ids=["tall", "wide", "square"])
def test_newton_schulz_singular_values_follow_scalar_map(shape):
    torch.manual_seed(0)
    G = torch.randn(shape)
    s = (torch.linalg.svdvals(G.double()) / G.double().norm()).numpy()
    expected = np.sort(muon_scalar_map(s))
    got = np.sort(torch.linalg.svdvals(zeropower_newton_schulz(G).double()).numpy())
    # bfloat16 keeps 8 bits: each of the 5 steps rounds by about 2^-8 = 0.004 relative, and
    # later steps amplify earlier errors by the map's slope (up to ~3 inside the band); measured
    # deviations up to 0.022 (sorting pairs values only approximately: the map is not
    # monotonic), so 0.05.
    assert np.abs(got - expected).max() < 0.05
    # The band itself, with 0.02 (5 bfloat16 ulps at 1) for the last step's rounding; measured
    # [0.679, 1.136] on these inputs.
    if s.min() >= 0.006:  # tall and wide Gaussians (s_min ~ 0.06); the square one has 0.0026
        assert 0.68 - 0.02 <= got.min() and got.max() <= 1.134 + 0.02


def test_muon_adamw_groups_equal_torch_adamw():
    torch.manual_seed(0)
    shapes = [(6, 4), (7,), (5, 3)]  # a matrix for Muon, then a vector and a 2-D "embedding"
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours[1:]]
    adamw = dict(lr=3e-3, betas=(0.9, 0.98), eps=1e-8)
    ours_opt = Muon([ours[0]], lr=0.02, adamw_lr=adamw["lr"], adamw_betas=adamw["betas"],
                    adamw_eps=adamw["eps"],
                    adamw_params=[{"params": [ours[1]]},
                                  {"params": [ours[2]], "weight_decay": 0.1}])
    ref_opt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.0},
                                 {"params": [ref[1]], "weight_decay": 0.1}], **adamw)
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(ours, grads, strict=True):
            p.grad = g.clone()
        for p, g in zip(ref, grads[1:], strict=True):
            p.grad = g.clone()
        ours_opt.step()
        ref_opt.step()
        for p, q in zip(ours[1:], ref, strict=True):
            assert torch.equal(p, q)  # exact: torch's own functional AdamW on the same inputs
    assert ours_opt.state[ours[2]].keys() == ref_opt.state[ref[1]].keys()


# ----------------------------------------------------------------------------------------------
# msign


def msign_scalar_map(s: torch.Tensor, steps: int = 10) -> torch.Tensor:
    """What msign does to a relative singular value s/||G||_F, in float64."""
    for i in range(steps):
        polish = i >= steps - optim.POLISH_STEPS
        a, b, c = optim.POLISH_NS_COEFFICIENTS if polish else optim.MUON_NS_COEFFICIENTS
        s = a * s + b * s**3 + c * s**5
    return s


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (40, 40)], ids=["tall", "wide", "square"])
@pytest.mark.parametrize("condition", [1e1, 1e3, 1e4, 1e6])
def test_msign_matches_svd_polar_factor(shape, condition):
    torch.manual_seed(0)
    n, m = shape
    k = min(shape)
    U, _ = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(m, k, dtype=torch.float64))
    s = torch.logspace(0, -math.log10(condition), k, dtype=torch.float64)
    G = (U * s) @ V.T
    err = torch.linalg.matrix_norm(msign(G.float()).double() - U @ V.T, ord=2).item()
    # In exact arithmetic msign(G) = U phi(S/||G||_F) V^T, so the spectral error is
    # max_i |phi(s_i) - 1|: below 1e-9 for s_min/||G||_F >= 1e-4 (conditions up to 1e3),
    # but unresolved singular values (condition 1e6) stay far from 1.
    unresolved = (msign_scalar_map(s / s.norm()) - 1).abs().max().item()
    # Float32 rounding (eps * ||G||_F per step) moves the polar factor by up to
    # eps * ||G||_F / s_min (its condition number); measured 0.2-0.7 of that, so 4x.
    rounding = 4 * FLOAT32_EPS * (s.norm() / s.min()).item()
    assert err <= unresolved + rounding
    if condition <= 1e3:
        assert err < 1e-4  # well-resolved inputs: msign is U V^T to float32 accuracy


# ----------------------------------------------------------------------------------------------
# Manifold Muon


def tall_view(W: torch.Tensor) -> torch.Tensor:
    return W.mT if W.size(0) < W.size(1) else W


def stiefel_error(W: torch.Tensor) -> float:
    W = tall_view(W.detach())
    return (W.mT @ W - torch.eye(W.size(1))).abs().max().item()


# The optimizer Bir et al. train with in their released code, in this class's options.
RELEASED_SETTINGS = dict(nesterov=False, gradient_scale="raw", dual_init="zero", dual_lr=0.1)
STIEFEL_SHAPES = {"tall": (24, 8), "wide": (8, 24), "square": (24, 24)}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("settings", [{}, RELEASED_SETTINGS], ids=["defaults", "released"])
@pytest.mark.parametrize("shape", STIEFEL_SHAPES.values(), ids=STIEFEL_SHAPES.keys())
def test_manifold_muon_stays_on_stiefel_at_every_rate(shape, settings):
    # Square matrices at lr ~1 are the hard case: without the tangent projection W - lr A was
    # nearly singular and max|W^T W - I| reached 0.45 from the second step on.
    worst = {}
    for lr in (0.01, 0.03, 0.1, 0.3, 1.0, 2.0):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(shape))  # not orthogonal: projected at the first step
        optimizer = ManifoldMuon([p], lr=lr, **settings)
        for _ in range(30):
            p.grad = 0.1 * torch.randn(shape)
            optimizer.step()
            # the bound asked for after every step; measured <= 5e-7 (float32 rounding).
            worst[lr] = max(worst.get(lr, 0.0), stiefel_error(p))
            dual = optimizer.state[p]["dual"]
            assert torch.equal(dual, dual.mT)  # symmetric exactly: H = M + M^T in floating point
        assert dual.shape == (min(shape), min(shape))
    assert max(worst.values()) <= 1e-3, worst


@pytest.mark.parametrize("lr", [0.0, 1e-3, 0.1, 1.0, 10.0, 100.0])
def test_retraction_is_the_polar_factor_at_any_rate(lr):
    torch.manual_seed(0)
    W = torch.linalg.qr(torch.randn(40, 16, dtype=torch.float64))[0]
    T = optim.project_tangent(W, svd_polar(torch.randn(40, 16, dtype=torch.float64)))
    assert (W.mT @ T + T.mT @ W).abs().max() < 1e-12  # tangent: W^T T is skew
    R = optim.retract(W.float(), T.float(), lr).double()
    # retraction_steps brings every singular value within 1e-7 of 1 in exact arithmetic, and the
    # polar factor is well conditioned (the singular values of W - lr T are >= 1), so float32
    # rounding adds little: measured <= 2e-7 at every lr, so 1e-6.
    assert (R - svd_polar(W - lr * T)).abs().max() < 1e-6


def svd_polar(M: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    return U @ Vh


def manifold_muon_reference(W, grads, lr, momentum=0.95, nesterov=True, gradient_scale="unit_rms",
                            dual_init="bernstein", dual_steps=1, dual_lr=0.01):
    """ManifoldMuon's docstring transcribed in float64 with SVD polar factors, for tall W."""
    k = W.size(1)
    W, buf = svd_polar(W), torch.zeros_like(W)
    for step, g in enumerate(grads):
        buf = momentum * buf + (1 - momentum) * g
        G = (1 - momentum) * g + momentum * buf if nesterov else buf
        if gradient_scale == "unit_rms":
            G = G * k**0.5 / G.norm()
        if step == 0:
            dual = torch.zeros(k, k, dtype=W.dtype) if dual_init == "zero" else -(W.T @ G + G.T @ W) / 4
        for _ in range(dual_steps):
            A = svd_polar(G + 2 * W @ dual)
            dual = dual - dual_lr * (W.T @ A + A.T @ W)
        A = svd_polar(G + 2 * W @ dual)
        A = A - W @ (W.T @ A + A.T @ W) / 2
        W = svd_polar(W - lr * A)
    return W, dual


MANIFOLD_OPTIONS = {
    "defaults": {},
    "released": RELEASED_SETTINGS,
    "nesterov off": dict(nesterov=False),
    "raw gradient": dict(gradient_scale="raw"),
    "dual starts at zero": dict(dual_init="zero"),
    "three dual steps of 0.1": dict(dual_steps=3, dual_lr=0.1),
}


@pytest.mark.parametrize("options", MANIFOLD_OPTIONS.values(), ids=MANIFOLD_OPTIONS.keys())
@pytest.mark.parametrize("wide", [False, True], ids=["tall", "wide"])
def test_manifold_muon_update_equals_its_formula(options, wide):
    torch.manual_seed(0)
    W0, grads = torch.randn(24, 8), [0.1 * torch.randn(24, 8) for _ in range(4)]
    p = nn.Parameter(W0.mT.clone() if wide else W0.clone())
    optimizer = ManifoldMuon([p], lr=0.2, direction_dtype="float32", **options)
    for g in grads:
        p.grad = g.mT.clone() if wide else g.clone()
        optimizer.step()
    W, dual = manifold_muon_reference(W0.double(), [g.double() for g in grads], lr=0.2, **options)
    # float32 msign is the polar factor to ~2e-6 for these well-conditioned 24 x 8 inputs (see
    # test_msign_matches_svd_polar_factor); after 4 steps measured <= 1e-6, so 1e-5.
    assert (tall_view(p.detach()).double() - W).abs().max() < 1e-5
    assert (optimizer.state[p]["dual"].double() - dual).abs().max() < 1e-5


def test_manifold_muon_batches_equal_shapes_as_if_one_at_a_time():
    torch.manual_seed(0)
    shapes = [(24, 8), (8, 24), (24, 8), (12, 12), (24, 8), (8, 24)]
    inits, grads = [torch.randn(s) for s in shapes], [[torch.randn(s) for s in shapes] for _ in range(3)]
    together = [nn.Parameter(w.clone()) for w in inits]
    alone = [nn.Parameter(w.clone()) for w in inits]
    batched = ManifoldMuon(together, lr=0.2)
    singles = [ManifoldMuon([p], lr=0.2) for p in alone]
    batches = batched._batches([(p, batched.param_groups[0], False) for p in together])
    assert sorted(len(b) for b in batches) == [1, 5]  # 24 x 8 and its transpose: one batch
    for step_grads in grads:
        for p, q, g in zip(together, alone, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        batched.step()
        for optimizer in singles:
            optimizer.step()
    # the same arithmetic, batched: bit-identical on the CPU measured; a batched matmul may block
    # differently elsewhere, and float32 rounding through the polar factors stays far below 1e-5.
    for p, q in zip(together, alone, strict=True):
        assert (p - q).abs().max() < 1e-5


def tangent_residual(p: torch.Tensor, grad: torch.Tensor, dual: torch.Tensor) -> float:
    """||W^T A + A^T W||_F / sqrt(k) with A = msign(G + 2 W Lambda), G rescaled as the
    optimizer does (for a constant gradient the momentum direction is parallel to it)."""
    W, G = tall_view(p.detach()), tall_view(grad)
    G = G * (W.size(1) ** 0.5 / G.norm())
    A = msign(G + 2 * W @ dual)
    return ((W.mT @ A + A.mT @ W).norm() / W.size(1) ** 0.5).item()


def test_manifold_muon_dual_ascent_reduces_tangent_residual():
    torch.manual_seed(0)
    shape = (48, 12)  # tall with a well-conditioned G: the dual is smooth near its optimum
    W0 = torch.linalg.qr(torch.randn(shape))[0]
    grad = torch.randn(shape)

    def residual_after(dual_steps, steps=1):
        p = nn.Parameter(W0.clone())
        optimizer = ManifoldMuon([p], lr=0.0, dual_steps=dual_steps)  # lr 0: W frozen
        history = []
        for _ in range(steps):
            p.grad = grad.clone()
            optimizer.step()
            history.append(tangent_residual(p, grad, optimizer.state[p]["dual"]))
        return history

    # More dual steps within one optimizer step: the residual falls (measured 0.17, 0.11, 0.003;
    # the largest possible is 2).
    within = [residual_after(n)[-1] for n in (0, 10, 100)]
    assert within[0] > within[1] > within[2]
    assert within[2] < 0.1 * within[0]
    # Online: over optimizer steps with W frozen, the carried dual keeps improving (measured
    # 0.17 after the first step, 0.003 after the 100th).
    across = residual_after(1, steps=100)
    assert across[-1] < 0.1 * across[0]


def test_manifold_muon_dual_reset_is_tangent_for_square():
    # For square orthogonal W, Lambda = -1/4 (W^T G + G^T W) gives G + 2 W Lambda = W skew(W^T G),
    # whose polar factor W msign(skew) is tangent: H = 0 up to float32 rounding.
    torch.manual_seed(0)
    p = nn.Parameter(torch.linalg.qr(torch.randn(12, 12))[0])
    optimizer = ManifoldMuon([p], lr=0.1, momentum=0.0, dual_steps=0, dual_reset=True)
    for _ in range(5):
        grad = torch.randn(12, 12)
        p.grad = grad.clone()
        W = p.detach().clone()
        optimizer.step()
        dual = optimizer.state[p]["dual"]
        # 1e-4: float32 rounding amplified by the skew part's smallest singular value; measured
        # <= 2e-6.
        assert tangent_residual(W, grad, dual) < 1e-4


def test_manifold_muon_carries_the_dual_across_steps():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(10, 4))
    optimizer = ManifoldMuon([p], lr=0.1, dual_steps=0)  # no ascent: Lambda only carried
    p.grad = torch.randn(10, 4)
    optimizer.step()
    assert stiefel_error(p) < 1e-5  # projected at the first step, then retracted
    first = optimizer.state[p]["dual"].clone()
    for _ in range(3):
        p.grad = torch.randn(10, 4)
        optimizer.step()
        assert torch.equal(optimizer.state[p]["dual"], first)  # not re-initialized


def test_manifold_muon_rejects_weight_decay_on_matrices():
    with pytest.raises(ValueError, match="no weight decay"):
        ManifoldMuon([nn.Parameter(torch.randn(4, 3))], weight_decay=0.1)


# ----------------------------------------------------------------------------------------------
# Checkpoints, routing, training


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_round_trip_resumes_exactly(name):
    k, n = 3, 4
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = build_tiny(name, model)
    train_tiny(model, optimizer, k)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    train_tiny(model, optimizer, n, start=k)  # the uninterrupted run

    torch.manual_seed(1)  # a different init, overwritten by the checkpoint
    resumed = TinyGPT()
    resumed_optimizer = build_tiny(name, resumed)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    train_tiny(resumed, resumed_optimizer, n, start=k)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)  # exact: same arithmetic on the same CPU
    assert all("base_lr" in g for g in resumed_optimizer.param_groups)


def test_split_params_routes_every_parameter_once():
    model = TinyGPT()
    groups = split_params(model)
    routed = [p for ps in groups.values() for p in ps]
    assert len(routed) == len({id(p) for p in routed}) == len(list(model.parameters()))
    matrix_ids = {id(b[name].weight) for b in model.blocks for name in ("fc", "proj")}
    assert {id(p) for p in groups["matrix"]} == matrix_ids
    assert [id(p) for p in groups["decay"]] == [id(model.wte.weight)]  # tied head: once
    assert all(p.ndim <= 1 for p in groups["no_decay"])
    assert any(p.ndim == 0 for p in groups["no_decay"])  # the scalar


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_build_optimizer_decays_only_matrices_and_embeddings(name):
    model = TinyGPT()
    optimizer = build_tiny(name, model)
    seen = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(seen) == len({id(p) for p in seen}) == len(list(model.parameters()))
    for group in optimizer.param_groups:
        assert group["base_lr"] == group["lr"]
        if group["weight_decay"] > 0:
            assert all(p.ndim >= 2 for p in group["params"])
        if group.get("kind") == "matrix" and name == "manifold_muon":
            assert group["weight_decay"] == 0
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(model.wte.weight) in decayed


def test_build_optimizer_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="adamw, sgdw, muon, manifold_muon"):
        build_optimizer(TinyGPT(), "lion", lr=1.0, weight_decay=0.0, betas=(0.9, 0.95),
                        device_type="cpu")
    with pytest.raises(ValueError, match="matrix_lr"):  # the message lists the valid options
        build_optimizer(TinyGPT(), "muon", lr=1.0, weight_decay=0.0, betas=(0.9, 0.95),
                        device_type="cpu", matrix_learning_rate=3)


def test_build_optimizer_sends_each_option_to_its_optimizer():
    # A training script passes every option whatever the optimizer (train.py does).
    everything = dict(momentum=0.5, nesterov=False, matrix_lr=0.05, dual_steps=2, dual_lr=0.02,
                      gradient_scale="raw", dual_init="zero", ns_steps=8, adjust_lr="match_rms_adamw")
    settings = dict(lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9), device_type="cpu")
    sgdw = build_optimizer(TinyGPT(), "sgdw", **settings, **everything)
    assert all(g["momentum"] == 0.5 and not g["nesterov"] and g["lr"] == 1e-3
               for g in sgdw.param_groups)
    for name in ("muon", "manifold_muon"):
        optimizer = build_optimizer(TinyGPT(), name, **settings, **everything)
        matrix, *others = optimizer.param_groups
        assert matrix["kind"] == "matrix" and matrix["lr"] == 0.05
        assert matrix["momentum"] == 0.5 and not matrix["nesterov"]
        assert all(g["kind"] == "adamw" and g["lr"] == 1e-3 and g["betas"] == (0.8, 0.9)
                   for g in others)
    muon = build_optimizer(TinyGPT(), "muon", **settings, **everything).param_groups[0]
    assert (muon["ns_steps"], muon["adjust_lr"]) == (8, "match_rms_adamw")
    manifold = build_optimizer(TinyGPT(), "manifold_muon", **settings, **everything)
    matrix = manifold.param_groups[0]
    assert (matrix["dual_steps"], matrix["dual_lr"], matrix["msign_steps"]) == (2, 0.02, 8)
    assert (matrix["gradient_scale"], matrix["dual_init"]) == ("raw", "zero")


def test_options_left_at_none_keep_each_optimizers_own_defaults():
    none = dict(momentum=None, nesterov=None, matrix_lr=None, ns_steps=None, adjust_lr=None, dual_steps=None)
    settings = dict(lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9), device_type="cpu")
    sgdw = build_optimizer(TinyGPT(), "sgdw", **settings, **none).param_groups[0]
    assert (sgdw["momentum"], sgdw["nesterov"]) == (0.9, False)
    muon = build_optimizer(TinyGPT(), "muon", **settings, **none).param_groups[0]
    assert (muon["lr"], muon["momentum"], muon["nesterov"], muon["ns_steps"]) == (0.02, 0.95, True, 5)
    manifold = build_optimizer(TinyGPT(), "manifold_muon", **settings, **none).param_groups[0]
    assert (manifold["lr"], manifold["momentum"], manifold["msign_steps"], manifold["dual_steps"]) == (0.1, 0.95, 10, 1)


def test_muon_decays_its_matrices_by_weight_decay_and_manifold_muon_not_at_all():
    settings = dict(lr=0.1, betas=(0.9, 0.95), device_type="cpu", matrix_lr=0.5)
    model = TinyGPT()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradients: each step is the decay alone
    before = {p: p.detach().clone() for p in model.parameters()}
    muon = build_optimizer(model, "muon", weight_decay=0.2, **settings)
    muon.step()
    matrix, decay, no_decay = muon.param_groups
    assert [g["weight_decay"] for g in (matrix, decay, no_decay)] == [0.2, 0.2, 0.0]
    for p in matrix["params"]:  # decoupled: p (1 - lr wd), with the matrices' own lr
        torch.testing.assert_close(p.detach(), before[p] * (1 - 0.5 * 0.2), rtol=0, atol=0)
    for p in decay["params"]:
        torch.testing.assert_close(p.detach(), before[p] * (1 - 0.1 * 0.2), rtol=0, atol=0)
    # Manifold Muon's matrices take none: the retraction would undo it
    manifold = build_optimizer(TinyGPT(), "manifold_muon", weight_decay=0.2, **settings)
    assert [g["weight_decay"] for g in manifold.param_groups] == [0.0, 0.2, 0.0]


@pytest.mark.usefixtures("one_thread")
def test_train_py_passes_the_optimizer_options(data_dir, tmp_path):
    out = str(tmp_path / "run")
    args = tiny_run_args(data_dir, out, optimizer="muon", weight_decay=0.1, momentum=0.8, ns_steps=3,
                         max_iters=1, eval_interval=1, eval_iters=1)
    assert train.train(args) == 0
    groups = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["optimizer"]["param_groups"]
    assert [(g["kind"], g["weight_decay"]) for g in groups] == [
        ("matrix", 0.1), ("adamw", 0.1), ("adamw", 0.0)]
    assert (groups[0]["momentum"], groups[0]["ns_steps"]) == (0.8, 3)


def test_benchmark_reports_every_optimizer():
    rows = optim.benchmark_optimizers("tiny", steps=1, warmup=0)
    assert [r["name"] for r in rows] == list(OPTIMIZERS)
    by_name = {r["name"]: r for r in rows}
    assert by_name["adamw"]["step_ratio"] == 1.0
    # SGDW keeps one tensor per parameter, AdamW two (plus a 4-byte step counter each).
    assert by_name["sgdw"]["state_ratio"] == pytest.approx(0.5, abs=1e-3)
    assert by_name["muon"]["state_ratio"] < 1.0 and by_name["manifold_muon"]["state_ratio"] < 1.0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_decreases_tiny_loss(name):
    torch.manual_seed(0)
    model = TinyGPT()
    with torch.no_grad():
        initial = tiny_loss(model, 0).item()
    final = train_tiny(model, build_tiny(name, model), 60)
    # A weak check (the training tests on the corpus are train.py's): the mapping is learnable;
    # from ~8 nats (the tied N(0, 1) embedding gives large logits) every optimizer reaches
    # 0.1-0.7 nats in 60 steps, so a quarter of the initial loss leaves a wide margin.
    assert final < 0.25 * initial


# ----------------------------------------------------------------------------------------------
# Distributed: 2 gloo processes


def _flat_params_and_state(model, optimizer) -> torch.Tensor:
    tensors = [p.detach().flatten() for p in model.parameters()]
    for p in model.parameters():
        state = optimizer.state.get(p, {})
        tensors += [state[key].flatten() for key in sorted(state)]
    return torch.cat(tensors)


def _ddp_run(name: str, rank: int, distributed: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = TinyGPT()
    ddp = DistributedDataParallel(model)
    extra = {} if name in ("adamw", "sgdw") else {"distributed": distributed}
    optimizer = build_tiny(name, model, **extra)
    train_tiny(model, optimizer, 4, rank=rank, ddp=ddp)  # different data on each rank
    return _flat_params_and_state(model, optimizer)


def _ddp_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        results = {"world": optim._world(True)}
        for name in OPTIMIZERS:
            flat = _ddp_run(name, rank, distributed=True)
            gathered = [torch.empty_like(flat) for _ in range(world_size)]
            dist.all_gather(gathered, flat)
            results[f"{name}: ranks identical"] = all(torch.equal(gathered[0], g)
                                                      for g in gathered)
            if name in ("muon", "manifold_muon"):
                unsharded = _ddp_run(name, rank, distributed=False)
                results[f"{name}: sharded == unsharded"] = torch.equal(flat, unsharded)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_distributed_sharding_is_identical_on_ranks_and_to_one_process(tmp_path):
    world_size = 2
    mp.spawn(_ddp_worker, args=(world_size, str(tmp_path / "rendezvous"), str(tmp_path)),
             nprocs=world_size, join=True)
    for rank in range(world_size):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert results.pop("world") == (world_size, rank)
        failed = [key for key, ok in results.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def test_released_manifold_muon_settings_are_config_keys():
    """The released code's choices are train.py keys, so a config can name them; bad values exit 2."""
    import train

    cfg, _ = train.load_config(["--optimizer=manifold_muon", "--weight_decay=0", "--nesterov=False",
                                "--gradient_scale=raw", "--dual_init=zero", "--dual_lr=0.1"])
    assert (cfg.nesterov, cfg.gradient_scale, cfg.dual_init) == (False, "raw", "zero")
    with pytest.raises(train.ConfigError, match="dual_init"):
        train.load_config(["--optimizer=manifold_muon", "--dual_init=bernsteen"])

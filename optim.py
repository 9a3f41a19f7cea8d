"""Optimizers for nanoNorm: AdamW, SGDW (DNT's mSGDW), Muon and Manifold Muon.

Every optimizer here is one `torch.optim.Optimizer`, so the training loop steps, schedules,
zero_grads and checkpoints a single object whatever the method:

    optimizer = build_optimizer(model, "muon", lr=3e-4, weight_decay=0.0, betas=(0.9, 0.95),
                                device_type="cuda", matrix_lr=0.02)
    for group in optimizer.param_groups:          # any schedule, every method
        group["lr"] = group["base_lr"] * multiplier

Parameters are routed by `split_params` (the one routing rule of the codebase): weights of the
`nn.Linear` layers inside `model.blocks` are "matrix" parameters; embeddings, the output head,
gains, biases and scalars are "other" parameters; weight decay applies to >=2-D ones only.

- AdamW: `torch.optim.AdamW` (fused on CUDA).
- SGDW: momentum SGD with decoupled weight decay, DNT's mSGDW (DNT App. C).
- Muon: orthogonalized momentum for matrices (Keller Jordan's Muon; `torch.optim.Muon` gives
  the same matrix update), AdamW for the other parameters, inside one object.
- ManifoldMuon: matrices constrained to the Stiefel manifold, online dual ascent (Bir et al.
  §3.1, App. 8.1), AdamW for the other parameters.

Two orthogonalizations live here. `zeropower_newton_schulz` is Muon's: 5 quintic steps in
bfloat16 that only land singular values in a band around 1. `msign` is the polar factor U V^T,
accurate in float32 (Manifold Muon's directions run it in bfloat16); `retract` is Manifold
Muon's retraction, the polar factor of W - lr A for A tangent at W in a few polishing steps.

`python optim.py` times one step of each optimizer on GPT-2-shaped parameters; see `main`.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.adamw import adamw as adamw_functional

# ----------------------------------------------------------------------------------------------
# Orthogonalization: Muon's Newton-Schulz and the accurate matrix sign

# Muon's quintic, chosen for the largest slope at 0; it does not converge to 1 (Muon post).
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# Classic quintic Newton-Schulz p(s) = (15s - 10s^3 + 3s^5)/8: p(1) = 1, p'(1) = p''(1) = 0,
# so singular values in (0, 1.52) converge to 1, with cubic order once near 1.
POLISH_NS_COEFFICIENTS = (15 / 8, -10 / 8, 3 / 8)
POLISH_STEPS = 3  # Muon's band [0.68, 1.13] to 1: error 0.32 -> 6e-2 -> 6e-4 -> 7e-10


def _quintic_step(X: Tensor, a: float, b: float, c: float) -> Tensor:
    """X <- a X + (b S + c S^2) X with S = X X^T: s <- a s + b s^3 + c s^5 on singular values.
    X is a matrix or a batch of them (b x m x n)."""
    gram = X @ X.mT
    fused = torch.addmm if X.ndim == 2 else torch.baddbmm
    return fused(X, fused(gram, gram, gram, beta=b, alpha=c), X, beta=a)


def zeropower_newton_schulz(G: Tensor, steps: int = 5, eps: float = 1e-7,
                            dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Muon's orthogonalization: `steps` quintic steps with Muon's coefficients, in `dtype` (bfloat16, as
    Muon runs it), after dividing by the Frobenius norm (so the spectral norm is <= 1). Returns
    U S' V^T with S' in a band around 1, not U V^T; `msign` is the accurate version.
    G is a matrix or a batch of equal shapes (b x m x n), each normalized by its own norm."""
    X = G.to(dtype)
    # Iterate on the wide orientation (the Gram matrix is smaller) as a transposed view, the layout
    # torch.optim.Muon iterates on: the CPU's bfloat16 matmul rounds a contiguous copy differently.
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        X = _quintic_step(X, *MUON_NS_COEFFICIENTS)
    return X.mT if tall else X


@contextlib.contextmanager
def _ieee_float32_matmul() -> Iterator[None]:
    """Full float32 matmuls inside (a training script may have enabled TF32, whose 10-bit
    mantissa would leave W^T W - I near 1e-3 after the retraction)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def msign(G: Tensor, steps: int = 10, dtype: torch.dtype = torch.float32) -> Tensor:
    """Matrix sign / polar factor U V^T of G = U S V^T (tall, wide or square; or a batch of equal
    shapes, b x m x n), returned in float32.

    After dividing by the Frobenius norm, `steps - 3` steps of Muon's quintic grow small
    singular values fast (x3.4 per step) into Muon's band, then 3 steps of the convergent quintic
    (15s - 10s^3 + 3s^5)/8 polish them to 1. With the default 10 steps every singular value
    above 1e-4 * ||G||_F comes out within 2e-6 of 1; smaller ones are only partly resolved
    (1e-5 * ||G||_F becomes 0.37, 1e-6 * ||G||_F becomes 0.04). The iteration acts on singular
    values only, so in exact arithmetic the error in direction i is |phi(s_i / ||G||_F) - 1| for
    the scalar map phi; float32 rounding adds about eps * ||G||_F / s_min (tests check both).
    `dtype` is the precision of the iteration: bfloat16 is several times faster where its matmuls
    are native (4x on a 2-core AVX-512 CPU at 256 x 1024) but brings singular values only to
    within ~1e-2 of 1.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"msign expects a matrix or a batch of them, got shape {tuple(G.shape)}")
    with _ieee_float32_matmul():
        X = G.float()
        tall = X.size(-2) > X.size(-1)
        if tall:
            X = X.mT
        X = (X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-30)).to(dtype)
        for i in range(steps):
            polish = i >= steps - POLISH_STEPS
            X = _quintic_step(X, *(POLISH_NS_COEFFICIENTS if polish else MUON_NS_COEFFICIENTS))
        X = X.float()
        return X.mT if tall else X


# ----------------------------------------------------------------------------------------------
# The Stiefel manifold W^T W = I (tall W): tangent projection and retraction

# ||P_T(A)||_2^2 <= 4/3 for ||A||_2 <= 1: for a unit x, with M = W^T A,
# ||P_T(A) x||^2 = ||Ax||^2 - ||Mx||^2 + ||skew(M) x||^2 <= 1 - t^2 + ((1 + t)/2)^2 <= 4/3 (t = ||Mx||).
TANGENT_NORM_BOUND_SQ = 4 / 3
RETRACTION_TOL = 1e-7  # singular values of the retraction within 1e-7 of 1 (float32 adds ~1e-6)
MAX_RETRACTION_STEPS = 30


def project_tangent(W: Tensor, A: Tensor) -> Tensor:
    """A - W sym(W^T A): the part of A tangent to the Stiefel manifold at W (tall, W^T W = I).

    For a tangent T, W^T T is skew, so (W - lr T)^T (W - lr T) = I + lr^2 T^T T: every singular
    value of W - lr T is >= 1 at any lr, and the retraction is well conditioned."""
    WtA = W.mT @ A
    return A - W @ ((WtA + WtA.mT) / 2)


def retraction_steps(lr: float) -> int:
    """Polishing steps that bring every singular value of (W - lr T) / u to within RETRACTION_TOL
    of 1, for W on the manifold, T tangent with ||T||_2^2 <= 4/3 and u = sqrt(1 + 4/3 lr^2), an
    upper bound of the spectral norm: the singular values start in [1/u, 1], and the polishing
    quintic moves the lowest one most slowly (1 step below lr 0.07, 2 below 0.45, 3 below 1.15)."""
    s = (1 + TANGENT_NORM_BOUND_SQ * lr**2) ** -0.5
    a, b, c = POLISH_NS_COEFFICIENTS
    steps = 0
    while steps == 0 or (1 - s > RETRACTION_TOL and steps < MAX_RETRACTION_STEPS):
        s = a * s + b * s**3 + c * s**5
        steps += 1
    return steps


def retract(W: Tensor, T: Tensor, lr: float) -> Tensor:
    """msign(W - lr T) for tall W on the manifold and T tangent at W (see `project_tangent`),
    float32: scaled by the bound 1/u of `retraction_steps`, then that many polishing steps (in
    place of msign's Frobenius scaling and growth steps, which such a matrix does not need)."""
    X = (W - lr * T).mT * (1 + TANGENT_NORM_BOUND_SQ * lr**2) ** -0.5  # wide: k x k Gram
    for _ in range(retraction_steps(lr)):
        X = _quintic_step(X, *POLISH_NS_COEFFICIENTS)
    return X.mT


# ----------------------------------------------------------------------------------------------
# SGDW (DNT's mSGDW)


class SGDW(Optimizer):
    """Momentum SGD with decoupled weight decay: DNT's mSGDW (DNT §4.2, App. C; timm's SGDW).

        buf <- mu * buf + g                     (dampening 0)
        d   <- g + mu * buf  if nesterov else buf
        p   <- p * (1 - lr * wd)                (decoupled, as in AdamW)
        p   <- p - lr * d

    One state tensor per parameter (`momentum_buffer`), half of AdamW's state. DNT's GPT-2
    124M setting: lr 1.0, wd 1e-4, mu 0.9, cosine to 6e-5, grad clip 1.0.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"SGDW needs lr >= 0, 0 <= momentum < 1, weight_decay >= 0; got "
                             f"lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = [self._buffer(p) for p in params]
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            torch._foreach_mul_(bufs, mu)
            torch._foreach_add_(bufs, grads)
            directions = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs
            if wd != 0:
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_add_(params, directions, alpha=-lr)
        return loss

    def _buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]


# ----------------------------------------------------------------------------------------------
# Matrix optimizers with an AdamW for the other parameters, in one object


MatrixStep = tuple[Tensor, dict[str, Any], bool]  # a matrix, its group, whether it is its first step


def _world(distributed: bool) -> tuple[int, int]:
    """(world_size, rank) when sharding applies, else (1, 0)."""
    if distributed and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _as_groups(params: Iterable[Any] | None, kind: str) -> list[dict[str, Any]]:
    """A list of tensors becomes one group of `kind`; dicts keep their own "kind" if given."""
    params = list(params or [])
    if not params:
        return []
    if isinstance(params[0], dict):
        return [{"kind": kind, **group} for group in params]
    return [{"kind": kind, "params": params}]


class _MatrixAndAdamW(Optimizer):
    """Shared plumbing of Muon and ManifoldMuon.

    Every param group has a "kind": "matrix" groups get the subclass's update, "adamw" groups get
    AdamW (torch's functional `adamw`, so the math and the state are torch.optim.AdamW's:
    "step", "exp_avg", "exp_avg_sq"; its fused kernel on CUDA, its for-loop on the CPU). Missing
    keys are filled per kind, so a caller may pass its own groups, e.g.
    [{"params": hidden, "kind": "matrix"},
    {"params": emb, "kind": "adamw", "weight_decay": 0.1}, {"params": gains, "kind": "adamw"}].

    Matrices of a group that the subclass can stack (`_batch_key`: the same shape) are updated
    together, in batches of at most BATCH_SIZE (`_batches`): a few batched matmuls per step
    instead of a chain of small ones per matrix.

    Sharding (when torch.distributed is initialized with world_size > 1 and `distributed`):
    the batches are numbered in param-group order; batch i is updated by rank i % world_size
    only, then its tensors (`_synced_tensors`) are broadcast from that rank. Every rank updates
    every momentum buffer itself (cheap, elementwise, identical gradients after DDP's
    all-reduce), so rank 0's state is complete for checkpoints. The batches do not depend on the
    world size and the owner runs exactly the single-process computation, so the result is
    bit-identical to not sharding.
    """

    def __init__(
        self,
        params: Iterable[Any],
        matrix_defaults: dict[str, Any],
        adamw_params: Iterable[Any] | None,
        adamw_defaults: dict[str, Any],
        distributed: bool,
    ) -> None:
        self._kind_defaults = {"matrix": matrix_defaults, "adamw": adamw_defaults}
        self.distributed = distributed
        groups = _as_groups(params, "matrix") + _as_groups(adamw_params, "adamw")
        super().__init__(groups, {})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        kind = param_group.setdefault("kind", "matrix")
        if kind not in self._kind_defaults:
            raise ValueError(f"param group kind must be 'matrix' or 'adamw', got {kind!r}")
        for key, value in self._kind_defaults[kind].items():
            param_group.setdefault(key, value)
        params = param_group["params"]
        param_group["params"] = [params] if isinstance(params, Tensor) else list(params)
        self._check_group(param_group)  # before it joins: a rejected group leaves the optimizer as it was
        super().add_param_group(param_group)

    def _check_group(self, group: dict[str, Any]) -> None:
        if group["kind"] == "matrix" and any(p.ndim != 2 for p in group["params"]):
            shapes = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
            raise ValueError(f"'matrix' groups take 2-D parameters only, got shapes {shapes}; "
                             "put the others in an 'adamw' group (split_params does this)")
        if group["kind"] == "adamw" and not all(0 <= beta < 1 for beta in group["betas"]):
            raise ValueError(f"betas={tuple(group['betas'])} of an 'adamw' group must lie in [0, 1)")

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        kind_defaults = getattr(self, "_kind_defaults", {})
        for group in self.param_groups:  # a checkpoint from before an option existed: its default
            for key, value in kind_defaults.get(group.get("kind"), {}).items():
                group.setdefault(key, value)

    BATCH_SIZE = 16  # matrices per batched update, at most

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        steps = []
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw_step(group)
            else:
                steps += self._momentum_step(group)
        self._matrix_steps(steps)
        return loss

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        fused = params[0].is_cuda  # torch.optim.AdamW(fused=True)'s kernel; on the CPU its for-loop
        for p in params:
            state = self.state[p]
            if not state:  # the state torch.optim.AdamW keeps (fused: the step count on the device)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if fused else torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw_functional(
            params, [p.grad for p in params],
            [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
            [s["step"] for s in states], fused=fused,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )

    def _momentum_step(self, group: dict[str, Any]) -> list[MatrixStep]:
        """buf <- mu buf + (1 - mu) g for the group's matrices with a gradient (on every rank);
        returns their steps."""
        steps = []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            first_step = not state
            if first_step:
                self._init_state(p, state)
            steps.append((p, group, first_step))
        if steps:
            torch._foreach_lerp_([self.state[p]["momentum_buffer"] for p, _, _ in steps],
                                 [p.grad for p, _, _ in steps], 1 - group["momentum"])
        return steps

    def _matrix_steps(self, steps: list[MatrixStep]) -> None:
        world_size, rank = _world(self.distributed)
        pending = []
        for i, batch in enumerate(self._batches(steps)):
            owner = i % world_size
            if owner == rank:
                self._update_matrices(batch)
            if world_size > 1:
                pending += [dist.broadcast(t, src=owner, async_op=True)
                            for p, _, _ in batch for t in self._synced_tensors(p, self.state[p])]
        for work in pending:
            work.wait()

    def _batches(self, steps: list[MatrixStep]) -> list[list[MatrixStep]]:
        """The matrices updated together, in a fixed order (the same on every rank): those with the
        same `_batch_key`, in batches of at most BATCH_SIZE (a fixed size, so the batches, and the
        bits, do not depend on the world size)."""
        alike: dict[tuple, list[MatrixStep]] = {}
        for step in steps:
            alike.setdefault(self._batch_key(*step), []).append(step)
        return [same[i:i + self.BATCH_SIZE] for same in alike.values()
                for i in range(0, len(same), self.BATCH_SIZE)]

    def _batch_key(self, p: Tensor, group: dict[str, Any], first_step: bool) -> tuple:
        """Matrices with equal keys can be stacked into one batched update."""
        raise NotImplementedError

    def _update_matrices(self, batch: list[MatrixStep]) -> None:
        raise NotImplementedError

    def _init_state(self, p: Tensor, state: dict[str, Tensor]) -> None:
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _synced_tensors(self, p: Tensor, state: dict[str, Tensor]) -> list[Tensor]:
        """Tensors that the owner of a matrix changed beyond the momentum buffer."""
        return [p]


def _momentum_direction(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Muon's momentum in the EMA form of Keller Jordan's Muon and torch.optim.Muon: the buffer
    is buf <- mu buf + (1 - mu) g, the Nesterov direction (1 - mu) g + mu buf. That is (1 - mu)
    times the sum form buf <- mu buf + g, d = g + mu buf; both methods normalize it away."""
    return grad.lerp(buf, momentum) if nesterov else buf


def _muon_lr_scale(shape: torch.Size, adjust_lr: str) -> float:
    """Scale of Muon's step for a rows x cols matrix (names as torch.optim.Muon's adjust_lr_fn)."""
    rows, cols = shape
    if adjust_lr == "original":  # Keller Jordan: larger steps for tall (fan_out > fan_in)
        return max(1.0, rows / cols) ** 0.5
    return 0.2 * max(rows, cols) ** 0.5  # "match_rms_adamw" (Moonshot): update RMS ~ AdamW's


NS_DTYPES = ("auto", "bfloat16", "float32")
MUON_LR_ADJUSTMENTS = ("original", "match_rms_adamw")


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware multiplies it (GPUs, CPUs with AVX-512 bf16 or AMX); float32 on other CPUs,
    where bfloat16 matmuls are emulated 30-40x slower than float32 ones (the same iteration, rounded less)."""
    native = device.type != "cpu" or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if native else torch.float32


class Muon(_MatrixAndAdamW):
    """Muon for matrix parameters, AdamW for the others, in one optimizer.

    For a matrix W (rows x cols) with gradient g, Keller Jordan's Muon:

        buf <- mu buf + (1 - mu) g;    d = (1 - mu) g + mu buf  (Nesterov) or buf
        O   = NS_5(d)                  (zeropower_newton_schulz: bfloat16, Frobenius-normalized; ns_dtype)
        W   <- W (1 - lr wd)           (decoupled weight decay, unscaled lr as torch does)
        W   <- W - lr s O,   s = sqrt(max(1, rows/cols))  ("original")
                             s = 0.2 sqrt(max(rows, cols)) ("match_rms_adamw", Muon is Scalable)

    This is torch.optim.Muon's update for the same settings (tests compare them, bit for bit on
    the CPU). Matrices of a group with the same shape are stacked: one batched NS_5 and a few
    foreach ops per shape instead of a chain of kernels per matrix (the CPU's batched bfloat16
    matmul gives the same bits as one matrix at a time; a GPU's may round differently). "adamw"
    groups use adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay unless they set their own.
    ns_dtype "auto" runs NS_5 in bfloat16 where the hardware has it and in float32 on CPUs that only
    emulate bfloat16 (`newton_schulz_dtype`); "bfloat16" is torch.optim.Muon's choice everywhere.
    Bir et al. used Muon with lr 1e-3, wd 0.01, mu 0.95.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adjust_lr: str = "original",
        adamw_params: Iterable[Any] | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        distributed: bool = True,
        ns_dtype: str = "auto",
    ) -> None:
        if adjust_lr not in MUON_LR_ADJUSTMENTS:
            raise ValueError(f"adjust_lr must be one of {MUON_LR_ADJUSTMENTS}, got {adjust_lr!r}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype!r}")
        matrix_defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                               weight_decay=weight_decay, adjust_lr=adjust_lr, ns_dtype=ns_dtype)
        adamw_defaults = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                              weight_decay=adamw_weight_decay)
        super().__init__(params, matrix_defaults, adamw_params, adamw_defaults, distributed)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group["kind"] == "matrix" and group["adjust_lr"] not in MUON_LR_ADJUSTMENTS:
            raise ValueError(f"adjust_lr must be one of {MUON_LR_ADJUSTMENTS}, got {group['adjust_lr']!r}")

    def _batch_key(self, p, group, first_step):
        return id(group), p.shape, p.dtype, p.device  # the exact shape: a tall matrix stays tall

    def _update_matrices(self, batch):
        _, group, _ = batch[0]
        params = [p for p, _, _ in batch]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        # `_momentum_direction` per matrix: (1 - mu) g + mu buf (Nesterov) or buf
        directions = torch._foreach_lerp([p.grad for p in params], bufs, mu) if group["nesterov"] else bufs
        auto = group["ns_dtype"] == "auto"
        dtype = newton_schulz_dtype(params[0].device) if auto else getattr(torch, group["ns_dtype"])
        update = zeropower_newton_schulz(torch.stack(directions), group["ns_steps"], dtype=dtype)
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        scale = _muon_lr_scale(params[0].shape, group["adjust_lr"])
        torch._foreach_add_(params, list(update.unbind()), alpha=-lr * scale)


DUAL_INITS = ("bernstein", "zero")
GRADIENT_SCALES = ("unit_rms", "raw")
DIRECTION_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ManifoldMuon(_MatrixAndAdamW):
    """Manifold Muon with online dual ascent (Bir et al. §3.1, App. 8.1), AdamW for the
    other parameters, in one optimizer.

    Each matrix, made tall (n x k, n >= k) by transposing if it is wide, lives on the Stiefel
    manifold W^T W = I_k (a wide parameter has orthonormal rows). With G the momentum direction
    (see `_momentum_direction`), one step is

        first step only:     W <- msign(W)                  (start on the manifold)
        first step, or every step if dual_reset:  Lambda <- Lambda_0 (dual_init)
        repeat dual_steps:   A = msign(G + 2 W Lambda)      (Bir et al. §3.1, step 2)
                             H = W^T A + A^T W              (tangent-space violation)
                             Lambda <- Lambda - alpha H     (App. 8.1, "Lambda = Lambda - alpha H")
        A = msign(G + 2 W Lambda)
        A <- A - W sym(W^T A)                               (tangent projection, see below)
        W <- msign(W - lr A)                                (§3.1 step 3: retraction)

    Lambda (symmetric k x k, state "dual") is kept across steps: that is what makes the dual
    ascent online. -alpha H is a step of gradient ascent on the dual function
    -||G + 2 W Lambda||_* (its gradient in Lambda is -H). The projection onto the manifold happens
    at a parameter's first step, not at construction, so resuming never re-projects.

    Options, with the source of each default and the choice of the optimizer Bir et al. train
    with in their released code (its online step; the same file's offline `manifold_muon_step`,
    adapted from Bernstein's Modular Manifolds solver, is not used in training):

        option          default here                          released optimizer
        momentum        0.95, buf <- mu buf + (1 - mu) g      0.95, the same buffer
        nesterov        True (Keller Jordan's Muon)           False: the buffer itself
        gradient_scale  "unit_rms" (this code's, below)       "raw": G as it comes
        dual_init       "bernstein": -1/4 (W^T G + G^T W)     "zero"
                        (Bernstein's offline solver)
        dual_lr         0.01 (the offline solver's alpha,     0.1 (`mm_alpha`)
                        there annealed over 50 inner steps)
        dual_steps      1                                     1
        direction msign bfloat16, msign_steps = 10            bfloat16 Polar Express, 10 steps
        retraction      float32, W^T W = I to ~1e-6           bfloat16 Polar Express, 10 steps

    So `ManifoldMuon(params, nesterov=False, gradient_scale="raw", dual_init="zero",
    dual_lr=0.1)` is the released optimizer up to the precision of msign and the tangent
    projection. Why the defaults differ:
    - gradient_scale="unit_rms" rescales G so its singular values have RMS 1 (||G||_F = sqrt(k)).
      msign(G + 2 W Lambda) is invariant to scaling G and Lambda together, but the dual step
      alpha H is not (||H||_2 <= 2 whatever G's scale): on the raw gradient the useful alpha moves
      with the loss scale, batch size, clipping and k, and a dual step of 0.1 on a gradient of
      norm ~1e-2 makes Lambda, not G, set the direction. Rescaled, alpha is a fraction of G's
      typical singular value, and Lambda stays comparable across steps as the gradient shrinks.
    - dual_init="bernstein": G + 2 W Lambda_0 = G - W sym(W^T G) is the tangent part of G (the
      Riemannian gradient); for square W its msign is tangent, so the first A is. With W frozen
      and a well-conditioned G the carried ascent drives ||H|| to ~0 (tests); between steps W
      and G move, so a carried Lambda lags (in toy runs at lr 0.1, ||H||_F / sqrt(k) ~1.2-1.5).
      dual_reset=True re-initializes Lambda at every step, as the offline solver does.
    - The tangent projection is this code's. A lagging Lambda leaves A far from tangent; W^T A
      can then have an eigenvalue near 1/lr, W - lr A is nearly singular at lr ~ 1, and its polar
      factor is ill-conditioned (measured: square matrices at lr 1 left the manifold, max|W^T W -
      I| up to 0.5). The retraction removes the normal part W sym(W^T A) anyway, to first order
      in lr, so the step changes at second order; projecting it first makes every singular value
      of W - lr A >= 1 (`project_tangent`), so `retract` needs only a few polishing steps and
      W^T W = I holds to ~1e-6 at any lr.
    - The two direction msigns need not be exact (A is a descent direction; the projection and
      the retraction keep W on the manifold), so they run in bfloat16 like Muon's Newton-Schulz
      and the released code's msign; direction_dtype="float32" makes them exact. Equal-shaped
      matrices of a group are stacked and updated in batched matmuls (`_batches`).
    - No weight decay on matrices: msign(c W) = msign(W), so a shrink of W is undone by the
      retraction (Bir et al. Table 2 lists it as N/A); weight_decay must be 0 for matrix groups.
    - lr is used as is (no rows/cols scaling as in Muon): the retraction sets the scale.
    Bir et al.'s settings: lr 0.1-0.2, mu 0.95, grad clip 1.0; others AdamW lr 0.01, betas
    (0.9, 0.98), wd 0.01.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        gradient_scale: str = "unit_rms",
        dual_init: str = "bernstein",
        dual_steps: int = 1,
        dual_lr: float = 0.01,
        dual_reset: bool = False,
        msign_steps: int = 10,
        direction_dtype: str = "bfloat16",
        weight_decay: float = 0.0,
        adamw_params: Iterable[Any] | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        distributed: bool = True,
    ) -> None:
        matrix_defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov,
                               gradient_scale=gradient_scale, dual_init=dual_init,
                               dual_steps=dual_steps, dual_lr=dual_lr, dual_reset=dual_reset,
                               msign_steps=msign_steps, direction_dtype=direction_dtype,
                               weight_decay=weight_decay)
        adamw_defaults = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                              weight_decay=adamw_weight_decay)
        super().__init__(params, matrix_defaults, adamw_params, adamw_defaults, distributed)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group["kind"] != "matrix":
            return
        if group["weight_decay"] != 0:
            raise ValueError("ManifoldMuon matrices take no weight decay: the retraction "
                             "msign(W) undoes any shrink of W; set weight_decay=0 "
                             "(adamw_weight_decay still applies to the other parameters)")
        for key, valid in (("gradient_scale", GRADIENT_SCALES), ("dual_init", DUAL_INITS),
                           ("direction_dtype", tuple(DIRECTION_DTYPES))):
            if group[key] not in valid:
                raise ValueError(f"{key} must be one of {valid}, got {group[key]!r}")

    def _init_state(self, p, state):
        super()._init_state(p, state)
        k = min(p.shape)  # p's dtype: load_state_dict casts floating state to it anyway
        state["dual"] = torch.zeros(k, k, dtype=p.dtype, device=p.device)

    def _synced_tensors(self, p, state):
        return [p, state["dual"]]

    def _batch_key(self, p, group, first_step):
        """The same shape once made tall, at the same step (the first one also projects W)."""
        return id(group), max(p.shape), min(p.shape), p.dtype, p.device, first_step

    def _update_matrices(self, batch):
        _, group, first_step = batch[0]
        params = [_tall(p) for p, _, _ in batch]  # views: writing them writes the parameters
        states = [self.state[p] for p, _, _ in batch]
        buf = torch.stack([_tall(s["momentum_buffer"]) for s in states]).float()
        grad = torch.stack([_tall(p.grad) for p, _, _ in batch]).float()
        G = _momentum_direction(grad, buf, group["momentum"], group["nesterov"])
        W = torch.stack(params).float()
        if group["gradient_scale"] == "unit_rms":  # singular values with RMS 1
            G = G * (W.size(-1) ** 0.5 / G.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-30))
        steps, dtype = group["msign_steps"], DIRECTION_DTYPES[group["direction_dtype"]]
        with _ieee_float32_matmul():
            if first_step:
                W = msign(W)  # start on the manifold (weights start orthogonal)
            if first_step or group["dual_reset"]:
                dual = initial_dual(W, G, group["dual_init"])
            else:
                dual = torch.stack([s["dual"] for s in states]).float()
            for _ in range(group["dual_steps"]):
                WtA = W.mT @ msign(torch.baddbmm(G, W, dual, alpha=2), steps, dtype)
                dual = dual - group["dual_lr"] * (WtA + WtA.mT)  # H is symmetric exactly
            A = project_tangent(W, msign(torch.baddbmm(G, W, dual, alpha=2), steps, dtype))
            W = retract(W, A, group["lr"])
        torch._foreach_copy_([s["dual"] for s in states], list(dual.unbind()))
        torch._foreach_copy_(params, list(W.unbind()))


def _tall(M: Tensor) -> Tensor:
    return M.mT if M.size(0) < M.size(1) else M


def initial_dual(W: Tensor, G: Tensor, dual_init: str) -> Tensor:
    """Lambda_0 for tall W and G (or batches of them): zero, or Bernstein's -1/4 (W^T G + G^T W)
    (symmetric exactly)."""
    if dual_init == "zero":
        return W.new_zeros(W.shape[:-2] + (W.size(-1), W.size(-1)))
    WtG = W.mT @ G
    return -0.25 * (WtG + WtG.mT)


# ----------------------------------------------------------------------------------------------
# Routing and construction


def split_params(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Route every trainable parameter to exactly one of three lists:

    "matrix":   weights of the nn.Linear layers inside `model.blocks` (attention, MLP) and of OSP's embedding
                projections (`model.embed_in`, `model.head_in`, which OSP trains with Muon);
    "decay":    every other >=2-D parameter (embeddings, output head);
    "no_decay": 1-D and 0-D parameters (norm gains, biases, scalars such as GeoNorm's a, b).

    Tied weights (head = embedding) appear once (model.parameters() yields a tensor once).
    Parameters with requires_grad=False are left out.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"split_params needs model.blocks, an nn.ModuleList of transformer "
                         f"blocks; {type(model).__name__} has none")
    hidden = [*blocks.modules(), getattr(model, "embed_in", None), getattr(model, "head_in", None)]
    block_linear_weights = {id(m.weight) for m in hidden if isinstance(m, nn.Linear)}
    groups: dict[str, list[nn.Parameter]] = {"matrix": [], "decay": [], "no_decay": []}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in block_linear_weights and p.ndim == 2:
            groups["matrix"].append(p)
        elif p.ndim >= 2:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    routed = [id(p) for ps in groups.values() for p in ps]
    expected = {id(p) for p in model.parameters() if p.requires_grad}
    if len(routed) != len(set(routed)) or set(routed) != expected:
        raise RuntimeError("split_params routed a parameter twice or not at all")
    return groups


OPTIMIZERS = ("adamw", "sgdw", "muon", "manifold_muon")
# the options each optimizer reads from build_optimizer(**options); the defaults are its class's (a None option
# keeps them). ns_steps is Muon's Newton-Schulz step count and Manifold Muon's msign iteration count.
OPTIONS = {
    "adamw": ("eps", "fused"),
    "sgdw": ("momentum", "nesterov"),
    "muon": ("matrix_lr", "momentum", "nesterov", "ns_steps", "adjust_lr", "eps", "distributed"),
    "manifold_muon": ("matrix_lr", "momentum", "nesterov", "ns_steps", "gradient_scale", "dual_init", "dual_steps",
                      "dual_lr", "eps", "distributed"),
}


def build_optimizer(
    model: nn.Module,
    name: str,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    device_type: str,
    **options: Any,
) -> Optimizer:
    """The optimizer `name` for `model`, with parameters routed by `split_params`.

    `lr`, `weight_decay` and `betas` are the AdamW-side settings: AdamW's (and SGDW's lr and
    weight decay) for "adamw"/"sgdw", the AdamW groups' for "muon"/"manifold_muon", whose
    matrices take `matrix_lr`. Groups: parameters >= 2-D with `weight_decay` and the rest without;
    the Muons put the matrices in their own "matrix" group first: Muon decays them by `weight_decay`,
    Manifold Muon not at all (its retraction would undo any decay). `options` (OPTIONS[name]; None keeps
    the class's default) may hold other optimizers' options too: each optimizer ignores those.

    Every param group gets "base_lr" = its initial lr, so a schedule sets
    group["lr"] = group["base_lr"] * multiplier for all groups.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid names: {', '.join(OPTIMIZERS)}")
    known = {k for names in OPTIONS.values() for k in names}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown optimizer option(s) {unknown}; valid options: {', '.join(sorted(known))}")
    opt = {k: v for k, v in options.items() if k in OPTIONS[name] and v is not None}
    parts = split_params(model)
    elementwise = name in ("adamw", "sgdw")  # these treat matrices like the other >=2-D params
    groups = [{"params": (parts["matrix"] if elementwise else []) + parts["decay"],
               "weight_decay": weight_decay},
              {"params": parts["no_decay"], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if name == "adamw":
        fused = opt.pop("fused", device_type == "cuda")
        optimizer: Optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused, **opt)
    elif name == "sgdw":
        optimizer = SGDW(groups, lr=lr, **opt)
    else:
        if "matrix_lr" in opt:
            opt["lr"] = opt.pop("matrix_lr")
        if "eps" in opt:
            opt["adamw_eps"] = opt.pop("eps")
        if name == "manifold_muon" and "ns_steps" in opt:
            opt["msign_steps"] = opt.pop("ns_steps")
        matrix_decay = weight_decay if name == "muon" else 0.0
        cls = Muon if name == "muon" else ManifoldMuon
        optimizer = cls(parts["matrix"], weight_decay=matrix_decay, adamw_params=groups, adamw_lr=lr,
                        adamw_betas=betas, **opt)
    for group in optimizer.param_groups:
        group["base_lr"] = group["lr"]
    return optimizer


# ----------------------------------------------------------------------------------------------
# Benchmark: one optimizer step on GPT-2-shaped parameters

BENCH_SHAPES = {  # n_layer, n_embd, vocab_size, block_size
    "124m": (12, 768, 50304, 1024),  # GPT-2 small
    "small": (4, 256, 8192, 256),  # a CPU-sized stand-in with the same layout
    "tiny": (2, 64, 512, 64),  # a smoke test
}


class _GPT2Shapes(nn.Module):
    """GPT-2's parameters (no forward): blocks of Linear layers, LayerNorms, tied embedding."""

    def __init__(self, n_layer: int, n_embd: int, vocab_size: int, block_size: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)  # the head is tied to it
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(
                ln_1=nn.LayerNorm(n_embd), c_attn=nn.Linear(n_embd, 3 * n_embd),
                attn_proj=nn.Linear(n_embd, n_embd), ln_2=nn.LayerNorm(n_embd),
                c_fc=nn.Linear(n_embd, 4 * n_embd), mlp_proj=nn.Linear(4 * n_embd, n_embd)))
            for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)


def _state_bytes(optimizer: Optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, Tensor))


def benchmark_optimizers(
    shape: str = "small",
    device: str = "cpu",
    steps: int = 5,
    warmup: int = 2,
    names: Iterable[str] = OPTIMIZERS,
) -> list[dict[str, Any]]:
    """Median wall time of one `step()` and the optimizer-state size for each optimizer, on
    GPT-2-shaped parameters with fixed random gradients. Returns one dict per optimizer with
    keys name, step_ms, state_bytes, step_ratio and state_ratio (both relative to "adamw" when
    it is among `names`, else None)."""
    torch.manual_seed(0)
    model = _GPT2Shapes(*BENCH_SHAPES[shape]).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    device_type = torch.device(device).type
    rows = []
    for name in names:
        optimizer = build_optimizer(model, name, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95),
                                    device_type=device_type)
        times = []
        for i in range(warmup + steps):
            if device_type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            optimizer.step()
            if device_type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        rows.append(dict(name=name, step_ms=1e3 * statistics.median(times),
                         state_bytes=_state_bytes(optimizer)))
        del optimizer
    base = next((r for r in rows if r["name"] == "adamw"), None)
    for r in rows:
        r["step_ratio"] = r["step_ms"] / base["step_ms"] if base else None
        r["state_ratio"] = r["state_bytes"] / base["state_bytes"] if base else None
    return rows


def optimizer_names_error(names: list[str]) -> str | None:
    """What is wrong with a list of optimizer names given on a command line, or None."""
    unknown = [name for name in names if name not in OPTIMIZERS]
    return f"unknown optimizer(s) {', '.join(unknown)}; choose from: {', '.join(OPTIMIZERS)}" if unknown else None


def timing_device_error(device: str) -> str | None:
    """Why this benchmark and bench.py cannot time on `device` (they time cpu and cuda), or None."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        return f"--device {device} is not one the benchmarks time; give cpu, cuda or cuda:N"
    if kind == "cuda" and not torch.cuda.is_available():
        return f"--device {device}, but this machine has no CUDA device; give --device cpu"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description="Time one step of each optimizer on the "
                                     "parameters of a GPT-2 (hidden matrices + embeddings).")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(BENCH_SHAPES), default=None,
                        help="parameter shapes (default: 124m on CUDA, small on CPU)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} must be at least 0")
    if error := optimizer_names_error(args.optimizers.split(",")) or timing_device_error(args.device):
        parser.error(error)
    shape = args.shape or ("124m" if args.device.startswith("cuda") else "small")
    n_layer, n_embd, vocab, block = BENCH_SHAPES[shape]
    print(f"shape {shape} ({n_layer} layers, d {n_embd}, vocab {vocab}, context {block}), "
          f"device {args.device}, median of {args.steps} steps after {args.warmup} warm-up")
    rows = benchmark_optimizers(shape, args.device, args.steps, args.warmup,
                                args.optimizers.split(","))
    print(f"{'optimizer':<14}{'step ms':>10}{'x AdamW':>9}{'state MB':>10}{'x AdamW':>9}")
    for r in rows:
        step_ratio = f"{r['step_ratio']:.2f}" if r["step_ratio"] is not None else "-"
        state_ratio = f"{r['state_ratio']:.2f}" if r["state_ratio"] is not None else "-"
        print(f"{r['name']:<14}{r['step_ms']:>10.1f}{step_ratio:>9}"
              f"{r['state_bytes'] / 2**20:>10.1f}{state_ratio:>9}")


if __name__ == "__main__":
    main()

"""
The building blocks the rows of `SCHEMES` (model.py) are made of: the norm types, the residual combine
rules (GeoNorm's geodesic step among them), the Lipschitz block's gained linear map, the attention logit
scale, RoPE and the MLP's width. Each primitive's math is a plain function of tensors (`rms_norm`, `dyt`,
`derf`, `geodesic_step`, `apply_rope`, ...), to be read next to its paper; the modules hold the parameters
and the constants fixed at construction. Nothing here reads a config: model.py passes plain values.

On the CPU, RMSNorm, DyT/Derf and the geodesic step run as hand-written autograd nodes with the same math
(fused.py, where tests/test_fused.py checks each against its formula here); under torch.compile they run as
the formulas below (`fused.fused`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

from fused import fast_derf, fast_dyt, fast_geodesic_step, fast_rms_norm, fused

# ----------------------------------------------------------------------------- norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019, eq. 4) over the last dim: x / sqrt(mean(x^2) + eps) * weight; None: no
    gain. The mean is taken in float32 at least (a bf16 x under autocast); the output has x's dtype."""
    mean_square = x.to(torch.promote_types(x.dtype, torch.float32)).square().mean(-1, keepdim=True)
    out = x * torch.rsqrt(mean_square + eps).to(x.dtype)
    return out if weight is None else out * weight.to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm (same parameters and state dict), computed by `rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight)

    def normalize(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """x normalized by this norm's eps and shape, times `weight` in place of its own (None: no gain)."""
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        dims = len(self.normalized_shape)
        if dims == 1:
            return fused(fast_rms_norm, rms_norm, x, weight, eps)
        # over several trailing dims (OLMo 2's q/k norm over all heads): the same math on their flattening
        flat_weight = None if weight is None else weight.flatten()
        return fused(fast_rms_norm, rms_norm, x.flatten(-dims), flat_weight, eps).view(x.shape)


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
        return fused(fast_rms_norm, rms_norm, groups, self.weight.view(self.n_head, -1), self.eps).flatten(-2)


def make_norm(kind: str, dim: int, n_head: int, eps: float, bias: bool, alpha_init: float) -> nn.Module:
    """The norm of type `kind` (model.NORM_TYPES) over `dim` channels; alpha_init: DyT's and Derf's alpha."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    if kind in ("dyt", "derf"):
        return {"dyt": DynamicTanh, "derf": DynamicErf}[kind](dim, alpha_init, bias)
    return HeadwiseRMSNorm(dim, n_head, eps=eps)


def without_parameters(norm: nn.Module) -> nn.Module:
    """The same norm with each of its parameters turned into a constant at its initial value (gain 1, bias 0)."""
    for name, p in list(norm.named_parameters(recurse=False)):
        delattr(norm, name)
        norm.register_buffer(name, p.detach(), persistent=False)
    return norm


def dyt(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """DyT (Zhu et al., 2025, eq. 1): gamma * tanh(alpha * x) + beta, elementwise."""
    out = weight * torch.tanh(alpha * x)
    return out if bias is None else out + bias


def derf(x: torch.Tensor, alpha: torch.Tensor, shift: torch.Tensor, weight: torch.Tensor,
         bias: torch.Tensor | None) -> torch.Tensor:
    """Derf (Chen et al., 2025): gamma * erf(alpha * x + s) + beta, elementwise."""
    out = weight * torch.erf(alpha * x + shift)
    return out if bias is None else out + bias


class DynamicTanh(nn.Module):
    """DyT in place of a norm: `dyt` with alpha one learnable scalar, gamma and beta one per channel.

    Elementwise: no statistics over the channels. The bias beta exists when `bias` is set, as for
    LayerNorm here (the DyT LLaMA code has none).
    """

    def __init__(self, dim: int, alpha_init: float, bias: bool):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(alpha_init))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused(fast_dyt, dyt, x, self.alpha, self.weight, self.bias)


class DynamicErf(DynamicTanh):
    """Derf in place of a norm: `derf`, DyT's parameters and a learnable scalar shift s (init 0)."""

    def __init__(self, dim: int, alpha_init: float, bias: bool):
        super().__init__(dim, alpha_init, bias)
        self.shift = nn.Parameter(torch.tensor(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused(fast_derf, derf, x, self.alpha, self.shift, self.weight, self.bias)


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
    starts as the identity. The paper's "one parameter per layer" reads two ways: `combine="rezero"` gives each
    residual update its own alpha; `combine="rezero_block"` shares one between a block's attention and MLP
    updates, as the released rztx.py does."""

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


def geodesic_angle(x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor, decay: float,
                   clamp: float, lowest: float = -math.inf) -> tuple[torch.Tensor, ...]:
    """The applied angle theta' of `geodesic_step`, the radius ||x||, the tangent v and ||v|| (per token), in
    the wider dtype of x and s (a bf16 sub-layer output meets a float32 stream under autocast)."""
    x = x.to(torch.promote_types(x.dtype, s.dtype))
    radius = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-6)
    v = s - (x * s).sum(-1, keepdim=True) / radius**2 * x  # eq. 4: s less its component along x
    v_norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(1e-8)
    theta = (v_norm / radius).clamp_max(clamp)  # eq. 3's angle ||v|| / ||x||, clamped (App. D)
    theta = ((a * theta + b) * decay).clamp(lowest, clamp)  # learned a, b and the depth decay (§3.2, App. D)
    return theta, radius, v, v_norm


def geodesic_step(x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor, decay: float,
                  clamp: float, lowest: float = -math.inf) -> torch.Tensor:
    """GeoNorm eq. 5: x moved along the sphere of radius ||x|| toward s, by the angle of `geodesic_angle`."""
    theta, radius, v, v_norm = geodesic_angle(x, s, a, b, decay, clamp, lowest)
    x = x.to(v.dtype)
    return torch.cos(theta) * x + radius * torch.sin(theta) * v / v_norm  # eq. 3: exp_x(v), ||out|| = ||x||


class GeodesicStep(nn.Module):
    """GeoNorm's residual update (eq. 5): move x along the sphere of radius ||x||
    in the direction of the sub-layer output s, by an angle that is clamped and decays with depth.

        v      = s - (<x,s> / ||x||^2) x              tangent component of s at x
        theta  = min(||v|| / ||x||, c)
        theta' = min((a * theta + b) * decay(l), c)           a, b learnable (init 1, 0)
        x_new  = cos(theta') x + ||x|| sin(theta') v / ||v||  so ||x_new|| = ||x||

    The paper clamps theta' from above only (App. D: `clamp(..., max=clamp)`), which is the default
    (`sides="upper"`); a learned a < 0 can then turn the step backwards by more than c.
    `sides="both"` (an option of this project, an argument here, not a config key) clamps to [-c, c] and so
    bounds the step's length |theta'|. The two agree whenever (a * theta + b) * decay(l) >= -c, as at init.
    Computed by `geodesic_step` (the paper calls its cost negligible; as a chain of eager ops it was the
    slowest part of a GeoNorm step on a CPU, hence its node in fused.py).

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
    - `norms="pre+final"`: the sub-layers see N(x) instead of x. Follows "Pre-Norm can be regarded
      as a special case of GeoNorm" (§3.3), whose sub-layers take Norm(x) (App. B, eq. 8). The
      angles are still measured against the stream's own radius: with the embedding's, the MLP's
      update is already 1.4 ||x|| at init (CPU bench shape), past the clamp.

    The paper's App. D listing has bugs that this module does not copy: its "harmonic" branch
    assigns to `theta_attn`, so neither the decay nor `scale` and `bias` (a and b) are applied;
    `__init__` ignores its `clamp` argument (always pi/4); `nn.Parameter(torch.tensor(1))` is an
    integer tensor, which cannot require grad; the default method name is misspelled "harnomic";
    and `math` is not imported. What the listing computes, theta' = min(||v|| / ||x||, pi/4), is
    `GeodesicStep(1.0, pi / 4, affine=False)` (no decay; a, b fixed at 1, 0); `geonorm_decay="none"` alone
    still learns a and b.
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
        return geodesic_angle(x, s, self.a, self.b, self.decay, self.clamp, self.lowest)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        args = (x, s, self.a, self.b, self.decay, self.clamp, self.lowest)
        return fused(fast_geodesic_step, geodesic_step, *args)

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
    """The factor on q.k: 1/sqrt(d_h) (standard), 1/d_h (Bir et al. §4.3), sqrt(d_h) (nGPT §2.3.2, for unit q and
    k, whose dot products have variance 1/d_h) or 1.44/sqrt(d_h) (nanochat: its normed q and k each times 1.2)."""
    return {"1/sqrt(d)": 1.0 / math.sqrt(head_dim), "1/d": 1.0 / head_dim, "sqrt(d)": math.sqrt(head_dim),
            "1.44/sqrt(d)": 1.2**2 / math.sqrt(head_dim)}[attn_scale]


def rope_tables(head_dim: int, length: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angle t * base^(-2i/d_h) of position t and channel pair i (RoFormer eq. 15)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def register_rope(module: nn.Module, head_dim: int, length: int, base: float) -> None:
    """Give an attention module the RoPE tables for `length` positions as buffers `rope_cos`, `rope_sin`."""
    cos, sin = rope_tables(head_dim, length, base)
    module.register_buffer("rope_cos", cos, persistent=False)
    module.register_buffer("rope_sin", sin, persistent=False)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's channels by position (RoFormer eq. 34)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2, the MLP nonlinearity of modded-nanogpt and nanochat (So et al., Primer, 2021)."""
    return F.relu(x).square()


ACTIVATIONS = {"gelu": F.gelu, "relu2": relu2}  # the one-matrix MLPs' nonlinearity by `mlp` (swiglu has two)


def mlp_width(n_embd: int, mlp: str, mlp_hidden: int | None = None) -> int:
    """The MLP's hidden width: `mlp_hidden` if given, else 4d for GELU and, for SwiGLU, 2/3 of 4d rounded up to
    a multiple of 64 (the same parameter count)."""
    if mlp_hidden is not None:
        return mlp_hidden
    return 64 * math.ceil(8 * n_embd / 3 / 64) if mlp == "swiglu" else 4 * n_embd


def init_block_matrix(init: str, name: str, weight: torch.Tensor, n_layer: int) -> None:
    """Draw a block's matrix `name` (its path in the block: attn.sublayer.q_proj, mlp.sublayer.fc, ...) by the
    row's `init`; the GPT-2 default N(0, 0.02) is already drawn, and "normal" (OLMo 2, LNS) keeps it."""
    residual_out = name.endswith(("out_proj", "mlp.sublayer.proj"))
    if init == "gpt2" and residual_out:
        # GPT-2: residual projections scaled by 1/sqrt(2L) (2 residual updates per block)
        nn.init.normal_(weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
    elif init == "xavier":
        nn.init.xavier_normal_(weight)
    elif init == "deepnorm":
        # DeepNet (decoder-only): beta = (8L)^(-1/4) on v, out and the MLP; q, k gain 1
        beta = 1.0 if name.endswith(("q_proj", "k_proj")) else (8 * n_layer) ** -0.25
        nn.init.xavier_normal_(weight, gain=beta)
    elif init == "orthogonal":  # Bir et al. §4.3: every hidden matrix starts orthonormal
        nn.init.orthogonal_(weight)
    elif init in ("zero_out", "nanochat") and residual_out:  # modded-nanogpt, nanochat: updates start at zero
        nn.init.zeros_(weight)
    elif init == "nanochat":  # nanochat gpt.py init_weights: U(+-sqrt(3/d)), the MLP's input map 0.4 times that
        bound = math.sqrt(3 / weight.shape[1]) * (0.4 if name.endswith("mlp.sublayer.fc") else 1.0)
        nn.init.uniform_(weight, -bound, bound)


# ----------------------------------------------------------------------------- attention, logits and losses


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


class Attention(nn.Module):
    """Causal softmax attention of (B, heads, T, head_dim) q, k, v: torch's fused kernel, or, where the scores
    themselves are needed (Gemma 2's attention softcap, QK-Clip's record), the same math written out:
    softmax(mask(cap(q k^T scale))) v with the softmax in float32 (as litgpt's softcapped path)."""

    def __init__(self, scale: float, dropout: float, cap: float | None = None, clip: QKClip | None = None):
        super().__init__()
        self.scale, self.dropout, self.cap, self.clip = scale, dropout, cap, clip

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if self.cap is None and self.clip is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, dropout_p=dropout)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        T = scores.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
        if self.clip is not None and self.training:
            self.clip.record(scores, causal)
        if self.cap is not None:
            scores = softcap(scores, self.cap)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        weights = F.softmax(scores.masked_fill(~causal, -math.inf), dim=-1).to(v.dtype)
        return F.dropout(weights, dropout) @ v


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


# ----------------------------------------------------------------------------- the stream before each block


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

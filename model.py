"""
One GPT that holds every normalization scheme of the source papers as flags.

Reading order: the scheme table (which primitives each scheme uses), the config, the norms,
the residual combine rules (including GeoNorm's geodesic step), attention, MLP, the residual
update that ties them together, the block, and the GPT.

Every block performs the same four steps for its attention and its MLP:

    y = branch_scale * f(pre_norm(x))      # sub-layer on an optionally normalized input
    y = mid_norm(y)                         # optional norm of the sub-layer output
    x = combine(x, y)                       # residual rule: add, scaled add, geodesic step
    x = post_norm(x)                        # optional norm after the residual (Post/DeepNorm)

A scheme is a row of `SCHEMES`; a new scheme is a new row plus, at most, one new combine rule.
Papers (full titles in the README): GeoNorm (Zheng et al.), DNT (Qi et al.), the Lipschitz block
and Manifold Muon (Bir et al.), the head-wise norm proposal, and Pre-LN vs Post-LN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F

from autograd_ops import GeodesicStepFunction, RMSNormFunction, geodesic_terms


class Scheme(NamedTuple):
    """The primitives one residual scheme is made of (every field is overridable per config)."""

    input_norm: bool  # normalize the embedding before the first block (DNT InputNorm)
    pre_norm: str  # which sub-layers see a normalized input: "attn+mlp", "attn", "mlp", "none"
    qk_norm: bool  # RMS-normalize queries and keys per head (DNT QKNorm)
    mid_norm: bool  # normalize each sub-layer output before the residual (DNT MidNorm)
    combine: str  # residual rule, see `combine_coefficients` and `GeodesicStep`
    post_norm: bool  # normalize after the residual (Post-Norm, DeepNorm)
    final_norm: bool  # normalize before the output head
    attn_scale: str  # attention logit scale: "1/sqrt(d)" (standard) or "1/d" (Lipschitz)
    branch_scale: float  # multiplies each sub-layer output (1/3 in the Lipschitz block)
    init: str  # "gpt2", "xavier", "deepnorm", "orthogonal" (see `GPT._init_block_linear`)


# fmt: off
#                  input  pre_norm    qk     mid    combine     post   final  attn_scale   branch init
SCHEMES: dict[str, Scheme] = {
    "post":      Scheme(False, "none",     False, False, "add",      True,  False, "1/sqrt(d)", 1.0, "gpt2"),
    "pre":       Scheme(False, "attn+mlp", False, False, "add",      False, True,  "1/sqrt(d)", 1.0, "gpt2"),
    "pre_alt":   Scheme(False, "attn+mlp", False, False, "pre_alt",  False, True,  "1/sqrt(d)", 1.0, "gpt2"),
    "deepnorm":  Scheme(False, "none",     False, False, "deepnorm", True,  False, "1/sqrt(d)", 1.0, "deepnorm"),
    "sandwich":  Scheme(False, "attn+mlp", False, True,  "add",      False, True,  "1/sqrt(d)", 1.0, "gpt2"),
    "geonorm":   Scheme(False, "none",     False, False, "geodesic", False, True,  "1/sqrt(d)", 1.0, "gpt2"),
    "dnt":       Scheme(True,  "attn",     True,  True,  "add",      False, True,  "1/sqrt(d)", 1.0, "xavier"),
    "lipschitz": Scheme(False, "none",     False, False, "convex",   False, False, "1/d",       1/3, "orthogonal"),
    "none":      Scheme(False, "none",     False, False, "add",      False, False, "1/sqrt(d)", 1.0, "orthogonal"),
}

# `none` is Bir et al. §5.1's norm-free baseline: the Lipschitz block's orthogonal init without
# its scalings or convex residual (with N(0, 0.02) init it would be a different, tamer model).
# DNT App. D ablation settings; `dnt` above is S5, the paper's default.
DNT_SETTINGS: dict[str, Scheme] = {
    "S1": Scheme(False, "attn+mlp", False, False, "add",     False, True,  "1/sqrt(d)", 1.0, "xavier"),
    "S2": Scheme(False, "attn+mlp", True,  False, "add",     False, True,  "1/sqrt(d)", 1.0, "xavier"),
    "S3": Scheme(True,  "attn+mlp", True,  False, "add",     False, True,  "1/sqrt(d)", 1.0, "xavier"),
    "S4": Scheme(True,  "attn+mlp", True,  True,  "add",     False, True,  "1/sqrt(d)", 1.0, "xavier"),
    "S5": SCHEMES["dnt"],
}
# fmt: on

NORM_TYPES = ("layernorm", "rmsnorm", "headwise")
COMBINE_RULES = ("add", "pre_alt", "deepnorm", "convex", "geodesic")
PRE_NORM_PLACES = ("attn+mlp", "attn", "mlp", "none")
ATTN_SCALES = ("1/sqrt(d)", "1/d")
INITS = ("gpt2", "xavier", "deepnorm", "orthogonal")
GEONORM_DECAYS = ("harmonic", "sqrt", "linear", "none")
GEONORM_RADII = ("embedding", "sqrt_d")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, like GPT-2
    # normalization: a scheme (a row of SCHEMES) and the norm type used everywhere it normalizes
    norm_scheme: str = "pre"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    dnt_setting: str = "S5"
    # per-primitive overrides of the scheme's row; None keeps the row's value
    input_norm: bool | None = None
    pre_norm: str | None = None
    qk_norm: bool | None = None
    mid_norm: bool | None = None
    combine: str | None = None
    post_norm: bool | None = None
    final_norm: bool | None = None
    attn_scale: str | None = None
    branch_scale: float | None = None
    init: str | None = None
    # GeoNorm (eq. 5), for models that combine by the geodesic step: step-size decay over blocks, the
    # angle clamp, learnable a and b (False fixes them at 1, 0), and the sphere the stream lives on
    # ("embedding": each token's embedding norm; "sqrt_d": the embedding projected onto radius
    # sqrt(n_embd)); see GeodesicStep
    geonorm_decay: str = "harmonic"
    geonorm_clamp: float = math.pi / 4
    geonorm_affine: bool = True
    geonorm_radius: str = "embedding"
    # Lipschitz block (Bir et al. §6.2): learnable diagonal gain on every hidden linear map,
    # clamped to [1e-3, gain_cap]; None disables it
    gain_cap: float | None = None
    # architecture
    mlp: str = "gelu"  # "gelu" (GPT-2, 4d hidden) or "swiglu"
    mlp_hidden: int | None = None  # MLP width; None: 4d for gelu, 8d/3 rounded up to 64 for swiglu
    pos: str = "learned"  # "learned" (GPT-2) or "rope"
    rope_base: float = 10000.0
    # vector mode (the least-squares task): float inputs and outputs instead of tokens
    in_features: int | None = None
    out_features: int | None = None
    embed_fan_in: int | None = None  # non-zero input features per token (Bir et al.: 7)

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def scheme(self) -> Scheme:
        """The scheme's row with this config's overrides applied."""
        if self.norm_scheme == "dnt":
            row = DNT_SETTINGS[self.dnt_setting]
        else:
            row = SCHEMES[self.norm_scheme]
        overrides = {k: getattr(self, k) for k in Scheme._fields if getattr(self, k) is not None}
        return row._replace(**overrides)

    @property
    def vector_mode(self) -> bool:
        return self.in_features is not None


def _check_choice(name: str, value: object, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of: {', '.join(choices)}")


def check_config(c: GPTConfig) -> None:
    """Reject impossible settings with a message that names the key and the valid values."""
    _check_choice("norm_scheme", c.norm_scheme, tuple(SCHEMES))
    _check_choice("norm", c.norm, NORM_TYPES)
    _check_choice("dnt_setting", c.dnt_setting, tuple(DNT_SETTINGS))
    _check_choice("geonorm_decay", c.geonorm_decay, GEONORM_DECAYS)
    _check_choice("geonorm_radius", c.geonorm_radius, GEONORM_RADII)
    _check_choice("mlp", c.mlp, ("gelu", "swiglu"))
    _check_choice("pos", c.pos, ("learned", "rope"))
    for key, choices in [("pre_norm", PRE_NORM_PLACES), ("combine", COMBINE_RULES),
                         ("attn_scale", ATTN_SCALES), ("init", INITS)]:
        if getattr(c, key) is not None:
            _check_choice(key, getattr(c, key), choices)
    if c.n_embd % c.n_head != 0:
        raise ValueError(f"n_embd={c.n_embd} must be divisible by n_head={c.n_head}")
    if c.pos == "rope" and (c.n_embd // c.n_head) % 2 != 0:
        raise ValueError(f"pos='rope' needs an even head size, got {c.n_embd // c.n_head}")
    if (c.in_features is None) != (c.out_features is None):
        raise ValueError("vector mode needs both in_features and out_features (or neither)")
    if not 0 < c.geonorm_clamp <= math.pi:
        raise ValueError(f"geonorm_clamp={c.geonorm_clamp} must lie in (0, pi]")
    if c.mlp_hidden is not None and c.mlp_hidden < 1:
        raise ValueError(f"mlp_hidden={c.mlp_hidden} must be a positive width (or None for the default)")
    if c.gain_cap is not None and c.gain_cap <= 1e-3:
        raise ValueError(f"gain_cap={c.gain_cap} must exceed the gain floor 1e-3")


# ----------------------------------------------------------------------------- norms


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm over the last dim (same parameters and state dict), computed by `RMSNormFunction`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return RMSNormFunction.apply(x, self.weight, eps)


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
        return RMSNormFunction.apply(groups, self.weight.view(self.n_head, -1), self.eps).flatten(-2)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, eps=config.norm_eps)
    return HeadwiseRMSNorm(config.n_embd, config.n_head, eps=config.norm_eps)


def maybe_norm(config: GPTConfig, wanted: bool) -> nn.Module:
    return make_norm(config) if wanted else nn.Identity()


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
        theta' = clamp((a * theta + b) * decay(l), -c, c)     a, b learnable (init 1, 0)
        x_new  = cos(theta') x + ||x|| sin(theta') v / ||v||  so ||x_new|| = ||x||

    The clamp bounds the step's length |theta'|; the listing's one-sided min(., c) is the same
    whenever a * theta + b >= -c, which holds at init and in every run we have seen.
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

    def __init__(self, decay: float, clamp: float, affine: bool = True):
        super().__init__()
        self.decay, self.clamp = decay, clamp
        if affine:
            self.a = nn.Parameter(torch.tensor(1.0))
            self.b = nn.Parameter(torch.tensor(0.0))
        else:  # fixed at the identity map theta' = theta * decay
            self.register_buffer("a", torch.tensor(1.0))
            self.register_buffer("b", torch.tensor(0.0))

    def angle(self, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The applied angle theta', the radius ||x||, the tangent v and ||v|| (per token)."""
        t = geodesic_terms(x, s, self.a, self.b, self.decay, self.clamp)
        return t.theta, t.radius, t.v, t.v_norm

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return GeodesicStepFunction.apply(x, s, self.a, self.b, self.decay, self.clamp)

    def extra_repr(self) -> str:
        return f"decay={self.decay:.4g}, clamp={self.clamp:.4g}"


def make_combine(config: GPTConfig, j: int, layer: int) -> nn.Module:
    rule = config.scheme.combine
    if rule == "geodesic":
        decay = geonorm_decay(config.geonorm_decay, layer, config.n_layer)
        return GeodesicStep(decay, config.geonorm_clamp, config.geonorm_affine)
    return ScaledAdd(*combine_coefficients(rule, j, config.n_layer))


# ----------------------------------------------------------------------------- sub-layers


class GainLinear(nn.Linear):
    """A linear map followed by a learnable diagonal gain clamped to [1e-3, cap] (Bir et al. §6.2)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, cap: float):
        super().__init__(in_features, out_features, bias=bias)
        self.cap = cap
        self.gain = nn.Parameter(torch.ones(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain.clamp(1e-3, self.cap)


def make_linear(config: GPTConfig, d_in: int, d_out: int) -> nn.Linear:
    if config.gain_cap is not None:
        return GainLinear(d_in, d_out, config.bias, config.gain_cap)
    return nn.Linear(d_in, d_out, bias=config.bias)


def rope_tables(head_dim: int, length: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's channels by position (RoFormer)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d, self.n_head = config.n_embd, config.n_head
        self.head_dim = d // config.n_head
        # separate q/k/v maps: each is its own matrix for the inits and Muon-style optimizers
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            make_linear(config, d, d) for _ in range(4))
        qk_norm = config.scheme.qk_norm  # DNT eq. 10: gamma * sqrt(d_h) * q / ||q||
        self.q_norm = RMSNorm(self.head_dim, eps=config.norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, eps=config.norm_eps) if qk_norm else nn.Identity()
        lipschitz_scale = config.scheme.attn_scale == "1/d"  # Bir et al. §4.3
        self.scale = 1.0 / self.head_dim if lipschitz_scale else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.dropout
        self.rope = config.pos == "rope"
        if self.rope:
            cos, sin = rope_tables(self.head_dim, config.block_size, config.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        heads = (B, T, self.n_head, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(heads)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(heads)).transpose(1, 2)
        v = self.v_proj(x).view(heads).transpose(1, 2)
        if self.rope:
            q = apply_rope(q, self.rope_cos, self.rope_sin)
            k = apply_rope(k, self.rope_cos, self.rope_sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.n_embd
        self.swiglu = config.mlp == "swiglu"
        hidden = config.mlp_hidden
        if hidden is None:  # SwiGLU: 2/3 of 4d (rounded up to 64) keeps GELU's parameter count
            hidden = 64 * math.ceil(8 * d / 3 / 64) if self.swiglu else 4 * d
        self.fc = make_linear(config, d, hidden)
        self.gate = make_linear(config, d, hidden) if self.swiglu else None
        self.proj = make_linear(config, hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(F.gelu(self.fc(x)))


# ----------------------------------------------------------------------------- block


class ResidualUpdate(nn.Module):
    """One residual update j: x <- post_norm(combine(x, mid_norm(s * f(pre_norm(x)))))."""

    def __init__(self, config: GPTConfig, sublayer: nn.Module, name: str, j: int, layer: int):
        super().__init__()
        scheme = config.scheme
        self.pre_norm = maybe_norm(config, scheme.pre_norm in ("attn+mlp", name))
        self.sublayer = sublayer
        self.branch_scale = scheme.branch_scale
        self.dropout = nn.Dropout(config.dropout)
        self.mid_norm = maybe_norm(config, scheme.mid_norm)
        self.combine = make_combine(config, j, layer)
        self.post_norm = maybe_norm(config, scheme.post_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.sublayer(self.pre_norm(x))
        if self.branch_scale != 1.0:
            y = self.branch_scale * y
        y = self.mid_norm(self.dropout(y))
        return self.post_norm(self.combine(x, y))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.attn = ResidualUpdate(config, CausalSelfAttention(config), "attn", 2 * layer + 1, layer)
        self.mlp = ResidualUpdate(config, MLP(config), "mlp", 2 * layer + 2, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


# ----------------------------------------------------------------------------- GPT


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        scheme = config.scheme
        d = config.n_embd
        if config.vector_mode:
            self.wte = nn.Linear(config.in_features, d, bias=False)
        else:
            self.wte = nn.Embedding(config.vocab_size, d)
        self.wpe = nn.Embedding(config.block_size, d) if config.pos == "learned" else None
        self.input_norm = maybe_norm(config, scheme.input_norm)
        self.drop = nn.Dropout(config.dropout)
        # GeoNorm's sqrt_d reading: the stream starts on the sphere of radius sqrt(d) (see GeodesicStep)
        on_sqrt_d_sphere = scheme.combine == "geodesic" and config.geonorm_radius == "sqrt_d"
        self.embed_radius = math.sqrt(d) if on_sqrt_d_sphere else None
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.final_norm = maybe_norm(config, scheme.final_norm)
        if config.vector_mode:
            self.lm_head = nn.Linear(d, config.out_features, bias=False)
        else:
            self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
            self.wte.weight = self.lm_head.weight  # weight tying (GPT-2)
        self.apply(self._init_weights)
        for block in self.blocks:
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear):
                    self._init_block_linear(name, module.weight)

    # ---- initialization

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 defaults: N(0, 0.02) weights and embeddings, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        if self.config.vector_mode and module is self.wte:
            # Bir et al. §4.3: N(0, 1/s) with s non-zero input features, so embedded RMS ~ 1
            fan_in = self.config.embed_fan_in or self.config.in_features
            nn.init.normal_(module.weight, mean=0.0, std=fan_in**-0.5)

    def _init_block_linear(self, name: str, weight: torch.Tensor) -> None:
        """The hidden matrices' init named by the scheme's `init` primitive."""
        init, n_layer = self.config.scheme.init, self.config.n_layer
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

    # ---- forward

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            T = idx.shape[1]
            if T > self.config.block_size:
                raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(self.input_norm(x))
        if self.embed_radius is not None:  # a projection without parameters: every token at norm sqrt(d)
            x = self.embed_radius * F.normalize(x, dim=-1)
        return x

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (B, T) -> logits (B, T, vocab) and the cross-entropy loss if targets are given.

        Vector mode: floats (B, T, in_features) -> (B, T, out_features); the task computes its
        own loss, so the second element is None. Without targets, a token model returns only
        the last position's logits (all that sampling needs).
        """
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        if self.config.vector_mode:
            return self.lm_head(x), None
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    # ---- constraints applied after every optimizer step

    @torch.no_grad()
    def apply_parameter_constraints(self) -> None:
        """Put constrained parameters back on their sets; train.py calls this after every optimizer step.

        Any sub-module with a `constrain_()` method takes part (a clamped gain, normalized weights);
        for a model without one this is a no-op. It must be deterministic, so that every DDP rank and
        a resumed run make the same change to the same weights.
        """
        for module in self.modules():
            if module is not self and hasattr(module, "constrain_"):
                module.constrain_()

    # ---- utilities

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; position embeddings are left out by default (tied wte is counted)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.wpe is not None:
            n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N for the matmuls plus 12 L d T for attention (PaLM App. B)."""
        c = self.config
        return 6 * self.get_num_params() + 12 * c.n_layer * c.n_embd * seq_len

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
        top_k: int | None = None, generator: torch.Generator | None = None, vocab_limit: int | None = None,
    ) -> torch.Tensor:
        """Sample max_new_tokens continuations of idx (B, T), cropping to block_size. Ids from
        vocab_limit on (the padding of a vocabulary rounded up to a multiple of 64) are never drawn."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits, _ = self(context)
            logits = logits[:, -1, :vocab_limit] / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


@torch.no_grad()
def block_activation_rms(model: GPT, inputs: torch.Tensor) -> list[float]:
    """RMS of the residual stream after each block (Bir et al. Fig. 3), from one forward pass."""
    rms: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda m, i, out: rms.append(out.float().square().mean()))
             for b in model.blocks]
    try:
        model(inputs)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(rms).sqrt().tolist()


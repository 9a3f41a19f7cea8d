"""
One GPT that holds every normalization scheme of the source papers as flags.

Reading order: the scheme table (which primitives each scheme uses), the config, the factories
that build a scheme's norms and combine rules from it, attention, MLP, the residual update that
ties them together, the block, and the GPT. The building blocks themselves (the norm types, the
residual combine rules including GeoNorm's geodesic step, RoPE) live in layers.py; nGPT's
unit-norm modules live in ngpt.py.

Every block performs the same four steps for its attention and its MLP:

    y = branch_scale * f(pre_norm(x))      # sub-layer on an optionally normalized (and scaled, LNS) input
    y = mid_norm(y)                         # optional norm of the sub-layer output
    x = combine(x, y)                       # residual rule: add, scaled add, geodesic step, ReZero gate
    x = post_norm(x)                        # optional norm after the residual (Post/DeepNorm)

A scheme is a row of `SCHEMES`; a new scheme is a new row plus, at most, one new combine rule.
Papers (full titles in the README): GeoNorm (Zheng et al.), DNT (Qi et al.), the Lipschitz block
and Manifold Muon (Bir et al.), the head-wise norm proposal, and Pre-LN vs Post-LN; since 2020,
DyT, Derf, Peri-LN, OLMo 2, Mix-LN, LNS, HybridNorm, ReZero and the modded-nanogpt speedrun; and nGPT
(Loshchilov et al.), whose unit-norm modules are in ngpt.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F

from layers import (
    DynamicErf,
    DynamicTanh,
    GainLinear,
    GeodesicStep,
    HeadwiseRMSNorm,
    ReZeroAdd,
    RMSNorm,
    ScalarGain,
    ScaledAdd,
    apply_rope,
    combine_coefficients,
    geonorm_decay,
    mlp_width,
    register_rope,
    softmax_scale,
)
from ngpt import NormalizedLerp, SphereAttention, SphereEmbedding, SphereHead, SphereMLP


class Scheme(NamedTuple):
    """The primitives one residual scheme is made of (every field is overridable per config)."""

    input_norm: bool  # normalize the embedding before the first block (DNT InputNorm)
    pre_norm: str  # which sub-layers see a normalized input: "attn+mlp", "attn", "mlp", "none"
    qk_norm: bool  # RMS-normalize queries and keys per head (DNT QKNorm)
    mid_norm: bool  # normalize each sub-layer output before the residual (DNT MidNorm)
    combine: str  # residual rule, see `combine_coefficients` and `GeodesicStep`
    post_norm: bool  # normalize after the residual (Post-Norm, DeepNorm)
    final_norm: bool  # normalize before the output head
    attn_scale: str  # attention logit scale: "1/sqrt(d)" (standard), "1/d" (Lipschitz), "sqrt(d)" (nGPT)
    branch_scale: float  # multiplies each sub-layer output (1/3 in the Lipschitz block)
    init: str  # "gpt2", "xavier", "deepnorm", "orthogonal", "normal", "zero_out" (see `GPT._init_block_linear`)
    # columns of the schemes since 2020; their defaults leave the rows that do not name them unchanged
    v_norm: bool = False  # RMS-normalize the values like the queries and keys (HybridNorm's QKV-Norm)
    qk_norm_span: str = "head"  # q/k/v norm over each head ("head", DNT eq. 10) or the whole projection ("all", OLMo 2)
    pre_norm_scale: str = "1"  # multiplies each pre-norm output: "1", or "1/sqrt(l)" in block l = 1..L (LNS)
    post_norm_at: str = "attn+mlp"  # the updates post_norm follows: "attn+mlp", or "attn" (HybridNorm)
    first_blocks: str = "same"  # "post": first blocks Post-Norm (Mix-LN); "pre": block 0 Pre-Norm (HybridNorm*)
    norm_affine: bool = True  # False: no norm has a learnable parameter (modded-nanogpt's parameter-free RMSNorm)
    hypersphere: bool = False  # nGPT's unit-norm weights and sub-layers with learned scalings (see `SphereLinear`)
    tie_head: bool = True  # the output head shares the token embedding's weight (GPT-2)


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
    "peri":      Scheme(True,  "attn+mlp", False, True,  "add",      False, True,  "1/sqrt(d)", 1.0, "gpt2"),
    "olmo2":     Scheme(False, "none",     True,  True,  "add",      False, True,  "1/sqrt(d)", 1.0, "normal",
                        qk_norm_span="all"),
    "mixln":     Scheme(False, "attn+mlp", False, False, "add",      False, True,  "1/sqrt(d)", 1.0, "gpt2",
                        first_blocks="post"),
    "lns":       Scheme(False, "attn+mlp", False, False, "add",      False, True,  "1/sqrt(d)", 1.0, "normal",
                        pre_norm_scale="1/sqrt(l)"),
    "hybrid":    Scheme(False, "none",     True,  False, "add",      True,  True,  "1/sqrt(d)", 1.0, "gpt2",
                        v_norm=True, post_norm_at="attn"),
    "rezero":    Scheme(False, "none",     False, False, "rezero",   False, False, "1/sqrt(d)", 1.0, "gpt2"),
    "speedrun":  Scheme(True,  "attn+mlp", True,  False, "add",      False, True,  "1/sqrt(d)", 1.0, "zero_out",
                        norm_affine=False),
    "ngpt":      Scheme(False, "none",     True,  False, "nlerp",    False, False, "sqrt(d)",   1.0, "gpt2",
                        hypersphere=True, tie_head=False),
}

# `none` is Bir et al. §5.1's norm-free baseline: the Lipschitz block's orthogonal init without
# its scalings or convex residual (with N(0, 0.02) init it would be a different, tamer model).
# Since 2020 (sources in the README): `peri` is Peri-LN, x + N(f(N(x))) with the embedding and the output
# normalized. `olmo2` normalizes each sub-layer's output, not its input, and q, k over the whole projection;
# OLMo 2 starts every weight from N(0, 0.02). `hybrid` is HybridNorm: QKV-norm, no norm on the block input,
# and Y = X + MHA(X), X' = N(Y) + FFN(N(Y)), i.e. a post-norm after the attention update only.
# `speedrun` is the modded-nanogpt record of 2024-11-03 minus its untied, zero-initialized head: every
# scheme here ties the head to the embedding. `norm="dyt"`/`"derf"` replace every norm above except q/k/v's.
# `ngpt`'s matrices are drawn by `init` and then put on the unit sphere, so only the directions of the
# draw matter (isotropic, as the paper's N(0, 1/sqrt(d)) draw); its QK-norm is L2 times s_qk.
# DNT App. D ablation settings; `dnt` above is S5, the paper's default.
DNT_SETTINGS: dict[str, Scheme] = {
    "S1": Scheme(False, "attn+mlp", False, False, "add",     False, True,  "1/sqrt(d)", 1.0, "xavier"),
    "S2": Scheme(False, "attn+mlp", True,  False, "add",     False, True,  "1/sqrt(d)", 1.0, "xavier"),
    "S3": Scheme(True,  "attn+mlp", True,  False, "add",     False, True,  "1/sqrt(d)", 1.0, "xavier"),
    "S4": Scheme(True,  "attn+mlp", True,  True,  "add",     False, True,  "1/sqrt(d)", 1.0, "xavier"),
    "S5": SCHEMES["dnt"],
}
# fmt: on

NORM_TYPES = ("layernorm", "rmsnorm", "headwise", "dyt", "derf")
ELEMENTWISE_NORMS = ("dyt", "derf")  # norm replacements without statistics (not scale invariant)
COMBINE_RULES = ("add", "pre_alt", "deepnorm", "convex", "geodesic", "rezero", "nlerp")
PRE_NORM_PLACES = ("attn+mlp", "attn", "mlp", "none")
ATTN_SCALES = ("1/sqrt(d)", "1/d", "sqrt(d)")
INITS = ("gpt2", "xavier", "deepnorm", "orthogonal", "normal", "zero_out")
QK_NORM_SPANS = ("head", "all")
PRE_NORM_SCALES = ("1", "1/sqrt(l)")
POST_NORM_PLACES = ("attn+mlp", "attn")
FIRST_BLOCKS = ("same", "post", "pre")
GEONORM_DECAYS = ("harmonic", "sqrt", "linear", "none")
GEONORM_RADII = ("embedding", "sqrt_d")
GEONORM_CLAMP_SIDES = ("upper", "both")


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
    v_norm: bool | None = None
    qk_norm_span: str | None = None
    pre_norm_scale: str | None = None
    post_norm_at: str | None = None
    first_blocks: str | None = None  # "pre" on norm_scheme="hybrid" is HybridNorm*
    norm_affine: bool | None = None
    mixln_fraction: float = 0.25  # Mix-LN's alpha: the first floor(alpha * L) blocks are Post-Norm
    # DyT and Derf: alpha's initial value in every norm, in the attention update's norms, in the final norm
    # (None: norm_alpha_init); DyT's LLaMA recipe uses 0.2 / 0.8 / 0.2 at 7B
    norm_alpha_init: float = 0.5
    norm_alpha_init_attn: float | None = None
    norm_alpha_init_final: float | None = None
    # a learnable scalar, init sqrt(d), multiplies the embedding; None: exactly with norm="dyt"/"derf", as DyT's
    # LLaMA recipe and Derf's GPT-2 code do (without it a pre-norm DyT stream starts at the 0.02 init scale)
    embed_scale: bool | None = None
    rezero_gate: str = "update"  # ReZero's alpha: one per residual "update", or one per "block" (see ReZeroAdd)
    hypersphere: bool | None = None
    tie_head: bool | None = None
    # GeoNorm (eq. 5), for models that combine by the geodesic step: step-size decay over blocks, the
    # angle clamp, learnable a and b (False fixes them at 1, 0), and the sphere the stream lives on
    # ("embedding": each token's embedding norm; "sqrt_d": the embedding projected onto radius
    # sqrt(n_embd)); see GeodesicStep
    geonorm_decay: str = "harmonic"
    geonorm_clamp: float = math.pi / 4
    geonorm_clamp_sides: str = "upper"  # theta' <= c (eq. 5, App. D), or "both": -c <= theta' <= c
    geonorm_affine: bool = True
    geonorm_radius: str = "embedding"
    # Lipschitz block (Bir et al. §6.2): learnable diagonal gain on every hidden linear map,
    # clamped to [1e-3, gain_cap]; None disables it
    gain_cap: float | None = None
    # nGPT (eq. 10, 11): the eigen learning rates alpha_A, alpha_M start here (0.05 in the paper and
    # its code, "in the order of 1/n_layers" (§2.6): 1/n_layer is the other reading at another depth)
    ngpt_alpha_init: float = 0.05
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
    _check_choice("geonorm_clamp_sides", c.geonorm_clamp_sides, GEONORM_CLAMP_SIDES)
    _check_choice("mlp", c.mlp, ("gelu", "swiglu"))
    _check_choice("pos", c.pos, ("learned", "rope"))
    _check_choice("rezero_gate", c.rezero_gate, ("update", "block"))
    for key, choices in [("pre_norm", PRE_NORM_PLACES), ("combine", COMBINE_RULES),
                         ("attn_scale", ATTN_SCALES), ("init", INITS), ("qk_norm_span", QK_NORM_SPANS),
                         ("pre_norm_scale", PRE_NORM_SCALES), ("post_norm_at", POST_NORM_PLACES),
                         ("first_blocks", FIRST_BLOCKS)]:
        if getattr(c, key) is not None:
            _check_choice(key, getattr(c, key), choices)
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        if getattr(c, key) < 1:
            raise ValueError(f"{key}={getattr(c, key)} must be at least 1")
    if c.norm_eps < 0:
        raise ValueError(f"norm_eps={c.norm_eps} must not be negative (it keeps the norm's division away from 0)")
    if not c.rope_base > 1:
        raise ValueError(f"rope_base={c.rope_base} must exceed 1 (the RoPE paper's is 10000): the rotation "
                         "frequencies are its powers base^(-2i/d)")
    if c.branch_scale is not None and not c.branch_scale > 0:
        raise ValueError(f"branch_scale={c.branch_scale} must be positive (it multiplies every sub-layer's output)")
    if c.embed_fan_in is not None and c.embed_fan_in < 1:
        raise ValueError(f"embed_fan_in={c.embed_fan_in} must be at least 1 (a count of input features), or None")
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
    if not 0 <= c.mixln_fraction <= 1:
        raise ValueError(f"mixln_fraction={c.mixln_fraction} must lie in [0, 1] (a fraction of the blocks)")
    if c.gain_cap is not None and c.gain_cap <= 1e-3:
        raise ValueError(f"gain_cap={c.gain_cap} must exceed the gain floor 1e-3")
    if c.ngpt_alpha_init <= 0:
        raise ValueError(f"ngpt_alpha_init={c.ngpt_alpha_init} must be positive (the paper uses 0.05)")
    if c.scheme.hypersphere and c.vector_mode:
        raise ValueError("hypersphere=True (norm_scheme='ngpt') needs token inputs: its embeddings are unit "
                         "vectors looked up by id; drop in_features/out_features or pick another norm_scheme")
    if c.scheme.hypersphere and c.gain_cap is not None:
        raise ValueError("gain_cap adds a gain to the plain linear maps; hypersphere=True (norm_scheme='ngpt') "
                         "keeps its matrices at unit norm instead: set gain_cap=None")


# ----------------------------------------------------------------------------- norms


def make_norm(config: GPTConfig, alpha_init: float | None = None) -> nn.Module:
    """The norm named by `config.norm`; alpha_init sets DyT/Derf's alpha here (None: `norm_alpha_init`)."""
    if config.norm == "layernorm":
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, eps=config.norm_eps)
    if config.norm in ELEMENTWISE_NORMS:
        alpha = config.norm_alpha_init if alpha_init is None else alpha_init
        return {"dyt": DynamicTanh, "derf": DynamicErf}[config.norm](config.n_embd, alpha, config.bias)
    return HeadwiseRMSNorm(config.n_embd, config.n_head, eps=config.norm_eps)


def without_parameters(norm: nn.Module) -> nn.Module:
    """The same norm with each of its parameters turned into a constant at its initial value (gain 1, bias 0)."""
    for name, p in list(norm.named_parameters(recurse=False)):
        delattr(norm, name)
        norm.register_buffer(name, p.detach(), persistent=False)
    return norm


def maybe_norm(config: GPTConfig, wanted: bool, alpha_init: float | None = None) -> nn.Module:
    if not wanted:
        return nn.Identity()
    norm = make_norm(config, alpha_init)
    return norm if config.scheme.norm_affine else without_parameters(norm)


def norm_alpha_init(config: GPTConfig, place: str) -> float:
    """DyT/Derf's initial alpha at a place: "attn", "mlp" or "final" (per-place values of DyT's LLM recipe)."""
    chosen = {"attn": config.norm_alpha_init_attn, "final": config.norm_alpha_init_final}.get(place)
    return config.norm_alpha_init if chosen is None else chosen


# ----------------------------------------------------------------------------- combine rules


def make_combine(config: GPTConfig, j: int, layer: int) -> nn.Module:
    rule = config.scheme.combine
    if rule == "geodesic":
        decay = geonorm_decay(config.geonorm_decay, layer, config.n_layer)
        return GeodesicStep(decay, config.geonorm_clamp, config.geonorm_affine, config.geonorm_clamp_sides)
    if rule == "rezero":
        return ReZeroAdd()
    if rule == "nlerp":  # nGPT §2.6: alpha_init 0.05, alpha_scale 1/sqrt(d)
        return NormalizedLerp(config.n_embd, config.ngpt_alpha_init, config.n_embd**-0.5)
    return ScaledAdd(*combine_coefficients(rule, j, config.n_layer))


# ----------------------------------------------------------------------------- sub-layers


def make_linear(config: GPTConfig, d_in: int, d_out: int) -> nn.Linear:
    if config.gain_cap is not None:
        return GainLinear(d_in, d_out, config.bias, config.gain_cap)
    return nn.Linear(d_in, d_out, bias=config.bias)


def make_qkv_norm(config: GPTConfig, wanted: bool) -> nn.Module:
    """RMSNorm of (B, T, heads, head_dim) queries, keys or values: each head on its own (DNT eq. 10), or
    the heads together with one gain per channel (`qk_norm_span="all"`, OLMo 2's norm of the whole projection)."""
    if not wanted:
        return nn.Identity()
    scheme, head_dim = config.scheme, config.n_embd // config.n_head
    shape = (config.n_head, head_dim) if scheme.qk_norm_span == "all" else head_dim  # one gain per channel
    norm = RMSNorm(shape, eps=config.norm_eps)
    return norm if scheme.norm_affine else without_parameters(norm)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d, self.n_head = config.n_embd, config.n_head
        self.head_dim = d // config.n_head
        # separate q/k/v maps: each is its own matrix for the inits and Muon-style optimizers
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            make_linear(config, d, d) for _ in range(4))
        scheme = config.scheme
        self.q_norm, self.k_norm = (make_qkv_norm(config, scheme.qk_norm) for _ in range(2))
        self.v_norm = make_qkv_norm(config, scheme.v_norm)
        self.scale = softmax_scale(scheme.attn_scale, self.head_dim)
        self.dropout = config.dropout
        self.rope = config.pos == "rope"
        if self.rope:
            register_rope(self, self.head_dim, config.block_size, config.rope_base)
        # <q g_q, k g_k> = <q (g_q g_k), k>: with nothing between the norms and the dot product, the keys'
        # gain rides on the queries and the keys' norm skips its multiply (a RoPE rotation would not commute)
        self.gains_on_queries = scheme.qk_norm and not self.rope

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values, (B, heads, T, head_dim), as the softmax sees them (normed, rotated);
        with `gains_on_queries` the queries carry the keys' gain too, which leaves every logit unchanged."""
        B, T, C = x.shape
        heads = (B, T, self.n_head, self.head_dim)
        q, k = self.q_proj(x).view(heads), self.k_proj(x).view(heads)
        if self.gains_on_queries:
            q = self.q_norm.normalize(q, self.q_norm.weight * self.k_norm.weight)
            k = self.k_norm.normalize(k, None)
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_norm(self.v_proj(x).view(heads)).transpose(1, 2)
        if self.rope:
            q = apply_rope(q, self.rope_cos, self.rope_sin)
            k = apply_rope(k, self.rope_cos, self.rope_sin)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.n_embd
        self.swiglu = config.mlp == "swiglu"
        hidden = mlp_width(d, config.mlp, config.mlp_hidden)
        self.fc = make_linear(config, d, hidden)
        self.gate = make_linear(config, d, hidden) if self.swiglu else None
        self.proj = make_linear(config, hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(F.gelu(self.fc(x)))


def make_attention(config: GPTConfig) -> nn.Module:
    """The block's attention: nGPT's unit-norm attention (ngpt.py) when the row's `hypersphere` is set."""
    if not config.scheme.hypersphere:
        return CausalSelfAttention(config)
    rope_length = config.block_size if config.pos == "rope" else None
    return SphereAttention(config.n_embd, config.n_head, config.bias, config.scheme.qk_norm,
                           config.scheme.attn_scale, config.dropout, rope_length, config.rope_base)


def make_mlp(config: GPTConfig) -> nn.Module:
    """The block's MLP: nGPT's unit-norm MLP (ngpt.py) when the row's `hypersphere` is set."""
    if not config.scheme.hypersphere:
        return MLP(config)
    hidden = mlp_width(config.n_embd, config.mlp, config.mlp_hidden)
    return SphereMLP(config.n_embd, hidden, config.bias, swiglu=config.mlp == "swiglu")


# ----------------------------------------------------------------------------- block


def block_scheme(config: GPTConfig, layer: int) -> Scheme:
    """The row as block `layer` (0-based) uses it: the `first_blocks` rule may place its norms differently.

    "post" (Mix-LN, Li et al.): Post-Norm in the first floor(mixln_fraction * L) blocks, the row's Pre-Norm after
    them, as `post_pre` of the LayerNorm-Scaling code. "pre" (HybridNorm*, Zhuo et al.): block 0 is Pre-Norm on
    both sub-layers and keeps the row's QKV-norm, as the HybridNorm code's `norm_pos_special_config` for block 0.
    """
    scheme = config.scheme
    if scheme.first_blocks == "post" and layer < math.floor(config.mixln_fraction * config.n_layer):
        return scheme._replace(pre_norm="none", post_norm=True, post_norm_at="attn+mlp")
    if scheme.first_blocks == "pre" and layer == 0:
        return scheme._replace(pre_norm="attn+mlp", post_norm=False)
    return scheme


class ResidualUpdate(nn.Module):
    """One residual update j: x <- post_norm(combine(x, mid_norm(s * f(c * pre_norm(x))))), c the pre-norm scale."""

    def __init__(self, config: GPTConfig, sublayer: nn.Module, name: str, j: int, layer: int):
        super().__init__()
        scheme = block_scheme(config, layer)
        alpha = norm_alpha_init(config, name)
        self.pre_norm = maybe_norm(config, scheme.pre_norm in ("attn+mlp", name), alpha)
        # LNS (Sun et al.): the pre-norm output of block l = layer + 1 times 1/sqrt(l)
        self.pre_norm_scale = 1 / math.sqrt(layer + 1) if scheme.pre_norm_scale == "1/sqrt(l)" else 1.0
        self.sublayer = sublayer
        self.branch_scale = scheme.branch_scale
        self.dropout = nn.Dropout(config.dropout)
        self.mid_norm = maybe_norm(config, scheme.mid_norm, alpha)
        self.combine = make_combine(config, j, layer)
        self.post_norm = maybe_norm(config, scheme.post_norm and scheme.post_norm_at in ("attn+mlp", name), alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre_norm(x)
        if self.pre_norm_scale != 1.0:
            h = self.pre_norm_scale * h
        y = self.sublayer(h)
        if self.branch_scale != 1.0:
            y = self.branch_scale * y
        y = self.mid_norm(self.dropout(y))
        return self.post_norm(self.combine(x, y))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.attn = ResidualUpdate(config, make_attention(config), "attn", 2 * layer + 1, layer)
        self.mlp = ResidualUpdate(config, make_mlp(config), "mlp", 2 * layer + 2, layer)
        if config.rezero_gate == "block" and isinstance(self.mlp.combine, ReZeroAdd):
            self.mlp.combine.alpha = self.attn.combine.alpha  # one alpha for the block's two updates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


# ----------------------------------------------------------------------------- GPT


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        scheme = config.scheme
        d = config.n_embd
        embedding = SphereEmbedding if scheme.hypersphere else nn.Embedding
        if config.vector_mode:
            self.wte = nn.Linear(config.in_features, d, bias=False)
        else:
            self.wte = embedding(config.vocab_size, d)
        self.wpe = embedding(config.block_size, d) if config.pos == "learned" else None
        embed_scale = config.norm in ELEMENTWISE_NORMS if config.embed_scale is None else config.embed_scale
        self.embed_scale = ScalarGain(math.sqrt(d)) if embed_scale else nn.Identity()
        self.input_norm = maybe_norm(config, scheme.input_norm)
        self.drop = nn.Dropout(config.dropout)
        # GeoNorm's sqrt_d reading: the stream starts on the sphere of radius sqrt(d) (see GeodesicStep)
        on_sqrt_d_sphere = scheme.combine == "geodesic" and config.geonorm_radius == "sqrt_d"
        self.embed_radius = math.sqrt(d) if on_sqrt_d_sphere else None
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.final_norm = maybe_norm(config, scheme.final_norm, norm_alpha_init(config, "final"))
        if config.vector_mode:
            self.lm_head = nn.Linear(d, config.out_features, bias=False)
        elif scheme.hypersphere:
            self.lm_head = SphereHead(d, config.vocab_size)
        else:
            self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        if scheme.tie_head and not config.vector_mode:
            self.wte.weight = self.lm_head.weight  # weight tying (GPT-2)
        self.apply(self._init_weights)
        for block in self.blocks:
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear):
                    self._init_block_linear(name, module.weight)
        self.apply_parameter_constraints()  # constrained weights start on their sets (nGPT: unit norm)

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
        elif init == "zero_out" and residual_out:  # modded-nanogpt: each residual update starts at zero
            nn.init.zeros_(weight)
        # "normal" (OLMo 2, LNS) keeps N(0, 0.02) everywhere: no 1/sqrt(2L) on the residual projections

    # ---- forward

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            T = idx.shape[1]
            if T > self.config.block_size:
                raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(self.input_norm(self.embed_scale(x)))
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
        """Put constrained parameters back on their sets; train.py calls this after every optimizer step
        (and `__init__` once, so they start there).

        Any sub-module with a `constrain_()` method takes part (a clamped gain, normalized weights);
        for a model without one this is a no-op. It must be deterministic, so that every DDP rank and
        a resumed run make the same change to the same weights.
        """
        for module in self.modules():
            if module is not self and hasattr(module, "constrain_"):
                module.constrain_()

    # ---- utilities

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; position embeddings are left out by default, and so is a token embedding
        that is not tied to the head (a lookup table costs no matmul; a tied one is counted once)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.wpe is not None:
            n -= self.wpe.weight.numel()
        if non_embedding and isinstance(self.wte, nn.Embedding) and self.wte.weight is not self.lm_head.weight:
            n -= self.wte.weight.numel()
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


def forward_with_hooks(model: nn.Module, inputs: torch.Tensor, handles: list) -> None:
    """One forward pass in eval mode for the hooks just registered (`handles`), which are removed after it,
    whatever happens; the model's mode is restored."""
    training = model.training
    model.eval()
    try:
        model(inputs)
    finally:
        model.train(training)
        for h in handles:
            h.remove()


@torch.no_grad()
def max_attention_logits(model: GPT, inputs: torch.Tensor) -> list[float]:
    """Each block's largest attention logit, scale * <q_i, k_j> over heads and causal pairs j <= i, on one
    batch: the logit growth that precedes the attention collapse QK-norm is meant to prevent (Dehghani
    et al. 2023; Wortsman et al. 2023 follow it at small scale). Read from a hook on each attention's input."""
    found: list[torch.Tensor] = []

    def record(attn: nn.Module, args: tuple) -> None:
        q, k, _ = attn.heads(args[0])
        logits = (q.float() @ k.float().transpose(-2, -1)) * attn.scale
        T = logits.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool, device=logits.device).tril()
        found.append(logits.masked_fill(~causal, -math.inf).amax())

    forward_with_hooks(model, inputs, [m.register_forward_pre_hook(record) for m in model.modules()
                                       if isinstance(m, (CausalSelfAttention, SphereAttention))])
    return torch.stack(found).tolist() if found else []


@torch.no_grad()
def block_activation_rms(model: GPT, inputs: torch.Tensor) -> list[float]:
    """RMS of the residual stream after each block (Bir et al. Fig. 3), from one forward pass in eval mode."""
    rms: list[torch.Tensor] = []
    def record(block: nn.Module, args: tuple, out: torch.Tensor) -> None:
        rms.append(out.float().square().mean())

    forward_with_hooks(model, inputs, [b.register_forward_hook(record) for b in model.blocks])
    return torch.stack(rms).sqrt().tolist()


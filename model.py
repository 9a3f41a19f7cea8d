"""
One GPT that holds every normalization scheme as a row of `SCHEMES`. Reading order: the table, the config, the
factories, attention, MLP, the residual update, the block, the GPT; the primitives' math is in layers.py and
nGPT's unit-norm modules in ngpt.py. Every block performs the same four steps for its attention and its MLP:

    y = branch_scale * f(N_pre(x))      # sub-layer on an optionally normalized (LNS: and scaled) input
    y = N_mid(y)                        # optional norm of the sub-layer output
    x = combine(x, y)                   # residual rule: add, scaled add, geodesic step, ReZero gate, nlerp
    x = N_post(x)                       # optional norm after the residual (Post-Norm, DeepNorm)

A new scheme is one row; the papers and the reference code each row was compared with: docs/schemes.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F

import hyper
import layers
from ngpt import NormalizedLerp, SphereAttention, SphereEmbedding, SphereHead, SphereMLP


class Scheme(NamedTuple):
    """One residual scheme: where it normalizes, how it adds each update, how it starts. Every column can be
    overridden by a config key of the same name (`--norms=pre+qk+final`, `--combine=rezero`)."""

    norms: str  # where it normalizes, +-joined: input pre pre_attn pre_mlp qk qk_all qkv mid post post_attn final
    combine: str = "add"  # residual rule: add, pre_alt, deepnorm, convex, geodesic, rezero, rezero_block, nlerp (nGPT)
    attn_scale: str = "1/sqrt(d)"  # logit scale: 1/sqrt(d), 1/d (Lipschitz), sqrt(d) (nGPT), 1.44/sqrt(d) (nanochat)
    branch_scale: float = 1.0  # multiplies each sub-layer's output (1/3 in the Lipschitz block)
    init: str = "gpt2"  # hidden matrices' init: gpt2, xavier, deepnorm, orthogonal, normal, zero_out, nanochat
    pre_norm_scale: str = "1"  # multiplies each pre-norm output: "1", or "1/sqrt(l)" in block l = 1..L (LNS)
    first_blocks: str = "same"  # "post": the first quarter of the blocks Post-Norm (Mix-LN); "pre": block 0 Pre-Norm
    norm_affine: bool = True  # False: no norm has a learnable parameter (modded-nanogpt's parameter-free RMSNorm)
    tie_head: bool = True  # the output head shares the token embedding's weight (GPT-2)
    z_loss: float = 0.0  # PaLM's z-loss weight c: train loss += c mean log(Z)^2; eval lines stay cross-entropy; 0: off
    logit_softcap: float | None = None  # Gemma 2's final-logit cap c: logits <- c tanh(logits / c); None: off
    attn_softcap: float | None = None  # Gemma 2's attention-score cap c before the softmax (explicit attention)
    qk_clip: float | None = None  # QK-Clip's tau (Kimi K2): after each step, W_q, W_k of heads whose logits passed tau
    value_residual: bool = False  # ResFormer: values v <- l v + (1 - l) v_1 (the first block's); l learnable, from 1/2
    x0_mix: bool = False  # before each block x <- a x + b x0 (the embedding), a, b learnable per block (init: 1, 0)
    residual_streams: int = 1  # n copies of the residual stream, joined by hyper_connections (1 and none: off)
    hyper_connections: str = "none"  # learned stream reads and writes: static, dynamic (Zhu et al.), mhc (DeepSeek)

    def normalizes(self, *places: str) -> bool:
        """Whether the row has a norm at any of `places`."""
        return not set(places).isdisjoint(self.norms.split("+"))


# Where a scheme can normalize: the embedding; each sub-layer's input (both, or one); q and k per head (DNT eq. 10),
# over all heads (OLMo 2) or with v (HybridNorm); each sub-layer's output; the stream after each update (or the
# attention's only: HybridNorm); the stream before the head.
NORM_PLACES = ("input", "pre", "pre_attn", "pre_mlp", "qk", "qk_all", "qkv", "mid", "post", "post_attn", "final")

SCHEMES: dict[str, Scheme] = {
    "post": Scheme("post"),
    "pre": Scheme("pre+final"),
    "pre_alt": Scheme("pre+final", combine="pre_alt"),
    "deepnorm": Scheme("post", combine="deepnorm", init="deepnorm"),
    "sandwich": Scheme("pre+mid+final"),
    "geonorm": Scheme("final", combine="geodesic"),
    "dnt": Scheme("input+pre_attn+qk+mid+final", init="xavier"),  # DNT's S5, its default; S1-S4 are App. D's ablations
    "dnt_s1": Scheme("pre+final", init="xavier"),
    "dnt_s2": Scheme("pre+qk+final", init="xavier"),
    "dnt_s3": Scheme("input+pre+qk+final", init="xavier"),
    "dnt_s4": Scheme("input+pre+qk+mid+final", init="xavier"),
    "lipschitz": Scheme("none", combine="convex", attn_scale="1/d", branch_scale=1 / 3, init="orthogonal"),
    "none": Scheme("none", init="orthogonal"),
    "peri": Scheme("input+pre+mid+final"),
    "olmo2": Scheme("qk_all+mid+final", init="normal"),
    "mixln": Scheme("pre+final", first_blocks="post"),
    "lns": Scheme("pre+final", init="normal", pre_norm_scale="1/sqrt(l)"),
    "hybrid": Scheme("qkv+post_attn+final"),
    "rezero": Scheme("none", combine="rezero"),
    "speedrun": Scheme("input+pre+qk+final", init="zero_out", norm_affine=False),
    "ngpt": Scheme("qk", combine="nlerp", attn_scale="sqrt(d)", tie_head=False),
    "nanochat": Scheme("input+pre+qk+final", attn_scale="1.44/sqrt(d)", init="nanochat", norm_affine=False,
                       tie_head=False, logit_softcap=15.0, x0_mix=True),
}

# Row notes; the reference files and lines, and the reason for each choice: docs/schemes.md.
# none: Bir et al. §5.1's norm-free baseline: orthogonal init (N(0, 0.02) would be tamer), no scalings, plain add.
# peri: Peri-LN, x + N(f(N(x))) with the embedding and the output normalized (no code released: the paper's).
# olmo2: x + N(f(x)), q/k normed over all heads, N(0, 0.02); OLMo-core unties the head, does not decay embeddings.
# mixln: keeps pre's 1/sqrt(2L) output init; LayerNorm-Scaling's post_pre: N(0, 0.02) (_init_weights), RMSNorm.
# lns: the intended formula; the released modeling_llama.py lowercases NORM_TYPE (l. 265), then tests =='LNS' (l. 427).
# hybrid: QKV-norm, N(Y) + FFN(N(Y)); its 1.2B yaml: RMSNorm, std sqrt(2/5d) cut at 3σ, decays gains, not embeddings.
# rezero: one alpha per residual update (combine=rezero_block: one per block, as the released rztx.py).
# speedrun: modded-nanogpt record #8 (2024-11-03_UntieEmbed), head tied (it unties, zeroes it); later records differ.
# ngpt: matrices and stream on the unit sphere (only the draw's direction counts); its QK-norm is L2 times s_qk.
# nanochat: gpt.py's block (norm=rmsnorm, mlp=relu2, pos=rope); not its value embeddings, smear, backout, windows.
# norm=dyt/derf, at every place but q/k/v: beta only with bias=True; DyT's LLaMA code decays all; Derf's alpha is 1.

NORM_TYPES = ("layernorm", "rmsnorm", "headwise", "dyt", "derf")
ELEMENTWISE_NORMS = ("dyt", "derf")  # norm replacements without statistics (not scale invariant)
MIXLN_FRACTION = 0.25  # Mix-LN's alpha: the first floor(alpha * L) blocks are Post-Norm (the paper's value)
NGPT_ALPHA_INIT = 0.05  # nGPT's eigen learning rates alpha_A, alpha_M start here (the paper and its code)
CHOICES = {"norm": NORM_TYPES, "mlp": ("gelu", "swiglu", "relu2"), "pos": ("learned", "rope"),  # text keys' values
           "combine": ("add", "pre_alt", "deepnorm", "convex", "geodesic", "rezero", "rezero_block", "nlerp"),
           "attn_scale": ("1/sqrt(d)", "1/d", "sqrt(d)", "1.44/sqrt(d)"), "pre_norm_scale": ("1", "1/sqrt(l)"),
           "init": ("gpt2", "xavier", "deepnorm", "orthogonal", "normal", "zero_out", "nanochat"),
           "hyper_connections": ("none", *hyper.KINDS),
           "first_blocks": ("same", "post", "pre"), "geonorm_decay": ("harmonic", "sqrt", "linear", "none"),
           "geonorm_radius": ("embedding", "sqrt_d")}


@dataclass
class GPTConfig:
    block_size: int = 1024  # the longest sequence the model reads
    n_layer: int = 12  # number of blocks L
    n_head: int = 12  # attention heads
    n_embd: int = 768  # width d of the residual stream
    dropout: float = 0.0  # dropout on the embedding, the attention weights and each sub-layer's output
    bias: bool = True  # biases in the linear maps and norms, like GPT-2
    norm_scheme: str = "pre"  # the residual scheme: a row of SCHEMES; its columns are keys too (--norms=...)
    norm: str = "layernorm"  # the norm at every place the scheme normalizes: layernorm, rmsnorm, headwise, dyt, derf
    norm_eps: float = 1e-5  # the norms' epsilon (q/k/v norms included)
    norm_alpha_init: float | tuple = 0.5  # DyT/Derf's initial alpha; or (attn, mlp, final), DyT's LLM recipe
    embed_scale: bool = False  # a learnable scalar, init sqrt(d), on the embedding (DyT's and Derf's LLM recipes)
    mlp: str = "gelu"  # "gelu" (GPT-2), "swiglu" or "relu2" (relu(x)^2: modded-nanogpt, nanochat)
    mlp_hidden: int | None = None  # the MLP's hidden width; None: 4d for gelu, 8d/3 rounded up to 64 for swiglu
    pos: str = "learned"  # position embedding: "learned" (GPT-2) or "rope" (base 10000)
    gain_cap: float | None = None  # Lipschitz block: a learned diagonal gain on each linear map, clamped to [1e-3, cap]
    geonorm_decay: str = "harmonic"  # GeoNorm's step-size decay over the blocks: harmonic, sqrt, linear, none
    geonorm_clamp: float = math.pi / 4  # GeoNorm (eq. 5): the largest angle theta' one update may turn
    geonorm_radius: str = "embedding"  # GeoNorm's sphere: each token's embedding norm, or "sqrt_d" (see GeodesicStep)
    overrides: dict = field(default_factory=dict)  # the scheme columns this config sets (the keys named like them)
    # set by the task, not by a config
    vocab_size: int = 50304  # the dataset's vocabulary (GPT-2's 50257 padded up to a multiple of 64 for speed)
    in_features: int | None = None  # vector tokens (the least-squares task): features per input token
    out_features: int | None = None  # vector tokens: values per prediction
    embed_fan_in: int | None = None  # vector tokens: non-zero input features per token (Bir et al.: 7)

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def scheme(self) -> Scheme:
        """The scheme's row with this config's overrides applied."""
        return SCHEMES[self.norm_scheme]._replace(**self.overrides)

    @property
    def vector_mode(self) -> bool:
        return self.in_features is not None

    @property
    def hypersphere(self) -> bool:
        """nGPT: unit-norm embeddings, matrices and stream, which its normalized lerp ("nlerp") needs."""
        return self.scheme.combine == "nlerp"


def check_config(c: GPTConfig) -> None:
    """Reject impossible settings with a message that names the key and the valid values."""
    unknown = set(c.overrides) - set(Scheme._fields)
    if unknown:
        raise ValueError(f"unknown scheme column(s) {', '.join(sorted(unknown))}; columns: {', '.join(Scheme._fields)}")
    choices = {**CHOICES, "norm_scheme": tuple(SCHEMES)}  # rows appended after this module's table count too
    values = {**{k: getattr(c, k) for k in choices if hasattr(c, k)}, **c.overrides}
    for key, value in values.items():
        if key in choices and value not in choices[key]:
            raise ValueError(f"{key}={value!r} is not valid; choose one of: {', '.join(choices[key])}")
    places = c.scheme.norms.split("+")
    if c.scheme.norms != "none" and not set(places) <= set(NORM_PLACES):
        raise ValueError(f"norms={c.scheme.norms!r} is not valid: give places from {', '.join(NORM_PLACES)} "
                         "joined by '+' (e.g. pre+qk+final), or 'none'")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "mlp_hidden", "embed_fan_in"):
        if getattr(c, key) is not None and getattr(c, key) < 1:
            raise ValueError(f"{key}={getattr(c, key)} must be at least 1")
    alphas = c.norm_alpha_init if isinstance(c.norm_alpha_init, tuple) else (c.norm_alpha_init,)
    if len(alphas) not in (1, 3) or not all(isinstance(a, (int, float)) and a > 0 for a in alphas):
        raise ValueError(f"norm_alpha_init={c.norm_alpha_init!r} must be a positive number or three of them "
                         "(attn, mlp, final)")
    if not c.scheme.branch_scale > 0:
        raise ValueError(f"branch_scale={c.scheme.branch_scale} must be positive (it multiplies each sub-layer output)")
    if c.n_embd % c.n_head != 0:
        raise ValueError(f"n_embd={c.n_embd} must be divisible by n_head={c.n_head}")
    if c.pos == "rope" and (c.n_embd // c.n_head) % 2 != 0:
        raise ValueError(f"pos='rope' needs an even head size, got {c.n_embd // c.n_head}")
    if (c.in_features is None) != (c.out_features is None):
        raise ValueError("vector mode needs both in_features and out_features (or neither)")
    if not 0 < c.geonorm_clamp <= math.pi:
        raise ValueError(f"geonorm_clamp={c.geonorm_clamp} must lie in (0, pi]")
    if c.gain_cap is not None and c.gain_cap <= 1e-3:
        raise ValueError(f"gain_cap={c.gain_cap} must exceed the gain floor 1e-3")
    if c.hypersphere and (c.vector_mode or c.gain_cap is not None):
        raise ValueError("combine='nlerp' (nGPT) keeps unit-norm embeddings looked up by id and unit-norm matrices: "
                         "it takes neither vector inputs (in_features) nor gain_cap")
    check_stream_columns(c.scheme, c.hypersphere)


def check_stream_columns(s: Scheme, hypersphere: bool) -> None:
    """The columns taken from other codebases: z-loss, softcaps, QK-Clip, value residual, x0 mix, hyper-connections."""
    for key, bad, need in [(k, getattr(s, k) is not None and not getattr(s, k) > 0, "positive, or None (off)")
                           for k in ("logit_softcap", "attn_softcap", "qk_clip")] + [
            ("z_loss", not 0 <= s.z_loss < math.inf, "a finite weight >= 0 (0: off)"),
            ("residual_streams", s.residual_streams < 1, ">= 1 (1: one stream, off)")]:
        if bad:
            raise ValueError(f"{key}={getattr(s, key)} must be {need}")
    hyper_on = s.hyper_connections != "none"
    if s.residual_streams > 1 and not hyper_on:
        raise ValueError(f"residual_streams={s.residual_streams} needs hyper_connections (static, dynamic or mhc)")
    if hyper_on and (s.combine != "add" or s.normalizes("post", "post_attn") or s.first_blocks == "post"):
        raise ValueError("hyper_connections replace the residual add: give them a row with combine='add' and no post "
                         "norm (as pre, peri, sandwich, dnt, lns)")
    if s.qk_clip is not None and s.normalizes("qk", "qk_all", "qkv"):
        raise ValueError("qk_clip rescales W_q and W_k, which a q/k norm undoes: give it a row without qk norms")
    if hypersphere and (hyper_on or s.attn_softcap or s.qk_clip or s.value_residual or s.x0_mix):
        raise ValueError("combine='nlerp' (nGPT) keeps its stream and attention on the sphere: it takes none of "
                         "hyper_connections, attn_softcap, qk_clip, value_residual, x0_mix")


# ----------------------------------------------------------------------------- norms


def maybe_norm(config: GPTConfig, wanted: bool, alpha_init: float | None = None) -> nn.Module:
    """The norm named by `config.norm` where `wanted` (alpha_init: DyT/Derf's alpha here; None: the MLP's)."""
    if not wanted:
        return nn.Identity()
    alpha = norm_alpha_init(config, "mlp") if alpha_init is None else alpha_init
    norm = layers.make_norm(config.norm, config.n_embd, config.n_head, config.norm_eps, config.bias, alpha)
    return norm if config.scheme.norm_affine else layers.without_parameters(norm)


def norm_alpha_init(config: GPTConfig, place: str) -> float:
    """DyT/Derf's initial alpha at a place: "attn", "mlp" or "final" (per-place values of DyT's LLM recipe)."""
    if isinstance(config.norm_alpha_init, tuple):
        return config.norm_alpha_init[("attn", "mlp", "final").index(place)]
    return config.norm_alpha_init


# ----------------------------------------------------------------------------- combine rules


def make_combine(config: GPTConfig, j: int, layer: int) -> nn.Module:
    rule = config.scheme.combine
    if rule == "geodesic":
        decay = layers.geonorm_decay(config.geonorm_decay, layer, config.n_layer)
        return layers.GeodesicStep(decay, config.geonorm_clamp)
    if rule in ("rezero", "rezero_block"):
        return layers.ReZeroAdd()
    if rule == "nlerp":  # nGPT §2.6: alpha_init 0.05, alpha_scale 1/sqrt(d)
        return NormalizedLerp(config.n_embd, NGPT_ALPHA_INIT, config.n_embd**-0.5)
    return layers.ScaledAdd(*layers.combine_coefficients(rule, j, config.n_layer))


# ----------------------------------------------------------------------------- sub-layers


def make_linear(config: GPTConfig, d_in: int, d_out: int) -> nn.Linear:
    if config.gain_cap is not None:
        return layers.GainLinear(d_in, d_out, config.bias, config.gain_cap)
    return nn.Linear(d_in, d_out, bias=config.bias)


def make_qkv_norm(config: GPTConfig, wanted: bool) -> nn.Module:
    """RMSNorm of (B, T, heads, head_dim) queries, keys or values: each head on its own (DNT eq. 10), or
    the heads together with one gain per channel ("qk_all", OLMo 2's norm of the whole projection)."""
    if not wanted:
        return nn.Identity()
    scheme, head_dim = config.scheme, config.n_embd // config.n_head
    shape = (config.n_head, head_dim) if scheme.normalizes("qk_all") else head_dim  # one gain per channel
    norm = layers.RMSNorm(shape, eps=config.norm_eps)
    return norm if scheme.norm_affine else layers.without_parameters(norm)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        d, self.n_head = config.n_embd, config.n_head
        self.head_dim = d // config.n_head
        # separate q/k/v maps: each is its own matrix for the inits and Muon-style optimizers
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (make_linear(config, d, d) for _ in range(4))
        scheme = config.scheme
        qk_norm = scheme.normalizes("qk", "qk_all", "qkv")
        self.q_norm, self.k_norm = (make_qkv_norm(config, qk_norm) for _ in range(2))
        self.v_norm = make_qkv_norm(config, scheme.normalizes("qkv"))
        self.scale = layers.softmax_scale(scheme.attn_scale, self.head_dim)
        clip = None if scheme.qk_clip is None else layers.QKClip(scheme.qk_clip, self.n_head, self.q_proj, self.k_proj)
        self.attend = layers.Attention(self.scale, config.dropout, scheme.attn_softcap, clip)
        self.value_residual = layers.ValueResidual(layer == 0) if scheme.value_residual else None
        self.rope = config.pos == "rope"
        if self.rope:
            layers.register_rope(self, self.head_dim, config.block_size, 10000.0)
        # <q g_q, k g_k> = <q (g_q g_k), k>: with nothing between the norms and the dot product, the keys'
        # gain rides on the queries and the keys' norm skips its multiply (a RoPE rotation would not commute)
        self.gains_on_queries = qk_norm and not self.rope

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
            q = layers.apply_rope(q, self.rope_cos, self.rope_sin)
            k = layers.apply_rope(k, self.rope_cos, self.rope_sin)
        return q, k, v

    def forward(self, x: torch.Tensor, ctx: dict | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x)
        if self.value_residual is not None:  # ResFormer: the first block's values ride in ctx
            v = self.value_residual(v, ctx)
        return self.out_proj(self.attend(q, k, v).transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.n_embd
        self.swiglu = config.mlp == "swiglu"
        self.act = layers.ACTIVATIONS.get(config.mlp)
        hidden = layers.mlp_width(d, config.mlp, config.mlp_hidden)
        self.fc = make_linear(config, d, hidden)
        self.gate = make_linear(config, d, hidden) if self.swiglu else None
        self.proj = make_linear(config, hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(self.act(self.fc(x)))


def make_sublayers(config: GPTConfig, layer: int) -> tuple[nn.Module, nn.Module]:
    """Block `layer`'s attention and MLP: nGPT's unit-norm ones (ngpt.py) on the hypersphere (combine "nlerp")."""
    if not config.hypersphere:
        return CausalSelfAttention(config, layer), MLP(config)
    rope_length = config.block_size if config.pos == "rope" else None
    hidden = layers.mlp_width(config.n_embd, config.mlp, config.mlp_hidden)
    return (SphereAttention(config.n_embd, config.n_head, config.bias, config.scheme.normalizes("qk", "qk_all", "qkv"),
                            config.scheme.attn_scale, config.dropout, rope_length),
            SphereMLP(config.n_embd, hidden, config.bias, config.mlp == "swiglu", layers.ACTIVATIONS.get(config.mlp)))


# ----------------------------------------------------------------------------- block


def block_scheme(config: GPTConfig, layer: int) -> Scheme:
    """The row as block `layer` (0-based) uses it. first_blocks="post" (Mix-LN, Li et al.): Post-Norm in the first
    floor(MIXLN_FRACTION * L) blocks, as LayerNorm-Scaling's `post_pre`; "pre" (HybridNorm*, Zhuo et al.): block 0
    Pre-Norm on both sub-layers with the row's QKV-norm, as HybridNorm's `norm_pos_special_config`."""
    scheme = config.scheme
    if scheme.first_blocks == "post" and layer < math.floor(MIXLN_FRACTION * config.n_layer):
        return with_norms(scheme, drop=("pre", "pre_attn", "pre_mlp", "post_attn"), add="post")
    if scheme.first_blocks == "pre" and layer == 0:
        return with_norms(scheme, drop=("post", "post_attn"), add="pre")
    return scheme


def with_norms(scheme: Scheme, drop: tuple[str, ...], add: str) -> Scheme:
    places = [p for p in scheme.norms.split("+") if p not in (*drop, "none")]
    return scheme._replace(norms="+".join([add, *places]))


class ResidualUpdate(nn.Module):
    """One residual update j: x <- post_norm(combine(x, mid_norm(s * f(c * pre_norm(x))))), c the pre-norm scale."""

    def __init__(self, config: GPTConfig, sublayer: nn.Module, name: str, j: int, layer: int):
        super().__init__()
        scheme = block_scheme(config, layer)
        alpha = norm_alpha_init(config, name)
        self.pre_norm = maybe_norm(config, scheme.normalizes("pre", f"pre_{name}"), alpha)
        # LNS (Sun et al.): the pre-norm output of block l = layer + 1 times 1/sqrt(l)
        self.pre_norm_scale = 1 / math.sqrt(layer + 1) if scheme.pre_norm_scale == "1/sqrt(l)" else 1.0
        self.sublayer = sublayer
        self.branch_scale = scheme.branch_scale
        self.dropout = nn.Dropout(config.dropout)
        self.mid_norm = maybe_norm(config, scheme.normalizes("mid"), alpha)
        self.combine = make_combine(config, j, layer)
        self.post_norm = maybe_norm(config, scheme.normalizes("post", f"post_{name}"), alpha)
        self.takes_ctx = isinstance(sublayer, CausalSelfAttention)
        n, kind = scheme.residual_streams, scheme.hyper_connections  # hyper-connections replace combine (an add)
        self.hyper = None if kind == "none" else hyper.HyperConnection(kind, n, config.n_embd, j - 1, config.norm_eps)

    def branch(self, x: torch.Tensor, ctx: dict | None = None) -> torch.Tensor:
        h = self.pre_norm(x)
        if self.pre_norm_scale != 1.0:
            h = self.pre_norm_scale * h
        y = self.sublayer(h, ctx) if self.takes_ctx else self.sublayer(h)
        if self.branch_scale != 1.0:
            y = self.branch_scale * y
        return self.mid_norm(self.dropout(y))

    def forward(self, x: torch.Tensor, ctx: dict | None = None) -> torch.Tensor:
        if self.hyper is not None:  # x: the streams (B, T, n, d)
            return self.hyper(x, self.branch, ctx)
        return self.post_norm(self.combine(x, self.branch(x, ctx)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        attn, mlp = make_sublayers(config, layer)
        self.attn = ResidualUpdate(config, attn, "attn", 2 * layer + 1, layer)
        self.mlp = ResidualUpdate(config, mlp, "mlp", 2 * layer + 2, layer)
        if config.scheme.combine == "rezero_block":
            self.mlp.combine.alpha = self.attn.combine.alpha  # one alpha for the block's two updates
        self.x0_mix = layers.X0Mix(config.scheme.init, layer, config.n_layer) if config.scheme.x0_mix else None

    def forward(self, x: torch.Tensor, ctx: dict | None = None) -> torch.Tensor:
        if self.x0_mix is not None:
            x = self.x0_mix(x, ctx["x0"])
        return self.mlp(self.attn(x, ctx), ctx)


# ----------------------------------------------------------------------------- GPT


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        scheme = config.scheme
        d = config.n_embd
        embedding = SphereEmbedding if config.hypersphere else nn.Embedding
        vector = config.vector_mode
        self.wte = nn.Linear(config.in_features, d, bias=False) if vector else embedding(config.vocab_size, d)
        self.wpe = embedding(config.block_size, d) if config.pos == "learned" else None
        self.embed_scale = layers.ScalarGain(math.sqrt(d)) if config.embed_scale else nn.Identity()
        self.input_norm = maybe_norm(config, scheme.normalizes("input"))
        self.drop = nn.Dropout(config.dropout)
        # GeoNorm's sqrt_d reading: the stream starts on the sphere of radius sqrt(d) (see GeodesicStep)
        on_sqrt_d_sphere = scheme.combine == "geodesic" and config.geonorm_radius == "sqrt_d"
        self.embed_radius = math.sqrt(d) if on_sqrt_d_sphere else None
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.final_norm = maybe_norm(config, scheme.normalizes("final"), norm_alpha_init(config, "final"))
        out = config.out_features if vector else config.vocab_size
        self.lm_head = SphereHead(d, out) if config.hypersphere else nn.Linear(d, out, bias=False)
        if scheme.tie_head and not vector:
            self.wte.weight = self.lm_head.weight  # weight tying (GPT-2)
        self.streams = scheme.residual_streams if scheme.hyper_connections != "none" else None
        self.logit_softcap, self.z_loss = scheme.logit_softcap, scheme.z_loss
        self.apply(self._init_weights)
        for block in self.blocks:
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear):
                    layers.init_block_matrix(scheme.init, name, module.weight, config.n_layer)
        if scheme.init == "nanochat" and not vector:  # nanochat gpt.py init_weights
            nn.init.normal_(self.wte.weight, std=0.8)
            nn.init.normal_(self.lm_head.weight, std=0.001)
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
        x = self.embed(idx) if self.streams is None else hyper.expand(self.embed(idx), self.streams)
        ctx = {"x0": x}  # shared by the blocks: the x0 mix's x0, the value residual's v1
        for block in self.blocks:
            x = block(x, ctx)
        x = self.final_norm(x if self.streams is None else hyper.reduce(x))
        if self.config.vector_mode:
            return self.lm_head(x), None
        logits = self.lm_head(x if targets is not None else x[:, [-1], :])
        if self.logit_softcap is not None:
            logits = layers.softcap(logits, self.logit_softcap)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        if self.z_loss and self.training:  # the objective only: evaluations report the cross-entropy
            loss = loss + self.z_loss * layers.z_loss(logits, targets)
        return logits, loss

    # ---- constraints applied after every optimizer step

    @torch.no_grad()
    def apply_parameter_constraints(self) -> None:
        """Put constrained parameters (any sub-module's `constrain_()`: a clamped gain, unit-norm weights) back
        on their sets, after every optimizer step and once at init; deterministic, so every rank agrees."""
        for module in self.modules():
            if module is not self and hasattr(module, "constrain_"):
                module.constrain_()

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without position embeddings and an untied token embedding (lookups)."""
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

"""
One GPT that holds every normalization scheme as a row of `SCHEMES`, in nanoGPT's reading order: the table and
the config; the norm types; the residual rules; attention and the MLP; nGPT's hypersphere modules; the block;
the GPT. Every block performs the same four steps for its attention and its MLP:

    y = branch_scale * f(N_pre(x))      # sub-layer on an optionally normalized (LNS: and scaled) input
    y = N_mid(y)                        # optional norm of the sub-layer output
    x = combine(x, y)                   # residual rule: add, scaled add, geodesic step, ReZero gate, nlerp
    x = N_post(x)                       # optional norm after the residual (Post-Norm, DeepNorm)

Each primitive is the plain PyTorch of its equation; `torch.compile` fuses them. A new scheme is one row; the
columns taken from other codebases (z-loss to Attention Residuals) are in nanonorm/columns.py. The papers'
readings and the reference code each row was compared with: docs/schemes.md. `python model.py` prints the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanonorm import columns


class Scheme(NamedTuple):
    """A row: where a model normalizes, how each residual update is added, how it starts, and the stabilizers some
    recipes come with (nanonorm/columns.py: z-loss to the attention gate). Every column can be overridden by a config
    key of the same name (`--norms=pre+qk+final`, `--combine=rezero`)."""

    norms: str  # the places it normalizes (not the type: that is `norm`), +-joined from NORM_PLACES, or "none"
    combine: str = "add"  # residual rule, a key of COMBINE_RULES; "nlerp": nGPT's; "attn_res": Attention Residuals
    attn_scale: str = "1/sqrt(d)"  # logit scale: 1/sqrt(d), 1/d (Lipschitz), sqrt(d) (nGPT), 1.44/sqrt(d) (nanochat)
    branch_scale: float = 1.0  # multiplies each sub-layer's output (1/3 in the Lipschitz block)
    init: str = "gpt2"  # hidden matrices' init, a key of INITS
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
    attn_gate: str = "none"  # Qiu et al.'s sigmoid gate on each head's output (G1): headwise, elementwise; none
    attn_sink: bool = False  # gpt-oss's learned sink: one logit per head joins the softmax's normalization (init 0)

    def normalizes(self, *places: str) -> bool:
        """Whether the row has a norm at any of `places`."""
        return not set(places).isdisjoint(self.norms.split("+"))


# Where a scheme can normalize: the embedding; each sub-layer's input (both, or one); q and k per head (DNT eq. 10),
# over all heads (OLMo 2) or with v (HybridNorm); k alone, v alone (per head); each sub-layer's output; the stream
# after each update (or the attention's only: HybridNorm); the stream before the head.
NORM_PLACES = ("input", "pre", "pre_attn", "pre_mlp", "qk", "qk_all", "qkv", "k", "v", "mid", "post", "post_attn",
               "final")

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
# peri: Peri-LN, x + N(f(N(x))) with the embedding and the output normalized.
# olmo2: x + N(f(x)), q/k normed over all heads, N(0, 0.02); OLMo-core unties the head, does not decay embeddings.
# mixln: keeps pre's 1/sqrt(2L) output init; LayerNorm-Scaling's post_pre: N(0, 0.02) (_init_weights), RMSNorm.
# lns: the intended formula; the released modeling_llama.py lowercases NORM_TYPE (l. 265), then tests =='LNS' (l. 427).
# hybrid: QKV-norm, N(Y) + FFN(N(Y)); its 1.2B yaml: RMSNorm, std sqrt(2/5d) cut at 3σ, decays gains, not embeddings.
# rezero: one alpha per residual update (combine=rezero_block: one per block, as the released rztx.py).
# speedrun: modded-nanogpt record #8 (2024-11-03_UntieEmbed), head tied (it unties, zeroes it); later records differ.
# ngpt: matrices and stream on the unit sphere (only the draw's direction counts); its QK-norm is L2 times s_qk.
# nanochat: gpt.py's block (norm=rmsnorm, mlp=relu2, pos=rope); not its value embeddings, smear, backout, windows.
# norm=dyt/derf, at every place but q/k/v: beta only with bias=True; DyT's LLaMA code decays all; Derf's alpha is 1.

ELEMENTWISE_NORMS = ("dyt", "derf")  # norm replacements without statistics (not scale invariant)
MIXLN_FRACTION = 0.25  # Mix-LN's alpha: the first floor(alpha * L) blocks are Post-Norm (the paper's value)
NGPT_ALPHA_INIT = 0.05  # nGPT's eigen learning rates alpha_A, alpha_M start here (the paper and its code)


@dataclass
class GPTConfig:
    block_size: int = 1024  # the longest sequence the model reads
    n_layer: int = 12  # number of blocks L
    n_head: int = 12  # attention heads
    n_embd: int = 768  # width d of the residual stream
    dropout: float = 0.0  # dropout on the embedding, the attention weights and each sub-layer's output
    bias: bool = True  # biases in the linear maps and norms, like GPT-2
    norm_scheme: str = "pre"  # the row of SCHEMES (the recipe); its columns are keys too (--norms=...)
    norm: str = "layernorm"  # the norm type (not the places: those are `norms`), a key of NORM_TYPES
    norm_eps: float = 1e-5  # the norms' epsilon (q/k/v norms included)
    norm_alpha_init: float | tuple = 0.5  # DyT/Derf's initial alpha; or (attn, mlp, final), DyT's LLM recipe
    embed_scale: bool = False  # a learnable scalar, init sqrt(d), on the embedding (DyT's and Derf's LLM recipes)
    embed_proj: bool = False  # OSP's EmbProj: learnable d x d maps after the token embedding and before the head
    mlp: str = "gelu"  # "gelu" (GPT-2), "swiglu" or "relu2" (relu(x)^2: modded-nanogpt, nanochat)
    mlp_hidden: int | None = None  # the MLP's hidden width; None: 4d for gelu, 8d/3 rounded up to 64 for swiglu
    pos: str = "learned"  # position embedding: "learned" (GPT-2) or "rope" (base 10000)
    gain_cap: float | None = None  # Lipschitz block: a learned diagonal gain on each linear map, clamped to [1e-3, cap]
    geonorm_decay: str = "harmonic"  # GeoNorm's step-size decay over the blocks: harmonic, sqrt, linear, none
    geonorm_clamp: float = math.pi / 4  # GeoNorm (eq. 5): the largest angle theta' one update may turn
    geonorm_radius: str = "embedding"  # GeoNorm's sphere: each token's embedding norm, or "sqrt_d" (docs/schemes.md)
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


def choices() -> dict[str, tuple]:
    """The valid values of each text key: the registries' names, and the rows of SCHEMES (appended ones too)."""
    return {"norm_scheme": tuple(SCHEMES), "norm": tuple(NORM_TYPES), "combine": tuple(COMBINE_RULES),
            "init": tuple(INITS), "mlp": ("gelu", "swiglu", "relu2"), "pos": ("learned", "rope"),
            "attn_scale": tuple(ATTN_SCALES), "pre_norm_scale": ("1", "1/sqrt(l)"),
            "hyper_connections": ("none", *columns.KINDS), "first_blocks": ("same", "post", "pre"),
            "attn_gate": ("none", *columns.GATE_KINDS),
            "geonorm_decay": ("harmonic", "sqrt", "linear", "none"), "geonorm_radius": ("embedding", "sqrt_d")}


def check_config(c: GPTConfig) -> None:
    """Reject impossible settings with a message that names the key and the valid values."""
    unknown = set(c.overrides) - set(Scheme._fields)
    if unknown:
        raise ValueError(f"unknown scheme column(s) {', '.join(sorted(unknown))}; columns: {', '.join(Scheme._fields)}")
    valid = choices()
    values = {**{k: getattr(c, k) for k in valid if hasattr(c, k)}, **c.overrides}
    for key, value in values.items():
        if key in valid and value not in valid[key]:
            raise ValueError(f"{key}={value!r} is not valid; choose one of: {', '.join(valid[key])}")
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
    if c.hypersphere and (c.vector_mode or c.gain_cap is not None or c.embed_proj):
        raise ValueError("combine='nlerp' (nGPT) keeps unit-norm embeddings looked up by id and unit-norm matrices: "
                         "it takes neither vector inputs (in_features) nor gain_cap nor embed_proj")
    columns.check_columns(c.scheme, c.hypersphere)


# ----------------------------------------------------------------------------- norm types


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019, eq. 4) over the last dim: x / sqrt(mean(x^2) + eps) * weight; None: no
    gain. The mean is taken in float32 at least (a bf16 x under autocast); the output has x's dtype."""
    mean_square = x.to(torch.promote_types(x.dtype, torch.float32)).square().mean(-1, keepdim=True)
    out = x * torch.rsqrt(mean_square + eps).to(x.dtype)
    return out if weight is None else out * weight.to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm (same parameters and state dict), computed by `rms_norm`; over several trailing dims
    (OLMo 2's q/k norm over all heads) the same math on their flattening."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        dims = len(self.normalized_shape)
        if dims == 1:
            return rms_norm(x, self.weight, eps)
        weight = None if self.weight is None else self.weight.flatten()
        return rms_norm(x.flatten(-dims), weight, eps).view(x.shape)


class SingleScaleRMSNorm(nn.Module):
    """SSNorm (Outlier-Safe Pre-Training, Park et al., arXiv 2506.19697): RMSNorm with one learnable gain shared by
    every channel (init 1) in place of one per channel, so that no channel can be scaled up on its own."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class HeadwiseRMSNorm(nn.Module):
    """The anisotropic, head-aligned LayerNorm of the geometric account of LN/MHA/FFN, as we read it (it gives no
    code): RMS-normalize each of the n_head contiguous groups of channels on its own, then one gain per channel."""

    def __init__(self, dim: int, n_head: int, eps: float = 1e-5):
        super().__init__()
        self.n_head, self.eps = n_head, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.unflatten(-1, (self.n_head, -1))
        return rms_norm(groups, self.weight.view(self.n_head, -1), self.eps).flatten(-2)


class DynamicTanh(nn.Module):
    """DyT (Zhu et al., 2025, eq. 1) in place of a norm: gamma * tanh(alpha * x) + beta, elementwise, alpha one
    learnable scalar, gamma and beta one per channel; beta exists when `bias` is set (the DyT LLaMA code has none)."""

    def __init__(self, dim: int, alpha_init: float, bias: bool):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(alpha_init))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def squash(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight * self.squash(x)
        return out if self.bias is None else out + self.bias


class DynamicErf(DynamicTanh):
    """Derf (Chen et al., 2025): gamma * erf(alpha * x + s) + beta; DyT's parameters and a learnable shift s (init 0)
    """

    def __init__(self, dim: int, alpha_init: float, bias: bool):
        super().__init__(dim, alpha_init, bias)
        self.shift = nn.Parameter(torch.tensor(0.0))

    def squash(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erf(self.alpha * x + self.shift)


# One registry of norm types: name -> (dim, n_head, eps, bias, alpha_init) -> module
NORM_TYPES: dict[str, Callable[..., nn.Module]] = {
    "layernorm": lambda dim, n_head, eps, bias, alpha: nn.LayerNorm(dim, eps=eps, bias=bias),
    "rmsnorm": lambda dim, n_head, eps, bias, alpha: RMSNorm(dim, eps=eps),
    "headwise": lambda dim, n_head, eps, bias, alpha: HeadwiseRMSNorm(dim, n_head, eps=eps),
    "ssnorm": lambda dim, n_head, eps, bias, alpha: SingleScaleRMSNorm(eps),
    "dyt": lambda dim, n_head, eps, bias, alpha: DynamicTanh(dim, alpha, bias),
    "derf": lambda dim, n_head, eps, bias, alpha: DynamicErf(dim, alpha, bias),
}


def make_norm(kind: str, dim: int, n_head: int, eps: float, bias: bool, alpha_init: float) -> nn.Module:
    """The norm of type `kind` over `dim` channels; alpha_init: DyT's and Derf's alpha."""
    if kind not in NORM_TYPES:
        raise ValueError(f"norm={kind!r} is not a norm type; choose one of: {', '.join(NORM_TYPES)}")
    return NORM_TYPES[kind](dim, n_head, eps, bias, alpha_init)


def without_parameters(norm: nn.Module) -> nn.Module:
    """The same norm with each of its parameters turned into a constant at its initial value (gain 1, bias 0)."""
    for name, p in list(norm.named_parameters(recurse=False)):
        delattr(norm, name)
        norm.register_buffer(name, p.detach(), persistent=False)
    return norm


def maybe_norm(config: GPTConfig, wanted: bool, alpha_init: float | None = None) -> nn.Module:
    """The norm named by `config.norm` where `wanted` (alpha_init: DyT/Derf's alpha here; None: the MLP's)."""
    if not wanted:
        return nn.Identity()
    alpha = norm_alpha_init(config, "mlp") if alpha_init is None else alpha_init
    norm = make_norm(config.norm, config.n_embd, config.n_head, config.norm_eps, config.bias, alpha)
    return norm if config.scheme.norm_affine else without_parameters(norm)


def norm_alpha_init(config: GPTConfig, place: str) -> float:
    """DyT/Derf's initial alpha at a place: "attn", "mlp" or "final" (per-place values of DyT's LLM recipe)."""
    if isinstance(config.norm_alpha_init, tuple):
        return config.norm_alpha_init[("attn", "mlp", "final").index(place)]
    return config.norm_alpha_init


def make_qkv_norm(config: GPTConfig, wanted: bool, over_heads: bool) -> nn.Module:
    """RMSNorm of (B, T, heads, head_dim) queries, keys or values: each head on its own (DNT eq. 10), or
    the heads together with one gain per channel (over_heads: "qk_all", OLMo 2's norm of the whole projection)."""
    if not wanted:
        return nn.Identity()
    scheme, head_dim = config.scheme, config.n_embd // config.n_head
    shape = (config.n_head, head_dim) if over_heads else head_dim  # one gain per channel
    norm = RMSNorm(shape, eps=config.norm_eps)
    return norm if scheme.norm_affine else without_parameters(norm)


# ----------------------------------------------------------------------------- residual rules


class ScaledAdd(nn.Module):
    """x <- alpha * x + beta * y with constants fixed at construction."""

    def __init__(self, alpha: float, beta: float):
        super().__init__()
        self.alpha, self.beta, self.plain = alpha, beta, alpha == 1.0 and beta == 1.0
        # the forward reads the constants from a buffer, not these floats: a compiled block guards on a float it
        # reads, so blocks with other constants (pre_alt's differ per update) would each compile anew
        self.register_buffer("coefficients", torch.tensor([alpha, beta], dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return x + y
        alpha, beta = self.coefficients
        return torch.addcmul(x * alpha, beta, y)  # two passes over the stream, not three

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:.4g}, beta={self.beta:.4g}"


def combine_coefficients(rule: str, j: int, n_layer: int) -> tuple[float, float]:
    """(alpha, beta) of the residual update x <- alpha * x + beta * y for residual update j in 1..2L (attention of
    block l is 2l+1, its MLP 2l+2)."""
    if rule == "add":
        return 1.0, 1.0
    if rule == "pre_alt":  # GeoNorm App. B eq. 13: x_j / sqrt(j+1) of the Pre-Norm stream
        return math.sqrt(j / (j + 1)), 1.0 / math.sqrt(j + 1)
    if rule == "deepnorm":  # DeepNet: alpha = (2L)^(1/4) for a decoder-only model
        return (2 * n_layer) ** 0.25, 1.0
    if rule == "convex":  # Bir et al. §4.3: x <- (L-1)/L x + block(x)/L
        return (n_layer - 1) / n_layer, 1.0 / n_layer
    raise ValueError(f"combine={rule!r} has no linear coefficients")


class ScalarGain(nn.Module):
    """x -> g * x, g one learnable scalar: ReZero's residual gate (init 0), DyT's embedding scale (init sqrt(d))."""

    def __init__(self, init: float):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * x


class ReZeroAdd(nn.Module):
    """ReZero (Bachlechner et al., eq. 1): x <- x + alpha * y, alpha learnable and 0 at init. `combine="rezero"`
    gives each residual update its own alpha; "rezero_block" shares one per block, as the released rztx.py."""

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


def geodesic_angle(x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor, decay: float | torch.Tensor,
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


def geodesic_step(x: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor, decay: float | torch.Tensor,
                  clamp: float, lowest: float = -math.inf) -> torch.Tensor:
    """GeoNorm eq. 5: x moved along the sphere of radius ||x|| toward s, by the angle of `geodesic_angle`."""
    theta, radius, v, v_norm = geodesic_angle(x, s, a, b, decay, clamp, lowest)
    x = x.to(v.dtype)
    return torch.cos(theta) * x + radius * torch.sin(theta) * v / v_norm  # eq. 3: exp_x(v), ||out|| = ||x||


class GeodesicStep(nn.Module):
    """GeoNorm's residual update (eq. 5): move x along the sphere of radius ||x|| toward the sub-layer output s,
    by an angle that is clamped and decays with depth:

        v      = s - (<x,s> / ||x||^2) x              tangent component of s at x
        theta  = min(||v|| / ||x||, c)
        theta' = min((a * theta + b) * decay(l), c)           a, b learnable (init 1, 0)
        x_new  = cos(theta') x + ||x|| sin(theta') v / ||v||  so ||x_new|| = ||x||

    The paper clamps theta' from above only (App. D), the default `sides="upper"`; `sides="both"` (an option of
    this project) clamps to [-c, c]. Where the sphere lies (`geonorm_radius`) and the App. D listing's bugs, which
    this does not copy: docs/schemes.md. `affine=False` fixes a, b at 1, 0 (what the listing computes)."""

    def __init__(self, decay: float, clamp: float, affine: bool = True, sides: str = "upper"):
        super().__init__()
        self.decay, self.clamp, self.sides = decay, clamp, sides
        # read by the forward in place of the float, as ScaledAdd's coefficients: blocks of other depths share code
        self.register_buffer("decay_factor", torch.tensor(decay, dtype=torch.float64), persistent=False)
        self.lowest = -clamp if sides == "both" else -math.inf
        if affine:
            self.a = nn.Parameter(torch.tensor(1.0))
            self.b = nn.Parameter(torch.tensor(0.0))
        else:  # fixed at the identity map theta' = theta * decay
            self.register_buffer("a", torch.tensor(1.0))
            self.register_buffer("b", torch.tensor(0.0))

    def angle(self, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The applied angle theta', the radius ||x||, the tangent v and ||v|| (per token)."""
        return geodesic_angle(x, s, self.a, self.b, self.decay_factor, self.clamp, self.lowest)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return geodesic_step(x, s, self.a, self.b, self.decay_factor, self.clamp, self.lowest)

    def extra_repr(self) -> str:
        return f"decay={self.decay:.4g}, clamp={self.clamp:.4g}, sides={self.sides}"


# One registry of residual rules: name -> (config, j, layer) -> module; j in 1..2L counts residual updates
COMBINE_RULES: dict[str, Callable[[GPTConfig, int, int], nn.Module]] = {
    **{rule: (lambda c, j, layer, rule=rule: ScaledAdd(*combine_coefficients(rule, j, c.n_layer)))
       for rule in ("add", "pre_alt", "deepnorm", "convex")},
    "geodesic": lambda c, j, layer: GeodesicStep(geonorm_decay(c.geonorm_decay, layer, c.n_layer), c.geonorm_clamp),
    "rezero": lambda c, j, layer: ReZeroAdd(),
    "rezero_block": lambda c, j, layer: ReZeroAdd(),  # the block shares its attention's alpha with its MLP
    "nlerp": lambda c, j, layer: NormalizedLerp(c.n_embd, NGPT_ALPHA_INIT, c.n_embd**-0.5),  # nGPT §2.6
    "attn_res": lambda c, j, layer: columns.AttentionResidual(c.n_embd, c.norm_eps),  # x: the stack of sources
}


# ----------------------------------------------------------------------------- inits, linear maps, positions


def init_gpt2(weight: torch.Tensor, name: str, n_layer: int) -> None:
    """GPT-2: N(0, 0.02) (drawn already), the residual projections scaled by 1/sqrt(2L) (two updates per block)."""
    if name.endswith(("out_proj", "mlp.sublayer.proj")):
        nn.init.normal_(weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


def init_deepnorm(weight: torch.Tensor, name: str, n_layer: int) -> None:
    """DeepNet (decoder-only): Xavier with gain beta = (8L)^(-1/4) on v, out and the MLP; q, k gain 1."""
    beta = 1.0 if name.endswith(("q_proj", "k_proj")) else (8 * n_layer) ** -0.25
    nn.init.xavier_normal_(weight, gain=beta)


def init_zero_out(weight: torch.Tensor, name: str, n_layer: int) -> None:
    """modded-nanogpt: the residual projections start at zero, so every update starts as the identity."""
    if name.endswith(("out_proj", "mlp.sublayer.proj")):
        nn.init.zeros_(weight)


def init_nanochat(weight: torch.Tensor, name: str, n_layer: int) -> None:
    """nanochat gpt.py init_weights: zero residual projections; U(+-sqrt(3/d)) else, the MLP's input map 0.4x."""
    if name.endswith(("out_proj", "mlp.sublayer.proj")):
        return nn.init.zeros_(weight)
    bound = math.sqrt(3 / weight.shape[1]) * (0.4 if name.endswith("mlp.sublayer.fc") else 1.0)
    nn.init.uniform_(weight, -bound, bound)


# One registry of inits: name -> (weight, its path in the block, L) -> None, over the GPT-2 default N(0, 0.02)
INITS: dict[str, Callable[[torch.Tensor, str, int], None]] = {
    "gpt2": init_gpt2,
    "xavier": lambda weight, name, n_layer: nn.init.xavier_normal_(weight),  # DNT
    "deepnorm": init_deepnorm,
    "orthogonal": lambda weight, name, n_layer: nn.init.orthogonal_(weight),  # Bir et al. §4.3
    "normal": lambda weight, name, n_layer: None,  # N(0, 0.02) everywhere (OLMo 2, LNS)
    "zero_out": init_zero_out,
    "nanochat": init_nanochat,
}


class GainLinear(nn.Linear):
    """A linear map followed by a learnable diagonal gain kept in [1e-3, cap] (Bir et al. §6.2). `constrain_`
    clamps the gain in place after every optimizer step, as their code clamps the parameter itself: a clamp inside
    forward would give a gain above the cap zero gradient, and it would stay there."""

    def __init__(self, in_features: int, out_features: int, bias: bool, cap: float):
        super().__init__(in_features, out_features, bias=bias)
        self.cap = cap
        self.gain = nn.Parameter(torch.full((out_features,), min(1.0, cap)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain

    @torch.no_grad()
    def constrain_(self) -> None:
        self.gain.clamp_(1e-3, self.cap)


def make_linear(config: GPTConfig, d_in: int, d_out: int) -> nn.Linear:
    if config.gain_cap is not None:
        return GainLinear(d_in, d_out, config.bias, config.gain_cap)
    return nn.Linear(d_in, d_out, bias=config.bias)


# The factor on q.k: standard, Bir et al. §4.3, nGPT §2.3.2 (unit q and k: dot products of variance 1/d_h), and
# nanochat (its normed q and k each times 1.2)
ATTN_SCALES = {"1/sqrt(d)": lambda d_h: 1.0 / math.sqrt(d_h), "1/d": lambda d_h: 1.0 / d_h,
               "sqrt(d)": lambda d_h: math.sqrt(d_h), "1.44/sqrt(d)": lambda d_h: 1.2**2 / math.sqrt(d_h)}


def softmax_scale(attn_scale: str, head_dim: int) -> float:
    return ATTN_SCALES[attn_scale](head_dim)


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


# ----------------------------------------------------------------------------- attention and MLP


class Attention(nn.Module):
    """Causal softmax attention of (B, heads, T, head_dim) q, k, v: torch's fused kernel, or, where the scores
    themselves are needed (Gemma 2's attention softcap, QK-Clip's record), the same math written out:
    softmax(mask(cap(q k^T scale))) v with the softmax in float32 (as litgpt's softcapped path); then gpt-oss's sink."""

    def __init__(self, scale: float, dropout: float, cap: float | None = None, clip: columns.QKClip | None = None,
                 sink: columns.AttentionSink | None = None):
        super().__init__()
        self.scale, self.dropout, self.cap, self.clip, self.sink = scale, dropout, cap, clip, sink

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """mask(cap(q k^T scale)) in float32 at least, -inf above the diagonal; QK-Clip records them in training."""
        scores = (q @ k.transpose(-2, -1)) * self.scale
        T = scores.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
        if self.clip is not None and self.training:
            self.clip.record(scores, causal)
        if self.cap is not None:
            scores = columns.softcap(scores, self.cap)
        return scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(~causal, -math.inf)

    def weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The attention weights (B, heads, T, T) each query gives the keys, less the sink's share."""
        scores = self.scores(q, k)
        weights = F.softmax(scores, dim=-1)
        return weights if self.sink is None else weights * self.sink.kept(scores)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if self.cap is None and self.clip is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, dropout_p=dropout)
            return out if self.sink is None else self.sink(out, self.scores(q, k))
        scores = self.scores(q, k)
        out = F.dropout(F.softmax(scores, dim=-1).to(v.dtype), dropout) @ v
        return out if self.sink is None else self.sink(out, scores)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        d, self.n_head = config.n_embd, config.n_head
        self.head_dim = d // config.n_head
        # separate q/k/v maps: each is its own matrix for the inits and Muon-style optimizers
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (make_linear(config, d, d) for _ in range(4))
        scheme = config.scheme
        all_heads = scheme.normalizes("qk_all")
        self.q_norm = make_qkv_norm(config, scheme.normalizes("qk", "qk_all", "qkv"), all_heads)
        self.k_norm = make_qkv_norm(config, scheme.normalizes("qk", "qk_all", "qkv", "k"), all_heads)
        self.v_norm = make_qkv_norm(config, scheme.normalizes("qkv", "v"), all_heads and not scheme.normalizes("v"))
        self.scale = softmax_scale(scheme.attn_scale, self.head_dim)
        clip = None if scheme.qk_clip is None else columns.QKClip(scheme.qk_clip, self.n_head, self.q_proj, self.k_proj)
        sink = columns.AttentionSink(self.n_head) if scheme.attn_sink else None
        self.attend = Attention(self.scale, config.dropout, scheme.attn_softcap, clip, sink)
        gate = scheme.attn_gate
        self.gate = None if gate == "none" else columns.AttentionGate(gate, d, self.n_head, config.bias)
        self.value_residual = columns.ValueResidual(layer == 0) if scheme.value_residual else None
        self.rope = config.pos == "rope"
        if self.rope:
            register_rope(self, self.head_dim, config.block_size, 10000.0)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values, (B, heads, T, head_dim), as the softmax sees them (normed, rotated)."""
        B, T, C = x.shape
        heads = (B, T, self.n_head, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(heads)).transpose(1, 2)  # DNT eq. 10: each head's q, k normalized
        k = self.k_norm(self.k_proj(x).view(heads)).transpose(1, 2)
        v = self.v_norm(self.v_proj(x).view(heads)).transpose(1, 2)
        if self.rope:
            q = apply_rope(q, self.rope_cos, self.rope_sin)
            k = apply_rope(k, self.rope_cos, self.rope_sin)
        return q, k, v

    def forward(self, x: torch.Tensor, ctx: dict | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x)
        if self.value_residual is not None:  # ResFormer: the first block's values ride in ctx
            v = self.value_residual(v, ctx)
        y = self.attend(q, k, v)
        if self.gate is not None:  # Qiu et al. G1: after the softmax's output, before the output projection
            y = self.gate(y, x)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


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


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.n_embd
        self.swiglu = config.mlp == "swiglu"
        self.act = ACTIVATIONS.get(config.mlp)
        hidden = mlp_width(d, config.mlp, config.mlp_hidden)
        self.fc = make_linear(config, d, hidden)
        self.gate = make_linear(config, d, hidden) if self.swiglu else None
        self.proj = make_linear(config, hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(self.act(self.fc(x)))


# ----------------------------------------------------------------------------- nGPT's hypersphere (Loshchilov et al.)
# The residual stream and every weight vector along the embedding axis at unit L2 norm; learned scalings (alpha,
# s_qk, s_u, s_v, s_z) restore the ranges normalization takes away. Compared with NVIDIA/ngpt: docs/schemes.md.


def unit_norm(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """nGPT's Norm: x / max(||x||, eps) over the last axis (`F.normalize`), no gain; eps only guards a zero vector.
    Written as x times 1 / sqrt(max(||x||^2, eps^2)), the same value, with a product in place of a division."""
    return x * x.square().sum(-1, keepdim=True).clamp_min(eps * eps).rsqrt()


def normalized_lerp(h: torch.Tensor, y: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """nGPT's residual update (eq. 10, 11): h <- Norm(h + alpha (Norm(y) - h)), in h's dtype (a bf16 sub-layer
    output under autocast is normalized in float32)."""
    return unit_norm(torch.lerp(h, unit_norm(y.to(h.dtype), eps), alpha), eps)  # lerp: h + alpha (n - h)


@torch.no_grad()
def unit_(weight: torch.Tensor, dim: int) -> None:
    """Scale the weight's vectors along `dim` to unit norm in place: the constraint nGPT's maps keep (§2.6)."""
    weight.mul_(torch.linalg.vector_norm(weight, dim=dim, keepdim=True).clamp_min_(1e-12).reciprocal_())


class LearnedScale(nn.Module):
    """A learnable vector in nGPT's parameterization (§2.5): stored as `scale` and read as stored * init / scale,
    so it starts at `init` and an Adam step of size lr moves it by lr * init / scale."""

    def __init__(self, size: int, init: float, scale: float):
        super().__init__()
        self.init, self.scale = init, scale
        self.param = nn.Parameter(torch.full((size,), float(scale)))

    def forward(self) -> torch.Tensor:
        return self.param * (self.init / self.scale)

    def extra_repr(self) -> str:
        return f"size={self.param.numel()}, init={self.init:.4g}, scale={self.scale:.4g}"


class SphereLinear(nn.Linear):
    """A linear map whose weight vectors along the embedding axis have unit norm (nGPT §2.6): `unit_dim` 1 for maps
    that read the stream (unit rows), 0 for maps that write it (unit columns), as NVIDIA/ngpt's
    `normalize_matrices`. `constrain_` restores the norms at init and after every optimizer step."""

    def __init__(self, in_features: int, out_features: int, bias: bool, unit_dim: int):
        super().__init__(in_features, out_features, bias=bias)
        self.unit_dim = unit_dim

    def forward(self, x: torch.Tensor, out_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b), each output times its entry of `out_scale` (nGPT's s_u, s_v, s_z), applied to W's rows:
        (x W^T) s = x (s W)^T, the same values from a product over the weight instead of over every token."""
        if out_scale is None:
            return super().forward(x)
        bias = None if self.bias is None else self.bias * out_scale
        return F.linear(x, self.weight * out_scale[:, None], bias)

    @torch.no_grad()
    def constrain_(self) -> None:
        unit_(self.weight, self.unit_dim)


class SphereEmbedding(nn.Embedding):
    """An embedding table with unit rows (nGPT §2.1), restored by `constrain_` like `SphereLinear`."""

    @torch.no_grad()
    def constrain_(self) -> None:
        unit_(self.weight, 1)


class SphereHead(SphereLinear):
    """nGPT's output head (§2.1, eq. 3): unit rows make the logits cosines; s_z per vocabulary entry (init 1,
    scale 1/sqrt(d)) gives them back a usable temperature."""

    def __init__(self, n_embd: int, vocab_size: int):
        super().__init__(n_embd, vocab_size, bias=False, unit_dim=1)
        self.s_z = LearnedScale(vocab_size, 1.0, n_embd**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x, self.s_z())


class NormalizedLerp(nn.Module):
    """nGPT's residual update (eq. 10, 11): h <- Norm(h + |alpha| (Norm(y) - h)), alpha per channel (the eigen
    learning rates, init 0.05, scale 1/sqrt(d)); |alpha| as NVIDIA/ngpt's model.py (the paper asks alpha > 0)."""

    def __init__(self, dim: int, alpha_init: float, alpha_scale: float):
        super().__init__()
        self.alpha = LearnedScale(dim, alpha_init, alpha_scale)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return normalized_lerp(x, y, self.alpha().abs().to(x.dtype))


class SphereAttention(nn.Module):
    """nGPT's attention (§2.3.2): unit-norm q, k, v and out maps; after RoPE (as NVIDIA/ngpt), q and k on the unit
    sphere per head times s_qk (eq. 15, 16: d_k per head, init 1, scale 1/sqrt(d)); the row's attn_scale "sqrt(d)".
    qk_norm=False drops the normalization and s_qk (the paper's Table 6 ablation)."""

    def __init__(self, n_embd: int, n_head: int, bias: bool, qk_norm: bool, attn_scale: str, dropout: float,
                 rope_length: int | None = None, rope_base: float = 10000.0):
        super().__init__()
        d, self.n_head = n_embd, n_head
        self.head_dim = d // n_head
        self.q_proj, self.k_proj, self.v_proj = (SphereLinear(d, d, bias, unit_dim=1) for _ in range(3))
        self.out_proj = SphereLinear(d, d, bias, unit_dim=0)
        self.s_qk = LearnedScale(d, 1.0, d**-0.5) if qk_norm else None
        self.scale = softmax_scale(attn_scale, self.head_dim)
        self.dropout = dropout
        self.rope = rope_length is not None  # RoPE tables for rope_length positions; None: no RoPE
        if self.rope:
            register_rope(self, self.head_dim, rope_length, rope_base)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values, (B, heads, T, head_dim), as the softmax sees them."""
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.rope:
            q = apply_rope(q, self.rope_cos, self.rope_sin)
            k = apply_rope(k, self.rope_cos, self.rope_sin)
        if self.s_qk is not None:
            s_qk = self.s_qk().view(self.n_head, 1, self.head_dim).to(q.dtype)  # one vector per head
            q, k = unit_norm(q) * s_qk, unit_norm(k) * s_qk
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class SphereMLP(nn.Module):
    """nGPT's MLP (§2.4.2): unit-norm maps, u <- s_u sqrt(d) u, v <- s_v sqrt(d) v, then u * SiLU(v) (s_u, s_v init
    1, scale 1). The sqrt(d) on u is NVIDIA/ngpt's (eq. 20 has s_u u): one model without biases, as the output is
    used only after Norm. With mlp="gelu" or "relu2" (not in nGPT) the one input map takes v's scaling."""

    def __init__(self, n_embd: int, hidden: int, bias: bool, swiglu: bool, act: Callable | None = None):
        super().__init__()
        d, self.swiglu, self.act = n_embd, swiglu, act or F.gelu  # act: the one-matrix MLP's nonlinearity
        self.fc = SphereLinear(d, hidden, bias, unit_dim=1)  # u (GELU: the nonlinearity's input)
        self.gate = SphereLinear(d, hidden, bias, unit_dim=1) if swiglu else None  # v
        self.proj = SphereLinear(hidden, d, bias, unit_dim=0)
        self.s_u = LearnedScale(hidden, 1.0, 1.0) if self.swiglu else None
        self.s_v = LearnedScale(hidden, 1.0, 1.0)
        self.sqrt_d = math.sqrt(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v_scale = self.s_v() * self.sqrt_d
        if not self.swiglu:
            return self.proj(self.act(self.fc(x, v_scale)))
        return self.proj(self.fc(x, self.s_u() * self.sqrt_d) * F.silu(self.gate(x, v_scale)))


def make_sublayers(config: GPTConfig, layer: int) -> tuple[nn.Module, nn.Module]:
    """Block `layer`'s attention and MLP: nGPT's unit-norm ones on the hypersphere (combine "nlerp")."""
    if not config.hypersphere:
        return CausalSelfAttention(config, layer), MLP(config)
    rope_length = config.block_size if config.pos == "rope" else None
    hidden = mlp_width(config.n_embd, config.mlp, config.mlp_hidden)
    return (SphereAttention(config.n_embd, config.n_head, config.bias, config.scheme.normalizes("qk", "qk_all", "qkv"),
                            config.scheme.attn_scale, config.dropout, rope_length),
            SphereMLP(config.n_embd, hidden, config.bias, config.mlp == "swiglu", ACTIVATIONS.get(config.mlp)))


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
        lns = torch.tensor(self.pre_norm_scale, dtype=torch.float64) if scheme.pre_norm_scale != "1" else None
        self.register_buffer("pre_scale", lns, persistent=False)  # a buffer, as ScaledAdd's coefficients
        self.sublayer = sublayer
        self.branch_scale = scheme.branch_scale
        self.dropout = nn.Dropout(config.dropout)
        self.mid_norm = maybe_norm(config, scheme.normalizes("mid"), alpha)
        self.combine = COMBINE_RULES[scheme.combine](config, j, layer)
        self.post_norm = maybe_norm(config, scheme.normalizes("post", f"post_{name}"), alpha)
        self.takes_ctx = isinstance(sublayer, CausalSelfAttention)
        n, kind = scheme.residual_streams, scheme.hyper_connections  # hyper-connections replace combine (an add)
        self.hyper = None if kind == "none" else columns.HyperConnection(kind, n, config.n_embd, j - 1, config.norm_eps)

    def branch(self, x: torch.Tensor, ctx: dict | None = None) -> torch.Tensor:
        h = self.pre_norm(x)
        if self.pre_scale is not None:
            h = self.pre_scale * h
        y = self.sublayer(h, ctx) if self.takes_ctx else self.sublayer(h)
        if self.branch_scale != 1.0:
            y = self.branch_scale * y
        return self.dropout(self.mid_norm(y))  # after the mid-norm, as OLMo-core's Peri-LN block: dropped is 0

    def forward(self, x: torch.Tensor, ctx: dict | None = None) -> torch.Tensor:
        if self.hyper is not None:  # x: the streams (B, T, n, d)
            return self.hyper(x, self.branch, ctx)
        if isinstance(self.combine, columns.AttentionResidual):  # x: the sources (B, T, S, d), this output appended
            return self.combine(x, self.branch, ctx)
        return self.post_norm(self.combine(x, self.branch(x, ctx)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        attn, mlp = make_sublayers(config, layer)
        self.attn = ResidualUpdate(config, attn, "attn", 2 * layer + 1, layer)
        self.mlp = ResidualUpdate(config, mlp, "mlp", 2 * layer + 2, layer)
        if config.scheme.combine == "rezero_block":
            self.mlp.combine.alpha = self.attn.combine.alpha  # one alpha for the block's two updates
        self.x0_mix = columns.X0Mix(config.scheme.init, layer, config.n_layer) if config.scheme.x0_mix else None

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
        self.embed_scale = ScalarGain(math.sqrt(d)) if config.embed_scale else nn.Identity()
        proj = (lambda: nn.Linear(d, d, bias=config.bias)) if config.embed_proj else nn.Identity  # OSP's EmbProj:
        self.embed_in, self.head_in = proj(), proj()  # after the token embedding, before the head (orthogonal init)
        self.input_norm = maybe_norm(config, scheme.normalizes("input"))
        self.drop = nn.Dropout(config.dropout)
        # GeoNorm's sqrt_d reading: the stream starts on the sphere of radius sqrt(d) (docs/schemes.md)
        on_sqrt_d_sphere = scheme.combine == "geodesic" and config.geonorm_radius == "sqrt_d"
        self.embed_radius = math.sqrt(d) if on_sqrt_d_sphere else None
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.final_norm = maybe_norm(config, scheme.normalizes("final"), norm_alpha_init(config, "final"))
        out = config.out_features if vector else config.vocab_size
        self.lm_head = SphereHead(d, out) if config.hypersphere else nn.Linear(d, out, bias=False)
        if scheme.tie_head and not vector:
            self.wte.weight = self.lm_head.weight  # weight tying (GPT-2)
        attn_res = scheme.combine == "attn_res"  # its stream: the embedding and each update's output, stacked
        self.streams = scheme.residual_streams if scheme.hyper_connections != "none" else 1 if attn_res else None
        self.read_out = columns.AttentionResidual(d, config.norm_eps) if attn_res else None
        self.logit_softcap, self.z_loss = scheme.logit_softcap, scheme.z_loss
        self.apply(self._init_weights)
        for block in self.blocks:
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear):
                    INITS[scheme.init](module.weight, name, config.n_layer)
        if scheme.init == "nanochat" and not vector:  # nanochat gpt.py init_weights
            nn.init.normal_(self.wte.weight, std=0.8)
            nn.init.normal_(self.lm_head.weight, std=0.001)
        for proj in (p for p in (self.embed_in, self.head_in) if isinstance(p, nn.Linear)):
            nn.init.orthogonal_(proj.weight)
        self.apply_parameter_constraints()  # constrained weights start on their sets (nGPT: unit norm)

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

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_in(self.wte(idx))
        if self.wpe is not None:
            T = idx.shape[1]
            if T > self.config.block_size:
                raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(self.input_norm(self.embed_scale(x)))
        if self.embed_radius is not None:  # a projection without parameters: every token at norm sqrt(d)
            x = self.embed_radius * F.normalize(x, dim=-1)
        return x

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (B, T) -> logits (B, T, vocab) and, given targets, the loss; without targets only the last
        position's logits (all sampling needs). Vector mode: floats (B, T, in) -> (B, T, out), no loss."""
        x = self.embed(idx) if self.streams is None else columns.expand(self.embed(idx), self.streams)
        ctx = {"x0": x}  # shared by the blocks: the x0 mix's x0, the value residual's v1
        for block in self.blocks:
            x = block(x, ctx)
        return self.head(x, targets)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stream after the last block -> forward's logits and loss: the streams' sum (hyper-connections) or
        read (Attention Residuals), the final norm, the output layer, the softcap, the cross-entropy and z-loss."""
        if self.streams is not None:
            x = columns.reduce(x) if self.read_out is None else self.read_out.read(x)
        x = self.head_in(self.final_norm(x))
        if self.config.vector_mode:
            return self.lm_head(x), None
        logits = self.lm_head(x if targets is not None else x[:, [-1], :])
        if self.logit_softcap is not None:
            logits = columns.softcap(logits, self.logit_softcap)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        if self.z_loss and self.training:  # the objective only: evaluations report the cross-entropy
            loss = loss + self.z_loss * columns.z_loss(logits, targets)
        return logits, loss

    def compile_regions(self, **options) -> None:
        """torch.compile each block and the head in place: blocks of one structure reuse one compiled Block.forward
        (their constants are buffers, which dynamo does not guard on), where the whole model compiles all L."""
        for block in self.blocks:
            block.compile(**options)
        self.head = torch.compile(self.head, **options)  # the instance's attribute, in place of the method

    @torch.no_grad()
    def apply_parameter_constraints(self) -> None:
        """Put constrained parameters (any sub-module's `constrain_()`: a clamped gain, unit-norm weights) back
        on their sets, after every optimizer step and once at init; deterministic, so every rank agrees."""
        for module in self.modules():
            if module is not self and hasattr(module, "constrain_"):
                module.constrain_()

    @torch.no_grad()
    def forget_step(self) -> None:
        """What the step's forwards recorded for its constraints (QK-Clip's logit maxima), dropped when its update is
        skipped."""
        for module in self.modules():
            if module is not self and hasattr(module, "forget_step"):
                module.forget_step()

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


if __name__ == "__main__":  # every scheme as a sentence: its columns that differ from the defaults
    for row_name, row in SCHEMES.items():
        print(f"{row_name:10s} " + ", ".join(f"{k}={v}" for k, v in row._asdict().items()
                                              if k == "norms" or v != Scheme._field_defaults[k]))

"""Properties that tie the rows of `SCHEMES` to their references, asserted on behaviour (what is trainable, the
order of operations, the statistics the softmax sees, the scale of the init), through GPT, GPTConfig and the
modules' parameters and forward passes only."""

import math
import re

import pytest
import torch
from test_model import tiny, tokens
from torch.nn import functional as F

import optim
from model import GPT, SCHEMES

EPS = 1e-5  # GPTConfig.norm_eps


# ----------------------------------------------------------------------------- DyT and Derf: every parameter learns


def squash_ops(model: GPT) -> list[torch.nn.Module]:
    """The DyT/Derf operations: the modules holding a scalar alpha (as a parameter or, if frozen, a buffer)."""
    return [m for m in model.modules()
            if "alpha" in dict(m.named_parameters(recurse=False)) or "alpha" in dict(m.named_buffers(recurse=False))]


@pytest.mark.parametrize("norm, names", [("dyt", {"alpha", "weight", "bias"}),
                                         ("derf", {"alpha", "shift", "weight", "bias"})])
def test_every_dyt_and_derf_parameter_is_trainable_and_moves_in_one_step(norm, names):
    """DyT: gamma * tanh(alpha x) + beta; Derf: gamma * erf(alpha x + s) + beta, with alpha, s, gamma and beta all
    learnable (jiachenzhu/DyT dynamic_tanh.py; Derf's model_derf.patch). Peri-LN places one at every place a
    norm can go (input, pre, mid, final); bias=True gives each its beta."""
    torch.manual_seed(0)
    L = 2
    model = GPT(tiny(norm_scheme="peri", norm=norm, bias=True, embed_scale=True, n_layer=L))
    ops = squash_ops(model)
    assert len(ops) == 1 + 4 * L + 1  # the input norm, pre- and mid-norms of 2L updates, the final norm
    for op in ops:  # each of them a parameter that requires grad, none a constant
        assert set(dict(op.named_parameters(recurse=False))) == names, op
        assert not set(dict(op.named_buffers(recurse=False))) & names, op
        assert all(p.requires_grad for p in op.parameters(recurse=False)), op
    _, loss = model(tokens(), tokens(seed=1))
    loss.backward()
    for op in ops:
        for name, p in op.named_parameters(recurse=False):
            assert p.grad is not None and p.grad.abs().max() > 0, (op, name)
    # and the optimizer takes each of them: one AdamW step moves every one
    opt = optim.build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), device_type="cpu")
    before = [[p.detach().clone() for p in op.parameters(recurse=False)] for op in ops]
    opt.step()
    for op, old in zip(ops, before, strict=True):
        for (name, p), q in zip(op.named_parameters(recurse=False), old, strict=True):
            assert not torch.equal(p, q), (op, name)


# ----------------------------------------------------------------------------- the embedding: gain, then input norm


def first_block_input(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    seen = []
    hook = model.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        model(idx)
    hook.remove()
    return seen[0]


@pytest.mark.parametrize("norm", ["dyt", "derf", "rmsnorm"])
@pytest.mark.parametrize("scheme", ["peri", "dnt", "speedrun"])
def test_embedding_gain_multiplies_the_embedding_before_the_input_norm(scheme, norm):
    """DyT's LLaMA recipe and Derf's GPT-2 patch multiply the embedding by a learnable scalar (init sqrt(d));
    with an input norm the first block sees N(g * (token + position)), not g * N(token + position). For DyT
    and Derf the two differ in the argument of tanh/erf (alpha g e against alpha e); for RMSNorm in the
    scale (g * N(e) has RMS sqrt(d), not 1)."""
    torch.manual_seed(0)
    alpha = 0.7  # unit gains, zero bias and shift at init
    model = GPT(tiny(norm_scheme=scheme, norm=norm, embed_scale=True, norm_alpha_init=alpha))
    d = model.config.n_embd
    idx = tokens()
    with torch.no_grad():
        e = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
    g = math.sqrt(d)
    expected = {"dyt": lambda z: torch.tanh(alpha * z), "derf": lambda z: torch.erf(alpha * z),
                "rmsnorm": lambda z: F.rms_norm(z, (d,), eps=EPS)}[norm](g * e)
    torch.testing.assert_close(first_block_input(model, idx), expected, rtol=1e-5, atol=1e-6)  # float32


# ----------------------------------------------------------------------------- q and k as the softmax sees them


@pytest.fixture
def softmax_inputs(monkeypatch):
    """Every (q, k, v) handed to scaled_dot_product_attention while the fixture is in use, in call order."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        calls.append((q.detach(), k.detach(), v.detach()))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


def per_head_ms(t: torch.Tensor) -> torch.Tensor:
    """Mean square over each head's channels: (B, heads, T, head_dim) -> (B, heads, T)."""
    return t.double().square().mean(-1)


def assert_unit_rms_per_head(t: torch.Tensor, what: str) -> None:
    """Each head of each token has mean square 1 over its own channels (atol: float32 rounding and eps)."""
    ms = per_head_ms(t)
    torch.testing.assert_close(ms, torch.ones_like(ms), rtol=0, atol=1e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_hybridnorm_star_block_zero_feeds_the_softmax_unit_rms_queries_and_keys_per_head(softmax_inputs, pos):
    """HybridNorm* (first_blocks="pre") makes block 0 Pre-Norm and keeps its QKV-norm: in block 0 as in every
    other block, each head's query, key and value have RMS 1 on their own (unit gains at init; RoPE rotates
    pairs of channels and keeps the norm). HybridNorm's blocks after the first take the un-normed stream, small
    at init (RMS about 0.03), so a head's raw mean square is about 1e-5: norm_eps 1e-12 keeps eps / ms, the
    distance from 1, below 1e-6."""
    torch.manual_seed(0)
    model = GPT(tiny(norm_scheme="hybrid", overrides={"first_blocks": "pre"}, pos=pos, n_head=4, norm_eps=1e-12))
    model(tokens())
    assert len(softmax_inputs) == model.config.n_layer
    for layer, (q, k, v) in enumerate(softmax_inputs):
        assert q.shape == (2, 4, 16, 8), q.shape  # (B, heads, T, head_dim)
        for name, t in (("q", q), ("k", k), ("v", v)):
            assert_unit_rms_per_head(t, f"block {layer} {name}")


def test_speedrun_normalizes_q_and_k_per_head_not_over_the_whole_projection(softmax_inputs):
    """modded-nanogpt's QK-norm is F.rms_norm(q, (q.size(-1),)) on (B, T, heads, head_dim): each head on its own
    (the 2024-11-03 record, line 175 of its log's code). A norm over the whole projection leaves RMS 1 only on
    average over the heads: with 8 channels a head, the heads of a random init differ by tens of percent in RMS
    before the norm. Here every head of every token has RMS 1 (no gain: norm_affine=False)."""
    torch.manual_seed(0)
    model = GPT(tiny(norm_scheme="speedrun", norm="rmsnorm", n_head=4, norm_eps=1e-12))
    model(tokens())
    assert len(softmax_inputs) == model.config.n_layer
    for layer, (q, k, _) in enumerate(softmax_inputs):
        for name, t in (("q", q), ("k", k)):
            assert_unit_rms_per_head(t, f"block {layer} {name}")


# ----------------------------------------------------------------------------- each row's init, by its scale


# The papers' rows' `init`, written out here rather than read from SCHEMES, so that a row whose init changes
# fails; a row added later is checked against its own init. nGPT-like rows (combine "nlerp") are left out: their
# matrices are normalized to unit rows after the draw, so only the draw's direction counts.
ROW_INIT = {
    "post": "gpt2", "pre": "gpt2", "pre_alt": "gpt2", "deepnorm": "deepnorm", "sandwich": "gpt2",
    "geonorm": "gpt2", "dnt": "xavier", "dnt_s1": "xavier", "dnt_s2": "xavier", "dnt_s3": "xavier",
    "dnt_s4": "xavier", "lipschitz": "orthogonal", "none": "orthogonal", "peri": "gpt2", "olmo2": "normal",
    "mixln": "gpt2", "lns": "normal", "hybrid": "gpt2", "rezero": "gpt2", "speedrun": "zero_out",
    "nanochat": "nanochat",
}


def residual_output_std(init: str, L: int, fan_in: int, fan_out: int) -> float:
    """The std of a residual output projection's (fan_out x fan_in) entries under each init."""
    xavier = math.sqrt(2 / (fan_in + fan_out))
    return {"gpt2": 0.02 / math.sqrt(2 * L), "normal": 0.02, "zero_out": 0.0, "nanochat": 0.0, "xavier": xavier,
            "deepnorm": (8 * L) ** -0.25 * xavier,  # DeepNet: gain beta = (8L)^(-1/4) on out and the MLP
            "orthogonal": math.sqrt(min(fan_in, fan_out) / (fan_in * fan_out))}[init]  # orthonormal rows or columns


def residual_outputs(model: GPT, kind: str) -> list[torch.Tensor]:
    """The attention output projections ("attn") or MLP output projections ("mlp"), one per block."""
    pattern = {"attn": r"blocks\.\d+\.attn\..*\bout_proj\.weight", "mlp": r"blocks\.\d+\.mlp\..*\bproj\.weight"}[kind]
    return [p for name, p in model.named_parameters() if re.fullmatch(pattern, name)]


def test_the_pinned_rows_are_rows():
    assert set(ROW_INIT) <= set(SCHEMES)


@pytest.mark.parametrize("row", sorted(r for r, s in SCHEMES.items() if s.combine != "nlerp"))
def test_residual_output_projections_start_at_the_rows_init_scale(row):
    """GPT-2's init draws the residual output projections (attention out, MLP proj) from N(0, 0.02 / sqrt(2L)),
    "normal" (OLMo 2, LNS) from N(0, 0.02), "zero_out" (the speedrun) zeros them; Xavier, DeepNet's scaled
    Xavier and orthogonal have their fan-dependent scales. L = 4, d = 64: 4 x 64 x 64 = 16k attention entries
    and 4 x 64 x 256 = 65k MLP entries, whose sample std has a relative standard error 1/sqrt(2n) of 0.55% and
    0.28%; the tolerance, 3%, is 5 and 10 of those, and the nearest other init (N(0, 0.02) against
    0.02 / sqrt(2L)) is a factor sqrt(8) = 2.8 away. A 3-sigma truncation (0.987 x) would pass."""
    torch.manual_seed(0)
    L, d = 4, 64
    model = GPT(tiny(norm_scheme=row, n_layer=L, n_embd=d, n_head=4))
    for kind, fan_in in (("attn", d), ("mlp", 4 * d)):
        weights = residual_outputs(model, kind)
        assert len(weights) == L and all(w.shape == (d, fan_in) for w in weights), (kind, len(weights))
        entries = torch.cat([w.detach().flatten() for w in weights])
        want = residual_output_std(ROW_INIT.get(row, SCHEMES[row].init), L, fan_in, d)
        got = entries.square().mean().sqrt().item()  # about 0 mean: the RMS is the std about 0
        assert got == pytest.approx(want, rel=0.03, abs=0 if want else 1e-12), (row, kind, got, want)

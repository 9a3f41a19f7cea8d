"""The schemes since 2020 (DyT, Derf, Peri-LN, OLMo 2, Mix-LN, LNS, HybridNorm, ReZero, the speedrun's),
each checked against the equation or placement that defines it."""

import math
import re

import pytest
import torch
import torch.nn as nn
from test_model import NORM_MODULES, count, reference_attention, residual_stream, tiny, tokens
from torch.nn import functional as F

import model as model_module
from model import GPT, DynamicErf, DynamicTanh, GPTConfig, ReZeroAdd

EPS = 1e-5  # GPTConfig.norm_eps, used by the references below


def double_model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny(**kw)).double()


def rms_per_head(n_head: int):
    return lambda t: F.rms_norm(t.unflatten(-1, (n_head, -1)), (t.shape[-1] // n_head,), eps=EPS).flatten(-2)


def rms_whole(t: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(t, t.shape[-1:], eps=EPS)


# ----------------------------------------------------------------------------- DyT and Derf


@pytest.mark.parametrize("norm, kind", [("dyt", DynamicTanh), ("derf", DynamicErf)])
def test_dyt_and_derf_are_elementwise_and_leave_no_normalization(norm, kind):
    model = GPT(tiny(norm=norm, n_layer=3))
    assert count(model, NORM_MODULES) == 0  # no LayerNorm, RMSNorm or head-wise norm left
    assert count(model, kind) == 2 * 3 + 1  # two pre-norms per block and the final norm
    op = model.final_norm.double()
    with torch.no_grad():  # learned values away from init, so every term of the formula enters
        op.alpha.fill_(0.7)
        op.weight.copy_(torch.linspace(0.5, 2.0, 32))
        op.bias.copy_(torch.linspace(-1.0, 1.0, 32))
        if norm == "derf":
            op.shift.fill_(0.3)
    x = 3 * torch.randn(5, 32, dtype=torch.float64)
    inner = torch.tanh(0.7 * x) if norm == "dyt" else torch.erf(0.7 * x + 0.3)
    torch.testing.assert_close(op(x), op.weight * inner + op.bias, rtol=1e-12, atol=1e-12)  # float64 rounding
    # elementwise: each output channel depends on its own input channel only (an exactly diagonal Jacobian)
    jac = torch.autograd.functional.jacobian(op, x[0])
    assert torch.equal(jac, torch.diag(torch.diagonal(jac)))


def test_dyt_alpha_starts_at_its_place_value_and_the_embedding_is_scaled():
    model = GPT(tiny(norm="dyt", norm_scheme="sandwich", norm_alpha_init=(0.8, 0.2, 0.1), embed_scale=True))
    for block in model.blocks:
        assert block.attn.pre_norm.alpha.item() == block.attn.mid_norm.alpha.item() == pytest.approx(0.8)
        assert block.mlp.pre_norm.alpha.item() == block.mlp.mid_norm.alpha.item() == pytest.approx(0.2)
    assert model.final_norm.alpha.item() == pytest.approx(0.1)
    # DyT's LLM recipe: a learnable scalar sqrt(d) times the embedding, on by default with DyT/Derf only
    idx = tokens()
    plain = model.wte(idx) + model.wpe(torch.arange(16))
    torch.testing.assert_close(model.embed(idx), math.sqrt(32) * plain)
    assert model.embed_scale.gain.requires_grad
    assert isinstance(GPT(tiny()).embed_scale, nn.Identity)
    assert isinstance(GPT(tiny(norm="derf", embed_scale=False)).embed_scale, nn.Identity)


@pytest.mark.parametrize("norm, kind, squash", [("dyt", DynamicTanh, torch.tanh), ("derf", DynamicErf, torch.erf)])
def test_dyt_and_derf_start_as_squash_of_half_x_with_alpha_one_half_and_zero_shift(norm, kind, squash):
    """DyT and Derf: alpha starts at 0.5 in every norm, Derf's shift s at 0, so each op is f(x / 2) at init
    (gain 1, bias 0) unless a per-place alpha is given."""
    model = GPT(tiny(norm=norm, norm_scheme="sandwich"))
    ops = [m for m in model.modules() if isinstance(m, kind)]
    assert len(ops) == 4 * 3 + 1  # pre- and mid-norm of both updates in 3 blocks, and the final norm
    x = 4 * torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    for op in ops:
        assert op.alpha.item() == 0.5 and (norm == "dyt" or op.shift.item() == 0.0)
        torch.testing.assert_close(op(x), squash(x / 2))  # float32 rounding


# ----------------------------------------------------------------------------- placements


def test_peri_normalizes_the_embedding_and_each_sublayer_input_and_output():
    model = double_model(norm_scheme="peri", norm="rmsnorm")
    idx = tokens()
    x = model.embed(idx)
    torch.testing.assert_close(x, rms_whole(model.wte(idx) + model.wpe(torch.arange(16))), rtol=0, atol=1e-12)
    for block in model.blocks:  # x <- x + N_out(f(N_in(x))), unit gains at init; atol: float64 rounding
        for update in (block.attn, block.mlp):
            expected = x + rms_whole(update.sublayer(rms_whole(x)))
            x = update(x)
            torch.testing.assert_close(x, expected, rtol=0, atol=1e-12)


def test_olmo2_normalizes_sublayer_outputs_and_q_k_over_the_whole_projection():
    model = double_model(norm_scheme="olmo2", norm="rmsnorm")
    attn = model.blocks[0].attn.sublayer
    assert attn.q_norm.weight.numel() == attn.k_norm.weight.numel() == 32  # one gain per channel of d
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    # x <- x + N(f(x)): no norm on the input; q and k normalized jointly over all heads, v not at all
    expected = x + rms_whole(reference_attention(attn, x, rms_whole, rms_whole, lambda t: t))
    torch.testing.assert_close(model.blocks[0].attn(x), expected, rtol=0, atol=1e-12)  # float64 rounding
    mlp = model.blocks[0].mlp
    torch.testing.assert_close(mlp(x), x + rms_whole(mlp.sublayer(x)), rtol=0, atol=1e-12)
    # OLMo 2 init: N(0, 0.02) on every matrix, the residual projections too (65k samples: within 3%)
    proj = torch.cat([b.mlp.sublayer.proj.weight.flatten() for b in model.blocks])
    assert proj.std().item() == pytest.approx(0.02, rel=0.03)


@pytest.mark.parametrize("n_layer, fraction, n_post", [(8, 0.25, 2), (6, 0.25, 1), (8, 0.5, 4), (4, 0.0, 0)])
def test_mixln_first_blocks_normalize_after_the_residual_and_the_others_before(n_layer, fraction, n_post,
                                                                              monkeypatch):
    monkeypatch.setattr(model_module, "MIXLN_FRACTION", fraction)
    model = GPT(tiny(norm_scheme="mixln", n_layer=n_layer))
    for layer, block in enumerate(model.blocks):
        post = layer < n_post  # floor(fraction * L) Post-Norm blocks first
        for update in (block.attn, block.mlp):
            assert isinstance(update.post_norm, nn.LayerNorm) == post
            assert isinstance(update.pre_norm, nn.LayerNorm) == (not post)
    assert isinstance(model.final_norm, nn.LayerNorm)
    # and the stream after a Post-Norm block is normalized: per-token mean 0, variance 1 - O(eps)
    stream = residual_stream(model, tokens())
    for x in stream[1:n_post + 1]:
        torch.testing.assert_close(x.var(-1, unbiased=False), torch.ones(2, 16), atol=1e-3, rtol=0)


def test_mixln_by_default_makes_the_first_quarter_of_the_blocks_post_norm():
    """Mix-LN's alpha is 0.25 (Li et al.): floor(0.25 L) Post-Norm blocks first, 2 of 8, 1 of 4 or 6, 0 of 3."""
    assert model_module.MIXLN_FRACTION == 0.25
    for n_layer, n_post in [(8, 2), (6, 1), (4, 1), (3, 0)]:
        model = GPT(tiny(norm_scheme="mixln", n_layer=n_layer))
        post = [isinstance(update.post_norm, nn.LayerNorm) for b in model.blocks for update in (b.attn, b.mlp)]
        assert post == [True] * 2 * n_post + [False] * 2 * (n_layer - n_post), n_layer


def test_lns_pre_norm_output_in_block_l_is_pre_norm_output_over_sqrt_l():
    pre, lns = double_model(norm_scheme="pre", n_layer=4), double_model(norm_scheme="lns", n_layer=4)
    lns.load_state_dict(pre.state_dict())  # the same weights
    seen = {}

    def record(name):
        return lambda module, args: seen.__setitem__(name, args[0])

    x = torch.randn(2, 16, 32, dtype=torch.float64)
    for l, (b_pre, b_lns) in enumerate(zip(pre.blocks, lns.blocks, strict=True), start=1):
        for kind in ("attn", "mlp"):
            inputs = []
            for block in (b_pre, b_lns):
                update = getattr(block, kind)
                hook = update.sublayer.register_forward_pre_hook(record(kind))
                update(x)
                hook.remove()
                inputs.append(seen[kind])
            torch.testing.assert_close(inputs[1], inputs[0] / math.sqrt(l), rtol=1e-12, atol=0)  # float64
    # LNS drops GPT-2's 1/sqrt(2L) on the residual projections: N(0, 0.02) (16k samples: within 5%)
    torch.manual_seed(0)
    fresh = GPT(tiny(norm_scheme="lns", n_layer=4))
    proj = torch.cat([b.mlp.sublayer.proj.weight.flatten() for b in fresh.blocks])
    assert proj.std().item() == pytest.approx(0.02, rel=0.05)


def test_hybrid_normalizes_q_k_and_v_and_post_norms_after_attention_only():
    model = double_model(norm_scheme="hybrid", norm="rmsnorm")
    block = model.blocks[1]
    attn = block.attn.sublayer
    assert isinstance(attn.v_norm, nn.RMSNorm) and attn.v_norm.weight.shape == (16,)  # per head, like q and k
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    # HybridNorm: Y = X + MHA(QKV-Norm), X' = N(Y) + FFN(N(Y)); atol: float64 rounding
    per_head = rms_per_head(2)
    y = rms_whole(x + reference_attention(attn, x, per_head, per_head, per_head))
    torch.testing.assert_close(block(x), y + block.mlp.sublayer(y), rtol=0, atol=1e-12)


def test_hybridnorm_star_makes_block_zero_pre_norm_and_keeps_its_qkv_norm():
    model = GPT(tiny(norm_scheme="hybrid", overrides={"first_blocks": "pre"}))
    first, second = model.blocks[0], model.blocks[1]
    assert isinstance(first.attn.pre_norm, nn.LayerNorm) and isinstance(first.mlp.pre_norm, nn.LayerNorm)
    assert isinstance(first.attn.post_norm, nn.Identity) and isinstance(first.mlp.post_norm, nn.Identity)
    assert isinstance(first.attn.sublayer.v_norm, nn.RMSNorm)
    assert isinstance(second.attn.pre_norm, nn.Identity) and isinstance(second.attn.post_norm, nn.LayerNorm)
    assert isinstance(second.mlp.post_norm, nn.Identity)


# ----------------------------------------------------------------------------- ReZero, the speedrun


def test_rezero_is_exactly_the_identity_on_the_residual_stream_at_init():
    model = GPT(tiny(norm_scheme="rezero"))
    assert count(model, NORM_MODULES) == 0
    stream = residual_stream(model, tokens())
    for x in stream[1:]:
        assert torch.equal(x, stream[0])
    # the gates are what learns first: only they get a gradient at init, one scalar per residual update
    model(tokens(), tokens(seed=1))[1].backward()
    gates = [m.alpha.gain for m in model.modules() if isinstance(m, ReZeroAdd)]
    assert len(gates) == 2 * 3 and all(g.grad.abs() > 0 for g in gates)
    assert all(p.grad.abs().max() == 0 for b in model.blocks for n, p in b.named_parameters() if "sublayer" in n)
    # combine="rezero_block": the attention and MLP updates of a block share one alpha
    shared = GPT(tiny(norm_scheme="rezero", overrides={"combine": "rezero_block"}))
    assert sum(isinstance(m, ReZeroAdd) for m in shared.modules()) == 2 * 3
    assert len([n for n, _ in shared.named_parameters() if n.endswith("combine.alpha.gain")]) == 3


def test_speedrun_has_no_learnable_norm_parameter_and_zero_output_projections():
    model = GPT(tiny(norm_scheme="speedrun", norm="rmsnorm"))
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == 1 + 2 * 3 + 2 * 3 + 1  # embedding, pre-norms, q and k, final
    assert all(not list(m.parameters()) for m in norms)
    for block in model.blocks:
        assert not block.attn.sublayer.out_proj.weight.any() and not block.mlp.sublayer.proj.weight.any()
    # so every block starts as the identity on the RMS-normalized embedding (float32 rounding)
    stream = residual_stream(model, tokens())
    torch.testing.assert_close(stream[0], F.rms_norm(model.wte(tokens()) + model.wpe(torch.arange(16)), (32,),
                                                     eps=EPS), rtol=0, atol=1e-6)
    assert all(torch.equal(x, stream[0]) for x in stream[1:])


def test_new_scheme_columns_reject_bad_values():
    for key, value in [("norms", "pre+row"), ("pre_norm_scale", "1/l"), ("combine", "mul"),
                       ("first_blocks", "last"), ("init", "zeros"), ("attn_scale", "1")]:
        with pytest.raises(ValueError, match=re.escape(f"{key}={value!r}")):
            GPTConfig(overrides={key: value})
    with pytest.raises(ValueError, match="unknown scheme column"):
        GPTConfig(overrides={"mixln_fraction": 0.5})


@pytest.mark.parametrize("scheme", ["sandwich", "peri"])
def test_dropout_acts_after_the_mid_norm_so_a_dropped_entry_adds_nothing(scheme):
    """OLMo-core's Peri-LN block: x + dropout(N_mid(f(N_pre(x)))). A dropped entry of the update is exactly 0; with
    dropout before the norm it would be the norm of a zero, -mean/sigma (LayerNorm without bias)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32, norm_scheme=scheme,
                          dropout=0.5, bias=False))
    update = model.blocks[0].mlp
    x = torch.randn(2, 16, 32)
    y = update.branch(x)
    dropped = y == 0
    assert 0.3 < dropped.float().mean().item() < 0.7  # about half, each entry on its own
    torch.manual_seed(1)
    kept = update.branch(x)
    with torch.no_grad():
        normed = update.mid_norm(update.sublayer(update.pre_norm(x)))
    torch.testing.assert_close(kept[kept != 0], 2 * normed[kept != 0], rtol=1e-6, atol=1e-6)  # the kept, times 1/(1-p)

"""The columns taken from other codebases (z-loss, Gemma 2's softcaps, QK-Clip, ResFormer's value residual, the x0
mix, hyper-connections and mHC) and the nanochat row, each checked against the equation that defines it; each
column at its identity setting is the row it modifies, bit for bit."""

import math
import re

import pytest
import torch
import torch.nn as nn
from test_model import tiny, tokens
from torch.nn import functional as F

import model
from model import GPT, GPTConfig, relu2
from nanonorm import columns
from nanonorm.columns import HyperConnection, sinkhorn_knopp

pytestmark = pytest.mark.usefixtures("one_thread")


def logits_of(config: GPTConfig, prepare=None, dtype=torch.float32) -> torch.Tensor:
    """The logits of a model drawn with seed 0 on `tokens()`, after `prepare(model)` (under no_grad)."""
    torch.manual_seed(0)
    model = GPT(config).to(dtype)
    if prepare is not None:
        with torch.no_grad():
            prepare(model)
    return model(tokens(), tokens())[0]


def inputs_of(modules: list[nn.Module], run) -> list[torch.Tensor]:
    """The first argument each module is called with while `run()` runs (forward pre-hooks, then removed)."""
    seen: list[torch.Tensor] = []
    handles = [m.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach())) for m in modules]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


# ----------------------------------------------------------------------------- z-loss


def test_z_loss_is_the_mean_squared_log_normalizer_and_enters_the_training_loss_only():
    g = torch.Generator().manual_seed(0)
    logits = 5 * torch.randn(3, 7, 11, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (3, 7), generator=g)
    targets[0, :2] = -1  # ignored tokens (ignore_index) count in neither the cross-entropy nor the z-loss
    log_z = torch.log(torch.exp(logits).sum(-1))  # the softmax's normalizer, written out
    expected = log_z[targets != -1].square().mean()
    torch.testing.assert_close(columns.z_loss(logits, targets), expected, rtol=1e-12, atol=0)  # float64 rounding

    torch.manual_seed(0)
    model = GPT(tiny(overrides={"z_loss": 1e-2})).double()
    idx = tokens()
    logits, loss = model(idx, idx)
    cross_entropy = F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())  # as GPT.forward: in float32
    torch.testing.assert_close(loss, cross_entropy + 1e-2 * torch.logsumexp(logits, -1).square().mean(),
                               rtol=1e-12, atol=0)
    model.eval()  # evaluations report the plain cross-entropy (no dropout: the same logits)
    torch.testing.assert_close(model(idx, idx)[1], cross_entropy, rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------- softcaps


@pytest.mark.parametrize("cap", [15.0, 50.0])
def test_softcap_bounds_by_c_and_is_the_identity_to_first_order_near_zero(cap):
    x = torch.linspace(-1e4, 1e4, 2001, dtype=torch.float64)
    assert columns.softcap(x, cap).abs().max() <= cap
    assert columns.softcap(x.float(), cap).abs().max() <= cap
    small = torch.linspace(-1e-2, 1e-2, 101, dtype=torch.float64) * cap
    # u - u^3/3 <= tanh(u) <= u for u >= 0: |c tanh(x/c) - x| <= |x|^3 / (3 c^2), plus float64 rounding
    error = (columns.softcap(small, cap) - small).abs()
    assert (error <= small.abs() ** 3 / (3 * cap**2) + 1e-15 * cap).all()
    assert error.max() > 0  # and the cap did act


def test_logit_softcap_caps_the_models_logits():
    def large_head(model):  # raw logits in the hundreds
        model.lm_head.weight.mul_(1e3)

    plain = logits_of(tiny(), large_head, torch.float64)
    capped = logits_of(tiny(overrides={"logit_softcap": 30.0}), large_head, torch.float64)
    assert plain.abs().max() > 100 and capped.abs().max() <= 30.0
    torch.testing.assert_close(capped, 30.0 * torch.tanh(plain / 30.0), rtol=1e-12, atol=1e-12)


def reference_attention(q, k, v, scale, cap=None):
    scores = q @ k.transpose(-2, -1) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    T = scores.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1) @ v


def test_attention_softcap_caps_the_scores_before_the_causal_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q = 40 * q  # scores in the hundreds: uncapped, each query attends to one key
    attend = model.Attention(8**-0.5, 0.0, cap=5.0)
    torch.testing.assert_close(attend(q, k, v), reference_attention(q, k, v, 8**-0.5, cap=5.0), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(attend(q, k, v), reference_attention(q, k, v, 8**-0.5), atol=1e-3)
    # the explicit path is SDPA's math: a cap far above every score changes nothing at float32's resolution
    config, wide = tiny(), tiny(overrides={"attn_softcap": 1e6})
    torch.testing.assert_close(logits_of(wide), logits_of(config), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- QK-Clip


def head_max_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The largest attention logit of each head of the model's only block on `idx` (causal pairs, eval mode)."""
    attn = model.blocks[0].attn.sublayer
    model.eval()
    (x,) = inputs_of([attn], lambda: model(idx))
    model.train()
    with torch.no_grad():
        q, k, _ = attn.heads(x)
        scores = q @ k.transpose(-2, -1) * attn.scale
    causal = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).tril()
    return scores.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))


def test_qk_clip_brings_each_heads_largest_logit_to_tau_after_a_step_and_leaves_the_others():
    tau, clipped, kept = 1.0, [0, 2], [1, 3]
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=1, n_head=4, overrides={"qk_clip": tau}))
    attn = model.blocks[0].attn.sublayer
    with torch.no_grad():  # heads 0 and 2 far above tau
        for h in clipped:
            for proj in (attn.q_proj, attn.k_proj):
                proj.weight[8 * h: 8 * h + 8] *= 40
                proj.bias[8 * h: 8 * h + 8].normal_(0, 0.5)
    idx = tokens()
    before = head_max_logits(model, idx)
    assert (before[clipped] > 5 * tau).all() and (before[kept] < tau / 5).all()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(idx, idx)[1].backward()
    optimizer.step()
    record = attn.attend.clip.max_logit.clone()
    torch.testing.assert_close(record, before, rtol=1e-6, atol=0)  # the step's forward recorded each head's max
    stepped = {n: p.detach().clone() for n, p in attn.named_parameters()}
    model.apply_parameter_constraints()
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"):
        now, then = getattr(attn, name.split(".")[0]).get_parameter(name.split(".")[1]), stepped[name]
        for h in range(4):
            rows = slice(8 * h, 8 * h + 8)
            if h in kept:  # untouched, bit for bit
                assert torch.equal(now[rows], then[rows])
            else:  # W_q and W_k of the head each times sqrt(tau / S)
                torch.testing.assert_close(now[rows], then[rows] * math.sqrt(tau / record[h]), rtol=1e-6, atol=0)
    after = head_max_logits(model, idx)
    # the rescale takes the recorded max exactly to tau; the AdamW step between (each weight moves by about lr =
    # 1e-4 against weights of about 0.8) moves a logit by well under 1% of itself
    assert ((after[clipped] - tau).abs() <= 0.01 * tau).all(), after
    assert (after[kept] < tau).all()
    assert torch.equal(attn.attend.clip.max_logit, torch.full((4,), -math.inf))  # the next step's record starts


# ----------------------------------------------------------------------------- value residual and x0 mix


def test_value_residual_mixes_the_first_blocks_values_and_at_lambda_one_is_the_row():
    first, later, ctx = columns.ValueResidual(first=True), columns.ValueResidual(first=False), {}
    assert first.lam is None and later.lam.item() == 0.5  # ResFormer's 1/2
    v1, v = torch.randn(2, 2, 5, 4, dtype=torch.float64), torch.randn(2, 2, 5, 4, dtype=torch.float64)
    assert first(v1, ctx) is v1 and ctx["v1"] is v1
    with torch.no_grad():
        later.lam.fill_(0.3)
    lam = later.lam.double()  # 0.3 in float32
    torch.testing.assert_close(later(v, ctx), lam * v + (1 - lam) * v1, rtol=1e-15, atol=1e-15)

    def lambda_one(model):
        for block in model.blocks[1:]:
            block.attn.sublayer.value_residual.lam.fill_(1.0)

    assert torch.equal(logits_of(tiny(overrides={"value_residual": True}), lambda_one), logits_of(tiny()))


def test_x0_mix_at_its_identity_init_is_the_row_and_mixes_x0_into_each_blocks_input():
    config = tiny(overrides={"x0_mix": True})
    assert torch.equal(logits_of(config), logits_of(tiny()))
    torch.manual_seed(0)
    model = GPT(config)
    assert all((b.x0_mix.resid.item(), b.x0_mix.x0.item()) == (1.0, 0.0) for b in model.blocks)
    with torch.no_grad():
        model.blocks[2].x0_mix.resid.fill_(0.7)
        model.blocks[2].x0_mix.x0.fill_(0.3)
    block_in, attn_in = inputs_of([model.blocks[2], model.blocks[2].attn], lambda: model(tokens()))
    torch.testing.assert_close(attn_in, 0.7 * block_in + 0.3 * model.embed(tokens()), rtol=1e-6, atol=1e-7)
    # nanochat's init ramps from (1.15, 0.20) in the first block to (1.05, 0.05) in the last
    nanochat = GPT(tiny(norm_scheme="nanochat", norm="rmsnorm"))
    ramp = [(b.x0_mix.resid.item(), b.x0_mix.x0.item()) for b in nanochat.blocks]
    assert ramp == [pytest.approx(p) for p in [(1.15, 0.20), (1.10, 0.125), (1.05, 0.05)]]


# ----------------------------------------------------------------------------- hyper-connections


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("scheme", ["pre", "peri"])
def test_hyper_connections_with_one_stream_at_init_are_exactly_the_row(kind, scheme):
    one = tiny(norm_scheme=scheme, overrides={"residual_streams": 1, "hyper_connections": kind})
    assert torch.equal(logits_of(one), logits_of(tiny(norm_scheme=scheme)))


def test_a_hyper_connection_reads_mixes_and_writes_the_streams_by_its_matrices():
    n, d = 3, 8
    hc = HyperConnection("dynamic", n, d, k=4, eps=1e-5).double()
    assert torch.equal(hc.static, torch.tensor([0, 1, 0, 1, 1, 1, *torch.eye(3).flatten()], dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every coefficient away from its init
        for p in hc.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    H = torch.randn(2, 5, n, d, generator=g, dtype=torch.float64)

    def branch(h):
        return torch.tanh(h) * 2

    # Zhu et al.'s dynamic hyper-connection, written with its matrices: A(H) = A + s tanh(norm(H) W)
    normed = F.rms_norm(H, (d,), eps=1e-5)
    A_m = hc.static[:n] + hc.gates[0] * torch.tanh(normed @ hc.proj[:, 0])  # (B, T, n)
    B = hc.static[n:2 * n] + hc.gates[1] * torch.tanh(normed @ hc.proj[:, 1])
    A_r = hc.static[2 * n:].view(n, n) + hc.gates[0] * torch.tanh(normed @ hc.proj[:, 2:])  # (B, T, n, n)
    h0 = torch.einsum("bts,btsd->btd", A_m, H)  # A_m^T H
    expected = torch.einsum("btsu,btsd->btud", A_r, H) + torch.einsum("bts,btd->btsd", B, branch(h0))  # A_r^T H + B^T T
    torch.testing.assert_close(hc(H, branch), expected, rtol=1e-12, atol=1e-12)


def test_mhc_keeps_the_stream_mixing_matrix_doubly_stochastic_after_training_steps():
    # 20 alternating normalizations: the rows sum to 1 to rounding, the columns to 1e-10 for logits spread as the
    # model's (its bias I plus gated terms); a spread of several units would need more iterations
    m = sinkhorn_knopp(0.5 * torch.randn(100, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    torch.testing.assert_close(m.sum(-1), torch.ones(100, 4, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(m.sum(-2), torch.ones(100, 4, dtype=torch.float64), rtol=0, atol=1e-10)

    # logits spanning ~200 (a trained H_res at rate 3e-2): exp underflows to a zero column, so normalizing exp'd
    # entries would give 0/0; the projection and its gradient stay finite, the rows still sum to 1 (float32 rounding)
    spread = (torch.tensor([0.0, -200.0, -200.0, -200.0]).repeat(4, 1) + 0.1 * torch.eye(4)).requires_grad_()
    m = sinkhorn_knopp(spread)
    m.square().sum().backward()
    assert torch.isfinite(m).all() and torch.isfinite(spread.grad).all()
    torch.testing.assert_close(m.sum(-1), torch.ones(4), rtol=0, atol=1e-6)

    torch.manual_seed(0)
    model = GPT(tiny(overrides={"residual_streams": 4, "hyper_connections": "mhc"}))
    # streams that start as equal copies barely move H_res in a few steps: start its coefficients away from their
    # init (each matrix's logits then span up to 3.6, max - min; at 5.5, 20 iterations leave columns 2e-4 from 1)
    with torch.no_grad():
        for block in model.blocks:
            for update in (block.attn, block.mlp):
                update.hyper.bias.add_(0.2 * torch.randn(update.hyper.bias.shape))
                update.hyper.proj.normal_(0, 0.05)
                update.hyper.gates.fill_(0.3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for step in range(5):
        model(tokens(seed=step), tokens(seed=step + 10))[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        model.apply_parameter_constraints()
    updates = [u for b in model.blocks for u in (b.attn, b.mlp)]
    streams = inputs_of(updates, lambda: model(tokens(seed=99)))
    for update, H in zip(updates, streams, strict=True):
        read, mix, write = update.hyper.coefficients(H)
        assert update.hyper.proj.abs().max() > 0.01  # trained away from its init: per-token matrices
        assert mix.std(dim=(0, 1)).max() > 0
        ones = torch.ones(mix.shape[:-1])
        # rows to rounding; columns to Sinkhorn-Knopp's convergence after 20 iterations (float32)
        torch.testing.assert_close(mix.sum(-1), ones, rtol=0, atol=1e-5)
        torch.testing.assert_close(mix.sum(-2), ones, rtol=0, atol=1e-5)
        assert (mix >= 0).all() and ((read > 0) & (read < 1)).all() and ((write > 0) & (write < 2)).all()


# ----------------------------------------------------------------------------- the nanochat row


def test_nanochat_has_no_learnable_norm_parameter_and_starts_as_nanochat_does():
    model = GPT(tiny(norm_scheme="nanochat", norm="rmsnorm", mlp="relu2", pos="rope", bias=False))
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == 1 + 2 * 3 + 2 * 3 + 1  # embedding, pre-norms, q and k, final
    assert all(not list(m.parameters()) for m in norms)
    assert not [n for n, _ in model.named_parameters() if "norm" in n]
    assert model.lm_head.weight is not model.wte.weight  # untied
    assert model.wte.weight.std().item() == pytest.approx(0.8, rel=0.05)  # nanochat's N(0, 0.8) and N(0, 0.001)
    assert model.lm_head.weight.std().item() == pytest.approx(0.001, rel=0.05)
    bound = math.sqrt(3 / 32)
    for block in model.blocks:
        attn, mlp = block.attn.sublayer, block.mlp.sublayer
        assert not attn.out_proj.weight.any() and not mlp.proj.weight.any()
        assert attn.q_proj.weight.abs().max() <= bound and attn.q_proj.weight.abs().max() > 0.9 * bound
        assert mlp.fc.weight.abs().max() <= 0.4 * bound and mlp.fc.weight.abs().max() > 0.36 * bound
        assert attn.scale == pytest.approx(1.44 / math.sqrt(16))  # q and k each times 1.2 after their norm
        assert mlp.act is relu2
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 10.0)
    assert model(tokens())[0].abs().max() <= 15.0  # the logit softcap


@pytest.mark.parametrize("kwargs, message", [
    (dict(overrides={"z_loss": -1.0}), "z_loss=-1.0"),
    (dict(overrides={"z_loss": math.inf}), "z_loss=inf must be a finite weight"),
    (dict(overrides={"residual_streams": 0}), "residual_streams=0 must be >= 1"),
    (dict(overrides={"logit_softcap": 0.0}), "logit_softcap=0.0"),
    (dict(overrides={"hyper_connections": "hc"}), "hyper_connections='hc'"),
    (dict(overrides={"residual_streams": 2}), "needs hyper_connections"),
    (dict(norm_scheme="post", overrides={"hyper_connections": "static"}), "replace the residual add"),
    (dict(norm_scheme="dnt", overrides={"qk_clip": 100.0}), "q/k norm undoes"),
    (dict(norm_scheme="ngpt", overrides={"x0_mix": True}), "on the sphere"),
    (dict(overrides={"attn_gate": "per_head"}), "attn_gate='per_head'"),
    (dict(norm_scheme="ngpt", overrides={"attn_sink": True}), "on the sphere"),
    (dict(norm_scheme="ngpt", overrides={"norms": "qk+v"}), "on the sphere"),
    (dict(norm_scheme="ngpt", embed_proj=True), "nor embed_proj"),
    (dict(norm_scheme="post", overrides={"combine": "attn_res"}), "combine='attn_res' reads"),
    (dict(overrides={"combine": "attn_res", "x0_mix": True}), "combine='attn_res' reads"),
    (dict(overrides={"norms": "pre+k+final", "qk_clip": 100.0}), "q/k norm undoes"),
])
def test_impossible_settings_of_the_new_columns_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GPTConfig(**kwargs)


# ----------------------------------------------------------------------------- properties each column guarantees


def scores_with_max(values: list[float], T: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, heads, T, T) scores whose largest causal entry in head h is values[h], and the causal mask."""
    scores = torch.full((1, len(values), T, T), -5.0)
    for h, value in enumerate(values):
        scores[0, h, T - 1, 0] = value
    return scores, torch.ones(T, T, dtype=torch.bool).tril()


def test_qk_clip_records_the_largest_logit_over_every_micro_batch_of_the_step():
    """Kimi K2: S_h is the largest logit of the step, so a later micro-batch with smaller logits keeps the earlier
    maximum (exact: a max of float32 values)."""
    model = GPT(tiny(n_layer=1, overrides={"qk_clip": 1.0}))
    clip = model.blocks[0].attn.sublayer.attend.clip
    clip.record(*scores_with_max([7.0, 2.0]))
    clip.record(*scores_with_max([3.0, 4.0]))
    assert clip.max_logit.tolist() == [7.0, 4.0]


def test_qk_clip_takes_the_largest_logit_over_all_ranks(monkeypatch):
    """Every rank clips by the maximum over all ranks' records (an all-reduce with MAX), so all ranks' weights stay
    equal: here another rank saw 9 in head 0, and head 0 is clipped by sqrt(tau / 9) on this rank too."""
    tau = 1.0
    model = GPT(tiny(n_layer=1, overrides={"qk_clip": tau}))
    clip = model.blocks[0].attn.sublayer.attend.clip
    clip.record(*scores_with_max([2.0, 0.5]))
    other_rank = torch.tensor([9.0, 0.1])
    seen = []

    def all_reduce(t, op):
        seen.append(op)
        t.copy_(torch.maximum(t, other_rank))

    monkeypatch.setattr(columns.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(columns.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(columns.dist, "all_reduce", all_reduce)
    q = clip.projections[0].weight.detach().clone()
    clip.constrain_()
    assert seen == [columns.dist.ReduceOp.MAX]
    rows = q.shape[0] // 2
    torch.testing.assert_close(clip.projections[0].weight[:rows], q[:rows] * math.sqrt(tau / 9.0), rtol=1e-6, atol=0)
    assert torch.equal(clip.projections[0].weight[rows:], q[rows:])  # head 1: 0.5 locally, 0.1 elsewhere, below tau


def test_a_skipped_step_leaves_no_qk_clip_record_behind():
    """A batch skipped as non-finite (skip_nonfinite) drops its recorded maxima: the next step's clip sees only its
    own forwards. train.skip_batch is what the loop calls for such a batch."""
    import types

    import train

    model = GPT(tiny(n_layer=2, overrides={"qk_clip": 1.0}))
    model(tokens(), tokens())  # a training forward records each head's largest logit
    clips = [b.attn.sublayer.attend.clip for b in model.blocks]
    assert all(torch.isfinite(c.max_logit).all() for c in clips)
    s = types.SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), raw_model=model,
                              scaler=torch.amp.GradScaler("cpu", enabled=False), skipped=0,
                              cfg=types.SimpleNamespace(skip_nonfinite=5))
    assert train.skip_batch(s) is None and s.skipped == 1
    assert all(torch.equal(c.max_logit, torch.full_like(c.max_logit, -math.inf)) for c in clips)


def test_qk_clip_with_manifold_muon_is_refused(data_dir, tmp_path):
    """The clip shrinks W_q, W_k off the Stiefel manifold and the retraction pulls them back: neither holds."""
    from conftest import tiny_run_args

    import train

    with pytest.raises(train.ConfigError, match="qk_clip with optimizer=manifold_muon"):
        train.train(tiny_run_args(data_dir, str(tmp_path / "run"), qk_clip=10.0, optimizer="manifold_muon"))
    assert not (tmp_path / "run").exists()


def test_every_block_mixes_the_first_blocks_values_not_the_previous_blocks():
    """ResFormer: v_1 is the first block's values for every later block, never a later block's mixed values."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=3, overrides={"value_residual": True}))
    attns = [b.attn.sublayer for b in model.blocks]
    with torch.no_grad():
        for attn in attns[1:]:
            attn.value_residual.lam.fill_(0.25)
    inputs = inputs_of(attns, lambda: model(tokens()))
    with torch.no_grad():
        values = [attn.heads(x)[2] for attn, x in zip(attns, inputs, strict=True)]
        ctx = {}
        attns[0].value_residual(values[0], ctx)
        mixed = [attn.value_residual(v, dict(ctx)) for attn, v in zip(attns[1:], values[1:], strict=True)]
    for v, m in zip(values[1:], mixed, strict=True):  # float32: one multiply-add
        torch.testing.assert_close(m, 0.25 * v + 0.75 * values[0], rtol=1e-6, atol=1e-7)
    # and the model's own forward passes block 0's values, unchanged, to block 2
    seen = []
    hook = attns[2].value_residual.register_forward_hook(lambda mod, args, out: seen.append(args[1]["v1"]))
    model(tokens())
    hook.remove()
    torch.testing.assert_close(seen[0], values[0], rtol=0, atol=0)


def test_nanochat_x0_is_the_normalized_embedding():
    """nanochat gpt.py: x = norm(wte(idx)); x0 = x. Its x0 has RMS 1 per token (a parameter-free RMSNorm; 1e-3
    allows for the norm's eps against embeddings of RMS ~0.8)."""
    torch.manual_seed(0)
    model = GPT(tiny(norm_scheme="nanochat", norm="rmsnorm", mlp="relu2", pos="rope", bias=False))
    seen = []
    hook = model.blocks[1].register_forward_pre_hook(lambda mod, args: seen.append(args[1]["x0"]))
    model(tokens())
    hook.remove()
    rms = seen[0].square().mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=1e-3)


def test_the_streams_are_summed_at_the_end():
    """Zhu et al. §3: the last hidden matrix summed over its rows (the n streams), not averaged."""
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(columns.reduce(columns.expand(x, 4)), 4 * x, rtol=0, atol=0)


def test_mhc_write_is_two_sigmoids_and_its_mix_is_gated_by_its_own_gate():
    """mHC: H_post = 2 sigmoid(a_post x phi_post + b_post), in (0, 2) and 1 at init; H_res's logits take a_res, not
    the read gate a_pre: with a_res = 0, H_res is Sinkhorn(b_res) whatever a_pre and phi are."""
    torch.manual_seed(0)
    conn = HyperConnection("mhc", 4, 8, 0, 1e-5)
    H = torch.randn(2, 3, 4, 8)
    read, mix, write = conn.coefficients(H)
    torch.testing.assert_close(write, torch.ones_like(write), rtol=0, atol=0)  # 2 sigmoid(0) = 1 exactly
    with torch.no_grad():
        conn.proj.normal_(0, 0.2)  # logits of std ~1 over the 32 normalized inputs
        conn.gates.copy_(torch.tensor([3.0, 1.0, 0.0]))
    read, mix, write = conn.coefficients(H)
    assert (write > 0).all() and (write < 2).all() and write.max() > 1.2 and write.min() < 0.8
    expected = sinkhorn_knopp(conn.bias[8:].view(4, 4)).expand_as(mix)
    torch.testing.assert_close(mix, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------- gated attention, sink, k/v norms


def with_row_weights(config: GPTConfig, row: GPTConfig, prepare=None) -> torch.Tensor:
    """The logits of a model of `config` that holds the weights of the row's model (drawn with seed 0; the column's
    own parameters keep their init), after `prepare(model)`: a column's parameters drawn at init shift the random
    draws of every module after them, so the row's weights are copied in."""
    torch.manual_seed(0)
    donor = GPT(row)
    torch.manual_seed(0)
    model = GPT(config)
    missing, unexpected = model.load_state_dict(donor.state_dict(), strict=False)
    assert not unexpected
    if prepare is not None:
        with torch.no_grad():
            prepare(model)
    return model(tokens(), tokens())[0]


def split_heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    return t.unflatten(-1, (n_head, -1)).transpose(1, 2)  # (B, T, d) -> (B, heads, T, head_dim)


@pytest.mark.parametrize("kind", ["headwise", "elementwise"])
def test_attention_gate_multiplies_each_heads_output_by_a_sigmoid_of_the_attention_input(kind):
    """Qiu et al. G1: Y' = Y * sigmoid(X W_theta), X the attention's input, Y the softmax's output per head, before
    W_O; headwise one gate per head, elementwise one per channel. float64: the same math in another order agrees to
    ~1e-15; 1e-12 allows for it."""
    torch.manual_seed(0)
    attn = GPT(tiny(n_layer=1, n_head=4, overrides={"attn_gate": kind})).double().blocks[0].attn.sublayer
    with torch.no_grad():
        attn.gate.proj.weight.normal_(0, 0.5)  # gates spread over (0, 1)
        attn.gate.proj.bias.normal_(0, 0.5)
    x = torch.randn(2, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q, k, v = (split_heads(F.linear(x, p.weight, p.bias), 4) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    y = reference_attention(q, k, v, 8**-0.5)
    gate = torch.sigmoid(F.linear(x, attn.gate.proj.weight, attn.gate.proj.bias))  # (B, T, 4) or (B, T, 32)
    assert gate.shape[-1] == (4 if kind == "headwise" else 32) and gate.min() < 0.2 and gate.max() > 0.8
    gated = y * (gate.transpose(1, 2).unsqueeze(-1) if kind == "headwise" else split_heads(gate, 4))
    expected = F.linear(gated.transpose(1, 2).flatten(-2), attn.out_proj.weight, attn.out_proj.bias)
    torch.testing.assert_close(attn(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["headwise", "elementwise"])
def test_attention_gate_of_ones_is_the_row(kind):
    """sigmoid(+inf) = 1 exactly: with the gate's map at 0 and its bias at +inf the row's logits, bit for bit."""
    def open_gates(model):
        for block in model.blocks:
            block.attn.sublayer.gate.proj.weight.zero_()
            block.attn.sublayer.gate.proj.bias.fill_(math.inf)

    assert torch.equal(with_row_weights(tiny(overrides={"attn_gate": kind}), tiny(), open_gates), logits_of(tiny()))


def softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """gpt-oss's definition: one more column holding the head's sink logit joins each row's softmax, then is dropped."""
    column = sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


@pytest.mark.parametrize("cap", [None, 5.0])  # the fused path, and the explicit one a softcap takes
def test_attention_sink_joins_each_softmax_and_is_dropped(cap):
    """The sink's logit joins the normalization (softmax over [scores, s_h], the sink's column dropped): computed as
    the plain output times sigmoid(logsumexp - s), the same numbers to float64 rounding (1e-12)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sink = columns.AttentionSink(3).double()
    with torch.no_grad():
        sink.logit.copy_(torch.tensor([2.0, -1.0, 0.5]))
    attend = model.Attention(8**-0.5, 0.0, cap=cap, sink=sink)
    scores = q @ k.transpose(-2, -1) * 8**-0.5
    scores = scores if cap is None else cap * torch.tanh(scores / cap)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    weights = softmax_with_sink(scores.masked_fill(~causal, -math.inf), sink.logit.detach())
    assert (weights.sum(-1) < 1 - 1e-3).all()  # every query gave the sink a share
    torch.testing.assert_close(attend.weights(q, k), weights, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attend(q, k, v), weights @ v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("row", [{}, {"attn_softcap": 30.0}])
def test_attention_sink_at_minus_infinity_is_the_row(row):
    """s = -inf takes no mass: the row's logits bit for bit, on the fused path and on the explicit one."""
    def no_sink(model):
        for block in model.blocks:
            block.attn.sublayer.attend.sink.logit.fill_(-math.inf)

    assert torch.equal(with_row_weights(tiny(overrides={**row, "attn_sink": True}), tiny(overrides=row), no_sink),
                       logits_of(tiny(overrides=row)))


@pytest.mark.parametrize("place", ["k", "v"])
def test_k_and_v_norms_normalize_only_their_own_heads(place):
    """norms `k` and `v`: RMSNorm of each head's keys (values) alone, with one gain per channel; the queries and the
    other projection are the plain maps. float64: 1e-12."""
    torch.manual_seed(0)
    attn = GPT(tiny(n_layer=1, n_head=4, overrides={"norms": f"pre+{place}+final"})).double().blocks[0].attn.sublayer
    normed = attn.k_norm if place == "k" else attn.v_norm
    assert isinstance(normed, nn.RMSNorm) and normed.weight.shape == (8,)
    other = attn.v_norm if place == "k" else attn.k_norm
    assert isinstance(attn.q_norm, nn.Identity) and isinstance(other, nn.Identity)
    with torch.no_grad():
        normed.weight.normal_(1, 0.5)
    x = torch.randn(2, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plain = [split_heads(F.linear(x, p.weight, p.bias), 4) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    i = "qkv".index(place)
    plain[i] = plain[i] / plain[i].square().mean(-1, keepdim=True).add(1e-5).sqrt() * normed.weight
    for got, want in zip(attn.heads(x), plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_k_and_v_places_compose_with_the_qk_and_qkv_places():
    """qk + v builds the norms qkv builds and qk + k those of qk, drawn alike: the same logits, bit for bit."""
    def logits(norms):
        return logits_of(tiny(overrides={"norms": norms}))

    assert torch.equal(logits("pre+qk+v+final"), logits("pre+qkv+final"))
    assert torch.equal(logits("pre+qk+k+final"), logits("pre+qk+final"))
    assert not torch.equal(logits("pre+k+final"), logits("pre+qk+final"))


# ----------------------------------------------------------------------------- SSNorm and EmbProj (OSP)


def test_ssnorm_is_rmsnorm_with_one_shared_gain_and_at_gain_one_the_rmsnorm_row():
    """OSP's SSNorm: g x / sqrt(mean(x^2) + eps), one learnable scalar g for every channel; at g = 1 the same as
    RMSNorm with its gains at 1, so the row with norm=rmsnorm at init, bit for bit."""
    norm = model.make_norm("ssnorm", 32, 2, 1e-5, True, 0.5).double()
    assert [p.shape for p in norm.parameters()] == [torch.Size([])]
    with torch.no_grad():
        norm.weight.fill_(1.7)
    x = 3 * torch.randn(4, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(norm(x), 1.7 * x / x.square().mean(-1, keepdim=True).add(1e-5).sqrt(),
                               rtol=1e-12, atol=1e-12)  # float64 rounding
    assert torch.equal(logits_of(tiny(norm="ssnorm")), logits_of(tiny(norm="rmsnorm")))


def test_embed_proj_maps_the_token_embedding_and_the_heads_input_and_at_the_identity_is_the_row():
    """OSP's EmbProj: x = R_1 e(token) + b_1 + p(position) into the first block, logits = W (R_2 N(x_L) + b_2);
    R_1, R_2 start orthogonal; at R = I, b = 0 the row's logits bit for bit (x I^T adds only exact zeros)."""
    torch.manual_seed(0)
    m = GPT(tiny(embed_proj=True)).double()
    for proj in (m.embed_in, m.head_in):
        torch.testing.assert_close(proj.weight @ proj.weight.T, torch.eye(32, dtype=torch.float64), rtol=0, atol=1e-6)
        with torch.no_grad():
            proj.bias.normal_(0, 0.1)
    idx = tokens()
    embedded = F.linear(m.wte(idx), m.embed_in.weight, m.embed_in.bias) + m.wpe(torch.arange(16))
    torch.testing.assert_close(m.embed(idx), embedded, rtol=1e-12, atol=1e-12)  # float64 rounding
    (last,) = inputs_of([m.final_norm], lambda: m(idx, idx))
    head_in = F.linear(m.final_norm(last), m.head_in.weight, m.head_in.bias)
    torch.testing.assert_close(m(idx, idx)[0], head_in @ m.wte.weight.T, rtol=1e-12, atol=1e-12)

    def identity(model):
        for proj in (model.embed_in, model.head_in):
            proj.weight.copy_(torch.eye(32))
            proj.bias.zero_()

    assert torch.equal(with_row_weights(tiny(embed_proj=True), tiny(), identity), logits_of(tiny()))


def test_embed_proj_maps_are_hidden_matrices_for_the_optimizers():
    """OSP trains R_1, R_2 with Muon, the embedding with AdamW: they are routed with the blocks' matrices."""
    import optim

    m = GPT(tiny(embed_proj=True))
    matrices = {id(p) for p in optim.split_params(m)["matrix"]}
    assert id(m.embed_in.weight) in matrices and id(m.head_in.weight) in matrices
    assert id(m.wte.weight) not in matrices


# ----------------------------------------------------------------------------- Attention Residuals


def test_attention_residuals_read_a_softmax_over_the_embedding_and_every_earlier_output():
    """Kimi's AttnRes, written out over two blocks (four updates): update j reads h_j = sum_i alpha_ij v_i with
    alpha_ij = softmax_i(w_j . RMSNorm(v_i)), v_0 the embedding and v_i update i's output (pre-norm, sub-layer);
    the head reads the same over all five sources with its own w. float64, pseudo-queries and key gains drawn away
    from their init: 1e-10 covers the rounding of the softmax-weighted sums."""
    torch.manual_seed(0)
    m = GPT(tiny(n_layer=2, overrides={"combine": "attn_res"})).double()
    readers = [u.combine for b in m.blocks for u in (b.attn, b.mlp)] + [m.read_out]
    with torch.no_grad():
        for r in readers:
            r.query.normal_(0, 1.0)
            r.key_gain.normal_(1, 0.3)
    idx = tokens()

    def read(r, sources):
        keys = [v / v.square().mean(-1, keepdim=True).add(1e-5).sqrt() * r.key_gain for v in sources]
        alpha = torch.softmax(torch.stack([key @ r.query for key in keys]), dim=0)  # (sources, B, T)
        assert len(sources) == 1 or alpha.min() < 0.9 / len(sources)  # the weights are not uniform
        return sum(a.unsqueeze(-1) * v for a, v in zip(alpha, sources, strict=True))

    sources = [m.embed(idx)]
    updates = [u for b in m.blocks for u in (b.attn, b.mlp)]
    for r, update in zip(readers, updates, strict=False):
        h = read(r, sources)
        sources.append(update.sublayer(update.pre_norm(h), {}) if update is updates[0] or update is updates[2]
                       else update.sublayer(update.pre_norm(h)))
    logits = m.lm_head(m.final_norm(read(m.read_out, sources)))
    torch.testing.assert_close(m(idx, idx)[0], logits, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scheme", ["pre", "sandwich"])
def test_attention_residuals_at_init_read_the_rows_sum_through_its_scale_invariant_norms(scheme):
    """No setting makes AttnRes the plain sum (its weights sum to 1); at init (w = 0) each update reads the mean of
    its j sources, the row's stream divided by j, and a norm without eps is blind to that factor: the row's
    logits to float64 rounding (1e-10), with norm_eps = 0. There is no bit-for-bit identity."""
    row = tiny(norm_scheme=scheme, norm_eps=0.0)
    attn_res = tiny(norm_scheme=scheme, norm_eps=0.0, overrides={"combine": "attn_res"})
    torch.testing.assert_close(logits_of(attn_res, dtype=torch.float64), logits_of(row, dtype=torch.float64),
                               rtol=1e-10, atol=1e-10)

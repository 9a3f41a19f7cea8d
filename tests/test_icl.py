"""Tests for the in-context least-squares task (icl_task.py, Bir et al. §4.1).

Statistical checks use a 5-sigma tolerance computed from the sample size, so a correct
implementation fails about once in 10^6 runs; all seeds are fixed, so runs are reproducible.
"""

import dataclasses
import inspect
import math
import re
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

import icl_task
from icl_task import (
    LeastSquaresTask,
    baseline_losses,
    condition_number,
    get_batch,
    icl_loss,
    least_squares_predictions,
    pair_errors,
    posterior_ridge,
    sample_well_conditioned,
    split_losses,
    token_dim,
    well_conditioned,
)
from nanonorm.train_config import TrainConfig

D = 5
# batches are drawn on the training device; CUDA's generator gives other numbers than the CPU's, so
# on CUDA only the statistical and reproducibility tests apply
DEVICES = ["cpu", pytest.param("cuda", marks=(pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")))]


def gen(seed: int = 0, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def at(tensor: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """tensor[b, pos[b, t]] for (B, S, F) and (B, T) -> (B, T, F)."""
    return tensor[torch.arange(tensor.shape[0])[:, None], pos]


# ----------------------------------------------------------------------------- layout

@pytest.mark.parametrize("order", ["xy", "yx"])
@pytest.mark.parametrize("bias_feature", [True, False])
def test_token_layout_flags_and_bias(order, bias_feature):
    B, T = 16, 8
    batch = get_batch(B, T, noise_std=0.0, order=order, bias_feature=bias_feature,
                      generator=gen())
    n_features = 13 if bias_feature else 12
    assert token_dim(D, bias_feature) == n_features
    assert batch.tokens.shape == (B, 2 * T, n_features) and batch.tokens.dtype == torch.float32
    assert batch.targets.shape == batch.X.shape == (B, T, D) and batch.W.shape == (B, D, D)
    assert batch.x_pos.dtype == torch.long and batch.order.shape == (B,)

    y_first = int(order == "yx")
    assert (batch.order == y_first).all()
    assert torch.equal(batch.x_pos, (2 * torch.arange(T) + y_first).expand(B, T))
    assert torch.equal(batch.y_pos, batch.x_pos + (-1 if y_first else 1))  # partner token
    x_tok, y_tok = at(batch.tokens, batch.x_pos), at(batch.tokens, batch.y_pos)
    assert (x_tok[..., 0] == 1).all() and (x_tok[..., 1] == 0).all()
    assert (y_tok[..., 0] == 0).all() and (y_tok[..., 1] == 1).all()
    assert torch.equal(x_tok[..., 2:2 + D], batch.X)  # noise_std=0: exact
    assert (x_tok[..., 2 + D:2 + 2 * D] == 0).all()
    assert (y_tok[..., 2:2 + D] == 0).all()
    assert torch.equal(y_tok[..., 2 + D:2 + 2 * D], batch.targets)
    if bias_feature:
        assert (batch.tokens[..., -1] == 1).all()
    # every position holds exactly one token kind
    assert torch.equal(batch.tokens[..., 0] + batch.tokens[..., 1], torch.ones(B, 2 * T))


def test_invalid_order_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="random"):
        get_batch(2, 8, order="xyx")


# ----------------------------------------------------------------------------- values

@pytest.mark.parametrize("device", DEVICES)
def test_noise_touches_only_x_values_of_x_tokens(device):
    noise_std, B, T = 0.01, 512, 16
    noisy = get_batch(B, T, noise_std=noise_std, generator=gen(1, device), device=device).to("cpu")
    clean = get_batch(B, T, noise_std=0.0, generator=gen(1, device), device=device).to("cpu")  # noise comes last
    assert torch.equal(noisy.X, clean.X) and torch.equal(noisy.targets, clean.targets)
    diff = noisy.tokens - clean.tokens
    x_slots = torch.zeros_like(diff, dtype=torch.bool)
    x_slots[torch.arange(B)[:, None], noisy.x_pos, 2:2 + D] = True
    assert (diff[~x_slots] == 0).all()  # flags, y slots, y-tokens and bias untouched
    noise = diff[x_slots].double()
    n = noise.numel()  # 40960 draws
    assert abs(noise.mean().item()) < 5 * noise_std / math.sqrt(n)
    # std estimate from n samples: relative error ~ 1/sqrt(2n) = 0.35%; float32 rounding of
    # x + noise (|x| ~ 1, eps 6e-8) is 1e-5 relative to the noise: negligible
    assert abs(noise.std().item() / noise_std - 1) < 5 / math.sqrt(2 * n)


def test_targets_are_X_times_W_and_y_tokens_carry_them_noise_free():
    batch = get_batch(64, 16, noise_std=0.1, generator=gen(2))
    assert torch.equal(batch.targets, batch.X @ batch.W)  # same float32 op: exact
    y_tok = at(batch.tokens, batch.y_pos)
    assert torch.equal(y_tok[..., 2 + D:2 + 2 * D], batch.targets)


@pytest.mark.parametrize("device", DEVICES)
def test_W_entries_have_variance_one_over_dim_and_X_entries_are_standard_normal(device):
    batch = get_batch(4096, 8, noise_std=0.0, generator=gen(3, device), device=device).to("cpu")
    for values, var in ((batch.W, 1 / D), (batch.X, 1.0)):
        v = values.double().flatten()
        n = v.numel()  # 102400 (W), 163840 (X)
        assert abs(v.mean().item()) < 5 * math.sqrt(var / n)
        # variance estimate: relative std sqrt(2/n) for Gaussian data
        assert abs(v.var().item() / var - 1) < 5 * math.sqrt(2 / n)


@pytest.mark.parametrize("device", DEVICES)
def test_random_order_is_a_fair_coin(device):
    n = 20000
    batch = get_batch(n, 5, generator=gen(4, device), device=device).to("cpu")
    # binomial: std of the fraction is 0.5 / sqrt(n) = 0.0035
    assert abs(batch.order.double().mean().item() - 0.5) < 5 * 0.5 / math.sqrt(n)
    assert torch.equal(batch.x_pos[:, 0], batch.order)  # x_1 at position 0 or 1


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_gives_same_batch_and_other_seed_a_different_one(device):
    a, b, c = (get_batch(32, 8, generator=gen(s, device), device=device) for s in (7, 7, 8))
    for name in ("tokens", "targets", "x_pos", "y_pos", "X", "W", "order", "resamples"):
        assert getattr(a, name).device.type == device, name  # drawn there, not copied over
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.tokens, c.tokens) and not torch.equal(a.W, c.W)


# ----------------------------------------------------------------------------- conditioning

@pytest.mark.parametrize("device", DEVICES)
def test_every_X_meets_kappa_max(device):
    kappa_max = 50.0
    batch = get_batch(2048, D, kappa_max=kappa_max, generator=gen(5, device), device=device).to("cpu")
    assert batch.resamples.sum() > 0  # square: often > 50
    assert (condition_number(batch.X) < kappa_max).all()  # the SVD's verdict, not the sampler's


def test_the_gram_test_of_conditioning_agrees_with_the_svd():
    # square Gaussians spread cond over decades (a third below 10, 99% below 1e3), and nearly repeating a
    # column puts it near 1e7 (median 8e6), so each threshold splits the draws; 1e7 takes the SVD path
    X = torch.randn(4096, D, D, generator=gen(19))
    near = X.clone()
    near[:, :, 1] = X[:, :, 0] + 1e-6 * X[:, :, 1]
    both = torch.cat([X, near])
    for kappa_max in (10.0, 20.0, 1e3, 1e6, 1e7):
        assert torch.equal(well_conditioned(both, kappa_max), condition_number(both) < kappa_max), kappa_max
    singular = X.clone()
    singular[:, :, 1] = X[:, :, 0]
    assert not well_conditioned(singular, 1e3).any()


def reference_draws(B: int, T: int, kappa_max: float, noise_std: float, g: torch.Generator):
    """The sampler as first written, kept to compare against (Bir et al. §4.1): X_b ~ N(0, 1) entries,
    redrawn until sigma_max / sigma_min < kappa_max by an SVD in float64, then W ~ N(0, 1/D), a fair
    coin for the order and N(0, noise_std^2) noise on x, in that order from one CPU generator."""
    def bad(X):
        s = torch.linalg.svdvals(X.double())
        return s[:, 0] / s[:, -1] >= kappa_max
    X = torch.randn(B, T, D, generator=g)
    redo, resamples = bad(X), torch.zeros(B, dtype=torch.long)
    while redo.any():
        idx = redo.nonzero().squeeze(1)
        X[idx] = torch.randn(len(idx), T, D, generator=g)
        resamples[idx] += 1
        redo[idx] = bad(X[idx])
    W = torch.randn(B, D, D, generator=g) / math.sqrt(D)
    order = torch.randint(0, 2, (B,), generator=g)
    return X, W, order, X + noise_std * torch.randn(B, T, D, generator=g), resamples


@pytest.mark.parametrize("B, T, kappa_max", [(256, 64, 1e3), (512, D, 20.0)])
def test_cpu_batches_are_the_reference_sampler_bit_for_bit(B, T, kappa_max):
    # the default setting (no redraws in practice) and a square one where 38% of X's are redrawn
    batch = get_batch(B, T, kappa_max=kappa_max, generator=gen(20))
    X, W, order, x_seen, resamples = reference_draws(B, T, kappa_max, 0.01, gen(20))
    assert torch.equal(batch.X, X) and torch.equal(batch.W, W) and torch.equal(batch.order, order)
    assert torch.equal(at(batch.tokens, batch.x_pos)[..., 2:2 + D], x_seen)
    assert torch.equal(batch.resamples, resamples)


@pytest.mark.parametrize("device", DEVICES)
def test_conditioned_X_has_the_reference_distribution(device):
    # Rejection shapes X's law; compare it with the reference's (other draws) by two statistics whose
    # difference of means has a known standard error: the share of X's redrawn at least once (binomial)
    # and the mean of log cond(X) (std estimated from both samples). 5 sigma on each, as in the rest of
    # the file; a 1.2x looser kappa_max lowers the share by 0.06, over 5 sigma (0.038).
    B, kappa_max = 8192, 20.0
    batch = get_batch(B, D, kappa_max=kappa_max, generator=gen(21, device), device=device).to("cpu")
    X_ref, _, _, _, resamples_ref = reference_draws(B, D, kappa_max, 0.01, gen(22))
    redrawn = (batch.resamples > 0).double().mean().item(), (resamples_ref > 0).double().mean().item()
    p = sum(redrawn) / 2  # about 0.38
    assert abs(redrawn[0] - redrawn[1]) < 5 * math.sqrt(p * (1 - p) * 2 / B)
    log_cond = condition_number(batch.X).log(), condition_number(X_ref).log()
    se = math.sqrt(sum(v.var().item() / B for v in log_cond))
    assert abs(log_cond[0].mean().item() - log_cond[1].mean().item()) < 5 * se


def test_condition_number_matches_torch_for_tall_X_and_is_infinite_for_wide_X():
    X = torch.randn(8, 16, D, generator=gen(6), dtype=torch.float64)
    torch.testing.assert_close(condition_number(X), torch.linalg.cond(X))
    assert torch.isinf(condition_number(X[:, :3])).all()  # 3 pairs, 5 unknowns per output


def test_rejection_redraws_only_the_bad_elements():
    B, kappa_max = 512, 20.0  # a square 5x5 Gaussian exceeds cond 20 a good part of the time
    first_draw = torch.randn(B, D, D, generator=gen(9))  # what the sampler draws first
    X, resamples = sample_well_conditioned(B, D, D, kappa_max, gen(9))
    bad_at_first = condition_number(first_draw) >= kappa_max
    assert 0 < bad_at_first.sum() < B
    assert torch.equal(resamples > 0, bad_at_first)  # redrawn iff bad at first
    assert torch.equal(X[~bad_at_first], first_draw[~bad_at_first])  # good ones kept as drawn
    assert not torch.equal(X[bad_at_first], first_draw[bad_at_first])
    assert (condition_number(X) < kappa_max).all()


def test_unreachable_kappa_raises_a_clear_error():
    with pytest.raises(RuntimeError, match="Raise kappa_max or n_pairs"):
        sample_well_conditioned(4, D, D, kappa_max=1.0001, generator=gen(), max_rounds=3)
    with pytest.raises(ValueError, match="n_pairs=3 < dim=5"):
        get_batch(4, 3, generator=gen())
    with pytest.raises(ValueError, match=">= 1"):
        get_batch(4, 8, kappa_max=0.5, generator=gen())
    assert get_batch(4, 3, kappa_max=None, generator=gen()).tokens.shape == (4, 6, 13)


# ----------------------------------------------------------------------------- loss

def test_icl_loss_is_zero_for_the_targets_and_dim_for_zeros():
    B, T = 4096, 16
    batch = get_batch(B, T, generator=gen(10))
    outputs = torch.randn(B, 2 * T, D, generator=gen(11))
    outputs[torch.arange(B)[:, None], batch.x_pos] = batch.targets
    assert icl_loss(outputs, batch).item() == 0.0  # y-position outputs are ignored
    zero = icl_loss(torch.zeros(B, 2 * T, D), batch).item()
    # E||x W||^2 = D. Per sequence the mean over t has variance Var(||W||_F^2) = 2 plus
    # 2 E||W^T W||_F^2 / T = 2 (2D + 1) / 16 = 1.4; the batch mean has std sqrt(3.4 / B)
    assert abs(zero - D) < 5 * math.sqrt(3.4 / B)
    outputs.requires_grad_(True)
    icl_loss(outputs, batch).backward()
    assert outputs.grad is not None


def test_split_losses_parts_average_to_the_total():
    B, T = 256, 12
    batch = get_batch(B, T, generator=gen(12))
    outputs = torch.randn(B, 2 * T, D, generator=gen(13))
    split = split_losses(outputs, batch)
    assert split["n_xy"] + split["n_yx"] == B and split["n_xy"] == int((batch.order == 0).sum())
    weighted = (split["n_xy"] * split["xy"] + split["n_yx"] * split["yx"]) / B
    total = icl_loss(outputs, batch).item()
    # float32 loss vs float64 summaries: agree to float32 rounding
    assert weighted == pytest.approx(total, rel=1e-6)
    assert split["all"] == pytest.approx(total, rel=1e-6)
    assert split["per_t"].shape == (T,)
    assert split["per_t"].mean().item() == pytest.approx(total, rel=1e-6)


def test_wrong_output_shape_is_rejected():
    batch = get_batch(4, 8, generator=gen())
    with pytest.raises(ValueError, match="out_features=5"):
        icl_loss(torch.zeros(4, 16, 13), batch)


# ----------------------------------------------------------------------------- baselines

def test_least_squares_prefix_fits_match_lstsq():
    batch = get_batch(64, 12, noise_std=0.05, generator=gen(14))
    xs = at(batch.tokens, batch.x_pos)[..., 2:2 + D].double()
    ys = batch.targets.double()
    ols, ridge = least_squares_predictions(batch), least_squares_predictions(batch, 0.3)
    eye = torch.eye(D, dtype=torch.float64)
    for t in (1, 3, D, D + 1, 11):
        Xp, Yp = xs[:, :t], ys[:, :t]
        # gelsd returns the minimum-norm solution when t < D
        w_ols = torch.linalg.lstsq(Xp, Yp, driver="gelsd").solution
        w_ridge = torch.linalg.solve(Xp.mT @ Xp + 0.3 * eye, Xp.mT @ Yp)
        x_t = xs[:, t:t + 1]
        # float32 output; at t = D the noisy square system can have cond ~1e3, hence 1e-4
        torch.testing.assert_close(ols[:, t], (x_t @ w_ols)[:, 0].float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ridge[:, t], (x_t @ w_ridge)[:, 0].float())
    assert (ols[:, 0] == 0).all() and (ridge[:, 0] == 0).all()


def test_ols_is_exact_once_dim_pairs_are_seen_without_noise():
    batch = get_batch(512, 24, noise_std=0.0, order="xy", generator=gen(15))
    err = pair_errors(least_squares_predictions(batch), batch)
    # y is float32 (relative rounding 6e-8) and the prefix fit amplifies it by cond(X_<t),
    # rarely above 1e3 at t = D: squared errors ~1e-9 at worst on average
    assert err[:, D:].mean(0).max().item() < 1e-6
    assert err[:, :D].mean(0).min().item() > 0.5  # before that the fit cannot be exact


def test_min_norm_error_is_dim_minus_t_before_dim_pairs():
    B = 8192
    batch = get_batch(B, 16, noise_std=0.0, order="xy", generator=gen(16))
    err = pair_errors(least_squares_predictions(batch), batch).double()
    for t in range(D):
        k = D - t
        # error = ||W^T (I - P_t) x_t||^2 with ||(I - P_t) x_t||^2 ~ chi2_k and W^T u given u
        # ~ N(0, |u|^2/D I_D): mean k, second moment k(k+2) D(D+2) / D^2
        var = k * (k + 2) * (D + 2) / D - k**2
        assert abs(err[:, t].mean().item() - k) < 5 * math.sqrt(var / B), t


def test_min_norm_fit_is_the_noise_free_limit_of_the_posterior_mean():
    # ridge lambda is the posterior mean of W under the prior N(0, 1/D) with y-noise variance
    # lambda / D; as lambda -> 0 it must tend to the min-norm fit used while t < D
    batch = get_batch(256, 8, noise_std=0.0, generator=gen(17))
    min_norm = least_squares_predictions(batch)[:, :D]
    near_zero_ridge = least_squares_predictions(batch, 1e-9)[:, :D]
    # the gap is O(lambda / sigma_min(X_<t)^2); a t x D Gaussian prefix with t < D has
    # sigma_min well away from 0, so 1e-9 leaves only float32 rounding
    torch.testing.assert_close(near_zero_ridge, min_norm)


def test_zero_baseline_scores_dim_and_copy_aware_best_is_half_the_xy_best():
    B = 4096
    batch = get_batch(B, 32, noise_std=0.0, generator=gen(18))
    base = baseline_losses(batch)
    assert abs(base["zero"]["all"] - D) < 5 * math.sqrt(3.4 / B)  # as in the icl_loss test
    assert base["ridge_lambda"] == 0.0  # clean tokens: the posterior mean is the min-norm fit
    assert base["ridge"]["all"] == base["ols"]["all"]
    copy = base["copy_aware"]
    assert copy["yx"] == 0.0 and copy["xy"] == pytest.approx(base["ols"]["xy"])
    assert copy["all"] == pytest.approx(copy["n_xy"] * copy["xy"] / B)
    # best xy loss: sum_t (D - t) / T over t < D = 15 / 32; its std is < 0.02 here
    assert copy["xy"] == pytest.approx(15 / 32, abs=0.03)


# ----------------------------------------------------------------------------- training adapter

class ZeroModel(torch.nn.Module):
    """Stands in for the GPT in vector mode: (B, S, F) -> ((B, S, D) outputs, None)."""

    def forward(self, tokens):
        return torch.zeros(*tokens.shape[:2], D), None


def task_config() -> SimpleNamespace:
    return SimpleNamespace(icl_pairs=8, eval_iters=3, batch_size=32, seed=5)


@pytest.mark.parametrize("device", DEVICES)
def test_training_batches_depend_only_on_iteration_and_index(device):
    task = LeastSquaresTask(task_config(), {}, device)
    assert task.train_batch(3, 1).tokens.device.type == task.eval_sets["val"][0].W.device.type == device
    assert task.model_defaults == {"in_features": 13, "out_features": D, "embed_fan_in": 7,
                                   "block_size": 16}
    assert torch.equal(task.train_batch(3, 1).tokens, task.train_batch(3, 1).tokens)
    assert not torch.equal(task.train_batch(3, 1).tokens, task.train_batch(3, 2).tokens)
    assert not torch.equal(task.train_batch(3, 1).tokens, task.train_batch(4, 1).tokens)
    ranks = [task.eval_batches("val", SimpleNamespace(rank=r, world_size=2)) for r in (0, 1)]
    assert len(ranks[0]) + len(ranks[1]) == 3  # the fixed eval set is shared out, not repeated


def test_task_metrics_are_finite_floats_for_a_forced_order():
    # train.py treats any non-finite float metric as divergence: an absent order must be left
    # out, not reported as nan
    task = LeastSquaresTask(task_config(), {}, "cpu", order="xy")
    metrics = task.extra_metrics(ZeroModel(), nullcontext())
    assert "val_yx_loss" not in metrics
    floats = [v for v in metrics.values() if isinstance(v, float)]
    assert floats and all(math.isfinite(v) for v in floats)
    assert len(metrics["val_loss_per_t"]) == 8
    zero_loss = task.loss(ZeroModel(), task.train_batch(0, 0)).item()
    # 32 sequences: std sqrt(3.4 / 32) = 0.33 (see the icl_loss test), so 2.5 is over 5 sigma
    assert abs(zero_loss - D) < 2.5


def test_the_demo_leaves_out_pair_counts_below_the_dimension(monkeypatch):
    asked, draw, baselines = [], icl_task.get_batch, icl_task.baseline_losses
    monkeypatch.setattr(icl_task, "leak_table", lambda n_seq, dim, counts, g: asked.append(counts) or {})
    # fast stand-ins where 70 dimensions are slow: no redraws of X, the baselines on the first 3 pairs
    monkeypatch.setattr(icl_task, "get_batch", lambda *a, **k: draw(*a, **k, kappa_max=None))
    monkeypatch.setattr(icl_task, "baseline_losses", lambda batch: baselines(icl_task.get_batch(2, 3, dim=2)))
    monkeypatch.setattr(sys, "argv", ["icl_task.py", "--dim", "70", "--n_pairs", "70", "--batch_size", "2"])
    icl_task.main()  # 64 pairs cannot be drawn well conditioned in 70 dimensions
    assert asked == [[70, 128]]


@pytest.mark.parametrize("seed", ["-1", str(2**32), "99999999999999999999"])
def test_the_demo_refuses_a_seed_train_py_refuses(monkeypatch, capsys, seed):
    monkeypatch.setattr(sys, "argv", ["icl_task.py", "--seed", seed])
    with pytest.raises(SystemExit) as stop:
        icl_task.main()
    assert stop.value.code == 2
    assert re.search(rf"error: --seed {seed} must lie in \[0, 2\*\*32\)", capsys.readouterr().err)


# ----------------------------------------------------------------------------- eval sets, noise, bounds

def small_task(device: str = "cpu", **changes) -> LeastSquaresTask:
    """The task as train.py builds it from TrainConfig's defaults, at a tiny size."""
    cfg = dataclasses.replace(TrainConfig(), **{**dict(batch_size=16, icl_pairs=8, eval_iters=4), **changes})
    return LeastSquaresTask(cfg, {}, device)


@pytest.mark.parametrize("device", DEVICES)
def test_eval_sets_are_independent_of_each_other_and_of_the_first_training_batches(device):
    # "val" picks checkpoints and "train" reports the fit: both must be draws of their own, and a set
    # that repeats training batches would score memorized sequences. Independent draws of W are never
    # equal, so any equal pair means a shared random stream.
    task = small_task(device)
    train_set, val_set = task.eval_sets["train"], task.eval_sets["val"]
    assert len(train_set) == len(val_set) == 4
    seen = [task.train_batch(i, k) for i in range(4) for k in range(4)]
    for a in train_set:
        for b in val_set:
            assert not torch.equal(a.W, b.W) and not torch.equal(a.tokens, b.tokens)
    for e in train_set + val_set:
        for s in seen:
            assert not torch.equal(e.W, s.W) and not torch.equal(e.tokens, s.tokens)


def test_default_noise_is_spec_value_and_training_batches_carry_it_on_x_only():
    # Bir et al. §4.1: N(0, 0.01^2) noise on the x values stored in x-tokens; targets noise-free
    assert inspect.signature(icl_task.get_batch).parameters["noise_std"].default == 0.01
    task = small_task(batch_size=256, icl_pairs=16, eval_iters=1)
    for batch in (task.train_batch(0, 0), task.eval_sets["val"][0]):
        x_seen = at(batch.tokens, batch.x_pos)[..., 2:2 + D]
        y_seen = at(batch.tokens, batch.y_pos)[..., 2 + D:2 + 2 * D]
        assert torch.equal(y_seen, batch.X @ batch.W)  # y exactly linear in the clean x (same float32 op)
        noise = (x_seen - batch.X).double().flatten()
        n = noise.numel()  # 20480 draws: the std estimate has relative error 1/sqrt(2n) = 0.5%
        assert abs(noise.std().item() / 0.01 - 1) < 5 / math.sqrt(2 * n)
        assert abs(noise.mean().item()) < 5 * 0.01 / math.sqrt(n)


def test_posterior_ridge_is_dim_times_noise_variance():
    # noise e ~ N(0, s^2 I) on x turns y = x W into y = x_seen W - e W: per y coordinate a noise of
    # variance s^2 * E sum_j W_jk^2 = s^2 * D * (1/D) = s^2. With the prior W ~ N(0, 1/D) the posterior
    # mean is ridge with lambda = noise variance / prior variance = s^2 / (1/D) = D s^2.
    assert posterior_ridge(5, 0.01) == pytest.approx(5 * 0.01**2, rel=1e-12)
    assert posterior_ridge(3, 0.2) == pytest.approx(3 * 0.2**2, rel=1e-12)
    assert posterior_ridge(8, 0.0) == 0.0


def test_logged_bounds_are_pooled_over_every_sequence_and_pair_of_the_val_set():
    # best_xy_loss: the posterior-mean ridge (lambda = D s^2) averaged over every (b, t) of every xy
    # sequence in the val set; best_loss: the same with yx pairs (copyable) scoring 0, over all sequences
    task = small_task(icl_pairs=12)
    lam = D * 0.01**2
    best_xy, best_all, ridge_all = [], [], []
    for batch in task.eval_sets["val"]:
        err = pair_errors(least_squares_predictions(batch, lam), batch).double()
        xy = batch.order == 0
        best_xy.append(err[xy])
        best_all.append(torch.where(xy[:, None], err, torch.zeros_like(err)))
        ridge_all.append(err)
    n_xy = [len(e) for e in best_xy]
    assert len(set(n_xy)) > 1  # unequal xy counts per batch, so the pooling weights matter
    # the same float32 errors averaged in float64 in another grouping: rounding only
    assert task.bounds["best_xy_loss"] == pytest.approx(torch.cat(best_xy).mean().item(), rel=1e-9)
    assert task.bounds["best_loss"] == pytest.approx(torch.cat(best_all).mean().item(), rel=1e-9)
    assert task.bounds["ridge_loss"] == pytest.approx(torch.cat(ridge_all).mean().item(), rel=1e-9)

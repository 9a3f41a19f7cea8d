"""sweep.py's comparison rules (README, Comparing runs) and its guards on input and on files already written, on
synthetic runs and summaries: no training."""

import json
import math
import os
import pathlib
import signal
import statistics
from dataclasses import asdict

import pytest
import torch
from conftest import ROOT

import plot
import sweep
import train
from model import GPTConfig
from nanonorm import verdict as rule
from nanonorm.run_files import OutDirLock

CONFIG = os.path.join(ROOT, "configs", "cpu_base.py")
ICL = os.path.join(ROOT, "configs", "icl_small_lipschitz_muon.py")
RATES = ["1e-4", "3e-4", "1e-3", "3e-3", "1e-2"]
SETUP = {"n_layer": 2, "n_embd": 16, "block_size": 32, "task": "lm", "data": "shakespeare_char",
         "dataset": "shakespeare_char", "batch_size": 4, "max_iters": 300, "optimizer": "adamw", "seeds": 3}


LOWER = [({}, "lower", 0.0)]  # every point claimed lower than the baseline, by any amount


SELECT = [0, 100, 101]  # three selection seeds, as a decisive word needs


def lr_sweep(root, losses: dict, setup: dict = SETUP, baseline: str | None = "pre", claims: list | None = LOWER,
             select: list[int] = SELECT, unigram: float | None = None) -> list[dict]:
    """Write root/summary.json as `sweep.py --lr_grid` would for `losses` = {scheme: {rate: [loss on each selection
    seed, then on held-out seeds 1, 2, ...]}} (None: diverged, "crash": crashed), picking each scheme's best rate
    on the selection seeds; returns the point table."""
    outcome = {None: (5, 3), "crash": (None, 1)}  # loss -> (diverged_at, exit_code)
    seeded = [(scheme, lr, seed, x) for scheme, by_rate in losses.items() for lr, xs in by_rate.items()
              for seed, x in [*((s, xs[0]) for s in select), *enumerate(xs[1:], start=1)]]
    rows = [{"norm_scheme": scheme, "learning_rate": lr, "seed": seed, "val_loss": x if x not in outcome else None,
             "out_dir": f"norm_scheme={scheme},learning_rate={lr},seed={seed}",
             "wall_s": 1.0, "diverged_at": outcome.get(x, (None, 0))[0], "exit_code": outcome.get(x, (None, 0))[1]}
            for scheme, lr, seed, x in seeded]
    choice = [{"norm_scheme": scheme, **sweep.pick_best([r for r in rows if r["norm_scheme"] == scheme
                                                         and r["seed"] in select], "learning_rate", unigram=unigram)}
              for scheme in losses]
    table = sweep.lr_table(rows, choice, ["norm_scheme"], "learning_rate", baseline and {"norm_scheme": baseline},
                           claims, select, unigram, setup=setup)
    os.makedirs(root, exist_ok=True)
    sweep.write_lr_summary(str(root), rows, table, ["norm_scheme"], "learning_rate", [], "synthetic",
                           {"select_seeds": select, "setup": setup, "settings": {}, "unigram_loss": unigram,
                            "swept": ["norm_scheme", "learning_rate"]})
    return table


def curve(best: str, at_best: list[float], rates: list[str] = RATES) -> dict[str, list[float]]:
    """Selection seed 0 at every rate (the loss rising away from `best`), the held-out seeds at `best`."""
    centre = rates.index(best)
    return {lr: at_best if lr == best else [at_best[0] + 0.1 * abs(i - centre)] for i, lr in enumerate(rates)}


PRE = [2.0, 2.02, 1.98, 2.01, 1.99, 2.0]  # seed 0, then five held-out seeds
POST = [2.5, 2.52, 2.48, 2.51, 2.49, 2.5]


def finished_run(out_dir, argv: list[str], max_iters: int = 4, exit_code: int = 0,
                 settings: dict | None = None) -> None:
    """A run folder as a finished sweep run leaves it: an evaluation at max_iters and its run.json (with the
    resolved settings a sweep records, if given)."""
    os.makedirs(out_dir)
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"kind": "eval", "iter": max_iters, "train_loss": 2.0, "val_loss": 2.1}) + "\n")
    info = {"point": {"seed": 1}, "argv": argv, "exit_code": exit_code, "wall_s": 1.0}
    with open(os.path.join(out_dir, "run.json"), "w") as f:
        json.dump({**info, **({"settings": settings} if settings is not None else {})}, f)


def recorded_settings(argv: list[str]) -> dict:
    """The settings run.json records of a run of argv: model keys over GPTConfig's defaults, then the training
    settings, but for where the run writes, how it starts, logs and runs (sweep.BOOKKEEPING_KEYS), as JSON stores
    them."""
    cfg, model_args = train.load_config(argv)
    settings = {**asdict(GPTConfig()), **model_args, **asdict(cfg)}
    return json.loads(json.dumps({k: v for k, v in settings.items() if k not in sweep.BOOKKEEPING_KEYS}))


def saved_settings(path, argv: list[str]) -> None:
    """A checkpoint file holding only the settings train.py saves with the weights, as plot.run_config reads them."""
    cfg, model_args = train.load_config(argv)
    torch.save({"model_args": {**asdict(GPTConfig()), **model_args}, "config": asdict(cfg)}, path)


def one_line_error(capsys, pattern: str) -> None:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and pattern in err, err


# ----------------------------------------------------------------------------- the verdict rule's conditions


BASE = [2.00, 2.02, 1.98, 2.01, 1.99]  # five held-out seeds of a baseline


def shifted(by: list[float] | float, base: list[float] = BASE) -> list[float]:
    """The baseline's seeds moved seed by seed (a list) or all alike (a number)."""
    return [b + d for b, d in zip(base, by if isinstance(by, list) else [by] * len(base), strict=True)]


NOISE = [0.08, -0.06, 0.10, -0.09, 0.02]  # per-seed differences with a spread of 0.08 and a mean of 0.01


def test_a_clear_win_is_reproduced():
    v = sweep.verdict(shifted([-0.20, -0.21, -0.19, -0.20, -0.20]), BASE, "lower", 0.05, paired=True)
    assert v["verdict"] == "reproduced" and v["diff"] == pytest.approx(-0.2) and v["n"] == (5, 5)
    assert v["ci"][1] < 0 and v["ci"][0] < -0.05 and v["p"] < 0.05 and v["seeds_needed"] is None
    assert sweep.verdict(shifted(0.2), BASE, "higher", 0.05)["verdict"] == "reproduced"  # claimed higher, and is
    assert sweep.verdict(shifted(-0.2), BASE, "higher", 0.05)["verdict"] == "contradicted"


def test_a_consistent_gain_far_below_delta_is_smaller_than_claimed():
    """0.0005 nats on every seed, with a spread of 1e-5: certain, and a hundred times smaller than the 0.05 the
    paper claims, so not a decisive word for the claim either way."""
    tiny = shifted([-0.0005 + e for e in (1e-5, -1e-5, 2e-5, 0.0, -2e-5)])
    v = sweep.verdict(tiny, BASE, "lower", 0.05, paired=True)
    assert v["verdict"] == "smaller than claimed" and -0.0006 < v["ci"][0] < v["ci"][1] < -0.0004
    assert sweep.verdict(tiny, BASE, "lower", 0.0, paired=True)["verdict"] == "reproduced"  # no effect size claimed


def test_a_clear_loss_is_contradicted():
    v = sweep.verdict(shifted(0.2), BASE, "lower", 0.05)  # Welch: the arms share no seeds
    assert v["verdict"] == "contradicted" and v["ci"][0] > 0 and v["test"] == "Welch's t"
    # an interval that holds 0 but ends below δ rules the claimed effect out too
    near = sweep.verdict(shifted([0.004, -0.003, 0.006, -0.005, 0.001]), BASE, "lower", 0.05, paired=True)
    assert near["verdict"] == "contradicted" and near["ci"][0] < 0 < near["ci"][1] < 0.05


def test_noise_is_inconclusive_with_the_seeds_its_mde_needs():
    v = sweep.verdict(shifted(NOISE), BASE, "lower", 0.05, paired=True)
    assert v["verdict"] == "inconclusive at this scale" and v["ci"][0] < -0.05 and v["ci"][1] > 0
    se = v["sd"] / math.sqrt(5)
    assert v["mde"] == pytest.approx((2.776 + 0.941) * se, rel=1e-3)  # t(0.975, 4) and t(0.8, 4) from a t table
    n = v["seeds_needed"]  # the fewest seeds per arm whose mde, at this spread, reaches δ
    assert 5 < n < 100 and rule.mde(v["sd"] / math.sqrt(n), n - 1) <= 0.05 < rule.mde(v["sd"] / math.sqrt(n - 1),
                                                                                          n - 2)
    no_delta = sweep.verdict(shifted(NOISE), BASE, "lower", paired=True)  # δ = 0: the seeds to see the observed Δ
    assert no_delta["seeds_needed"] > n and f"about {no_delta['seeds_needed']} seeds" in rule.verdict_text(no_delta)


def test_on_par_is_equivalence_within_the_margin():
    inside = sweep.verdict(shifted([0.001, -0.001, 0.002, 0.0, -0.002]), BASE, "on_par", 0.05, paired=True)
    assert inside["verdict"] == "reproduced" and -0.05 < inside["ci"][0] < inside["ci"][1] < 0.05
    outside = sweep.verdict(shifted(0.2), BASE, "on_par", 0.05, paired=True)
    assert outside["verdict"] == "contradicted" and outside["ci"][0] > 0.05
    noisy = sweep.verdict(shifted(NOISE), BASE, "on_par", 0.05, paired=True)
    assert noisy["verdict"] == "inconclusive at this scale" and noisy["seeds_needed"] > 5
    with pytest.raises(ValueError, match="margin"):
        sweep.verdict(BASE, BASE, "on_par")


def test_a_row_without_a_claim_gets_a_description_not_a_verdict():
    assert sweep.verdict(shifted(-0.2), BASE, None)["verdict"] == "lower"
    assert sweep.verdict(shifted(0.2), BASE, None)["verdict"] == "higher"
    assert sweep.verdict(shifted(NOISE), BASE, None, paired=True)["verdict"] == "not distinguishable"
    two = sweep.verdict([1.0, 1.01], [2.0, 2.02], None)  # a description needs no five seeds; a verdict would
    assert two["verdict"] == "lower" and sweep.verdict([1.0, 1.01], [2.0, 2.02], "lower")["verdict"] == \
        "inconclusive at this scale"
    assert sweep.verdict([math.inf] * 5, BASE, None)["verdict"] == "higher"  # diverging: the higher loss


def test_a_decisive_word_needs_five_held_out_seeds_in_each_arm():
    four = sweep.verdict(shifted(-0.2, BASE[:4]), BASE[:4], "lower")
    assert four["verdict"] == "inconclusive at this scale" and four["n"] == (4, 4) and "5 held-out" in four["reason"]
    assert four["p"] < 0.05 and four["seeds_needed"] == 5  # the test's numbers stay in the result
    assert sweep.verdict(shifted(-0.2), BASE, "lower")["verdict"] == "reproduced"


def test_divergence_is_k_of_n_per_arm_compared_by_fishers_exact_test():
    three = sweep.verdict([math.inf] * 3, BASE[:3], "lower")
    assert three["p_diverged"] == pytest.approx(0.1) and three["verdict"] == "inconclusive at this scale"
    five = sweep.verdict([math.inf] * 5, BASE, "lower")
    assert five["p_diverged"] == pytest.approx(1 / 126) and five["verdict"] == "contradicted"  # 2 / C(10, 5)
    assert sweep.verdict(BASE, [math.inf] * 5, "lower")["verdict"] == "reproduced"
    assert sweep.verdict([math.inf] * 5, BASE, "higher", 0.05)["verdict"] == "reproduced"
    assert sweep.verdict([math.inf] * 5, BASE, "on_par", 0.05)["verdict"] == "contradicted"
    # one of six: not told apart (p = 1), so the losses decide over the five seeds where both finished
    six = [*BASE, 2.0]
    one = sweep.verdict([math.inf, *shifted(-0.2, six)[1:]], six, "lower", 0.05, paired=True)
    assert one["verdict"] == "reproduced" and one["p_diverged"] == pytest.approx(1.0)
    assert one["diff"] == pytest.approx(-0.2) and "diverged on 1 of 6" in one["reason"]


GAIN = [-0.02, -0.05, -0.01, -0.04, -0.005]  # a gain with p between 0.05 / 3 and 0.05 (paired)


def test_holm_corrects_within_a_family():
    assert rule.holm([0.01, 0.02, 0.03, 0.04]) == [True, False, False, False]  # each < 0.05 alone
    assert rule.holm([0.04, 0.01, 0.02]) == [True, True, True]  # Bonferroni (0.05 / 3) would keep only 0.01
    assert rule.holm_adjusted([0.01, 0.02, 0.03, 0.04]) == pytest.approx([0.04, 0.06, 0.06, 0.06])
    alone = sweep.verdict(shifted(GAIN), BASE, "lower", paired=True)
    assert alone["verdict"] == "reproduced" and 0.05 / 3 < alone["p_word"] < 0.05
    family = rule.correct_family([alone, alone, sweep.verdict(shifted(-0.3), BASE, "lower", paired=True), None])
    assert [v and v["verdict"] for v in family] == ["inconclusive at this scale"] * 2 + ["reproduced", None]
    assert family[0]["family_size"] == 3 and "Holm" in rule.verdict_text(family[0])


def test_tables_apply_holm_over_their_rows(tmp_path):
    arms = {"pre": curve("1e-3", [2.0, *BASE]), **{s: curve("1e-3", [2.0, *shifted(GAIN)]) for s in ("a", "b")}}
    table = lr_sweep(tmp_path, arms)
    assert all(row["verdict"].startswith("inconclusive at this scale") for row in table[1:])
    assert "Holm-adjusted p" in table[1]["verdict"]
    assert lr_sweep(tmp_path / "one", {s: arms[s] for s in ("pre", "a")})[1]["verdict"].startswith("reproduced")
    board = sweep.leaderboard([str(tmp_path)], {"norm_scheme": "pre"}, LOWER)
    assert sum(row.get("verdict", "").startswith("inconclusive") for row in board) == 2


def test_leaderboard_rows_are_described_unless_their_claim_is_given(tmp_path, capsys):
    geo = shifted([-0.2, -0.2, -0.21, -0.19, -0.2, -0.2], PRE)
    lr_sweep(tmp_path, {"pre": curve("1e-3", PRE), "post": curve("1e-3", POST), "geo": curve("1e-3", geo)})
    board = {row["label"]: row for row in sweep.leaderboard([str(tmp_path)], {"norm_scheme": "pre"})}
    assert board["norm_scheme=post"]["claim"] == "none" and board["norm_scheme=post"]["verdict"].startswith("higher")
    assert board["norm_scheme=geo"]["verdict"].startswith("lower")
    claims = [({"norm_scheme": "geo"}, "lower", 0.05)]  # only geo's paper claims anything against Pre-Norm
    board = {row["label"]: row for row in sweep.leaderboard([str(tmp_path)], {"norm_scheme": "pre"}, claims)}
    geo, post = board["norm_scheme=geo"], board["norm_scheme=post"]
    assert (geo["claim"], geo["delta"], geo["n_seeds"]) == ("lower", 0.05, (5, 5))
    assert geo["verdict"].startswith("reproduced") and geo["ci"][1] < 0 and geo["mde"] > 0
    assert post["verdict"].startswith("higher") and post["delta"] is None
    assert sweep.main(["--leaderboard", str(tmp_path), "--baseline", "norm_scheme=pre",
                       "--row_claim", "norm_scheme=geo:lower:0.05"]) == 0
    out = capsys.readouterr().out
    for header in ("claim", "δ", "Δ vs baseline", "95% interval of Δ", "mde (80% power)", "| n "):
        assert header in out, out
    assert "5 vs 5" in out and "| lower " in out and "| none " in out


@pytest.mark.parametrize("flags, message", [
    (["--row_claim", "norm_scheme=geo"], "write POINT:CLAIM"),
    (["--row_claim", "norm_scheme=geo:better"], "choose lower, higher, on_par or none"),
    (["--row_claim", "norm_scheme=geo:lower:-1"], "give a number >= 0"),
    (["--claim", "on_par"], "on_par needs its margin"),
    (["--claim", "none", "--delta", "0.05"], "claim none tests no effect"),
    (["--lr_seeds", "2"], "--lr_seeds is replaced by --select_seeds"),
])
def test_bad_claims_exit_2_with_one_line(tmp_path, capsys, flags, message):
    lr_sweep(tmp_path, {"pre": curve("1e-3", PRE), "post": curve("1e-3", POST)})
    assert sweep.main(["--leaderboard", str(tmp_path), "--baseline", "norm_scheme=pre", *flags]) == 2
    one_line_error(capsys, message)


def test_a_single_rate_grid_is_its_own_edge():
    best = sweep.pick_best([{"learning_rate": "1e-3", "seed": 1, "val_loss": 2.0, "diverged_at": None,
                             "exit_code": 0}], "learning_rate", ["1e-3"])
    assert best["best_lr"] == "1e-3" and best["edge_warning"] is not None


def test_lr_table_gives_a_decisive_word_only_from_five_rates_and_a_best_inside_them(tmp_path):
    clear = {"pre": curve("1e-3", PRE), "post": curve("1e-3", POST)}
    assert lr_sweep(tmp_path, clear)[1]["verdict"].startswith("contradicted")
    edge = {**clear, "post": curve("1e-2", POST)}  # post's best is the highest rate
    assert lr_sweep(tmp_path, edge)[1]["verdict"].startswith("inconclusive at this scale")
    assert "edge" in lr_sweep(tmp_path, edge)[1]["verdict"]
    short = {s: curve("1e-3", xs, RATES[1:4]) for s, xs in (("pre", PRE), ("post", POST))}
    word = lr_sweep(tmp_path, short)[1]["verdict"]
    assert word.startswith("inconclusive at this scale") and "3 rates" in word


def test_the_selection_seed_never_enters_the_verdict(tmp_path):
    """Seed 0 picked each rate; at the best rate it is the luckiest seed of the grid (the winner's curse), and
    the table leaves it out of the mean and the test."""
    lucky = curve("1e-3", [1.0, *POST[1:]])  # a selection run far below the held-out ones
    [_, post] = lr_sweep(tmp_path, {"pre": curve("1e-3", PRE), "post": lucky})
    assert sorted(post["seed_losses"]) == [1, 2, 3, 4, 5] and post["n_seeds"] == (5, 5)
    assert post["val_loss_mean"] == pytest.approx(statistics.fmean(POST[1:]))
    assert sorted(sweep.best_lr_runs(str(tmp_path), {"norm_scheme": "post"})) == [1, 2, 3, 4, 5]


def test_a_crashed_rate_is_not_a_result(tmp_path, capsys):
    crashes = {**curve("1e-3", POST), **{lr: ["crash"] for lr in ("1e-4", "3e-3", "1e-2")}}
    table = lr_sweep(tmp_path, {"pre": curve("1e-3", PRE), "post": crashes})
    assert table[1]["verdict"].startswith("inconclusive at this scale") and "0.0001, 0.003, 0.01 crashed" in \
        table[1]["verdict"]  # two rates with a result: clearly apart, but not a comparison
    assert table[1]["crashed_lrs"] == "1e-4,3e-3,1e-2" and "crashed_lrs" in capsys.readouterr().out
    assert sweep.leaderboard([str(tmp_path)], {"norm_scheme": "pre"}, LOWER)[1]["verdict"] == table[1]["verdict"]


def test_an_arm_that_trains_at_no_rate_says_so_in_the_verdict_column(tmp_path):
    runs = {"pre": curve("1e-3", PRE), "none": {lr: [None] for lr in RATES}}
    table = lr_sweep(tmp_path, runs)
    assert "trained at no rate" in table[1]["verdict"]
    assert "trained at no rate" in sweep.leaderboard([str(tmp_path)], {"norm_scheme": "pre"})[1]["verdict"]


def test_plain_grid_with_a_baseline_says_it_gives_no_verdict(tmp_path, capsys):
    tiny = {"max_iters": "4", "lr_decay_iters": "4"}
    for scheme in ("pre", "post"):
        argv = [CONFIG, *(f"--{k}={v}" for k, v in tiny.items()), f"--norm_scheme={scheme}", "--seed=1"]
        finished_run(tmp_path / f"norm_scheme={scheme},seed=1", [*argv, f"--out_dir={tmp_path}/x"])
    sweep.run_sweep(CONFIG, {"norm_scheme": ["pre", "post"]}, [1], tiny, str(tmp_path), baseline={"norm_scheme": "pre"})
    out = capsys.readouterr().out
    assert "no verdict" in out and "--lr_grid" in out
    assert "no verdict" in (tmp_path / "summary.md").read_text()


# ----------------------------------------------------------------------------- input and files already written


@pytest.mark.parametrize("flags, message", [
    (["--grid", "n_layer=1,1"], "--grid n_layer: 1 and 1 are the same value"),
    (["--seeds", "1,1,2"], "--seeds: 1 and 1 are the same value"),
    (["--lr_grid", "1e-3,0.001"], "--lr_grid: 1e-3 and 0.001 are the same value"),
    (["--grid", "n_layer=1", "--grid", "n_layer=2"], "--grid n_layer= is given twice"),
    (["--grid", "n_layer=1,2", "--set", "n_layer=3"], "n_layer given by both --grid and --set"),
])
def test_a_value_given_twice_is_refused_before_anything_runs(tmp_path, capsys, flags, message):
    assert sweep.main([CONFIG, *flags, "--out_root", str(tmp_path), "--dry_run"]) == 2
    one_line_error(capsys, message)
    with pytest.raises(sweep.SweepError, match="two runs would write"):  # the backstop, for any caller
        sweep.plan_runs(CONFIG, {"n_layer": ["1", "1"]}, out_root=str(tmp_path))


def test_a_finished_run_of_another_sweep_is_not_taken_as_this_ones(tmp_path):
    run = tmp_path / "norm_scheme=pre,seed=1"
    finished_run(run, [CONFIG, "--max_iters=4", "--n_embd=32", "--norm_scheme=pre", "--seed=1", f"--out_dir={run}"])
    same = sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], {"max_iters": "4", "n_embd": "32"}, str(tmp_path))
    assert same[0]["state"] == "finished"  # the same command: skipped, as a resumed sweep should
    with pytest.raises(sweep.SweepError, match=r"norm_scheme=pre,seed=1 holds a run of another sweep .*n_embd=64"):
        sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], {"max_iters": "4", "n_embd": "64"}, str(tmp_path))
    assert sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], {"max_iters": "4", "n_embd": "64"}, str(tmp_path),
                           rerun=True)[0]["state"] == "new"  # --rerun: the explicit way to replace it


def test_a_config_file_edited_since_a_run_finished_is_not_taken_as_this_sweeps(tmp_path):
    config, root = tmp_path / "qs.py", str(tmp_path / "sweep")
    config.write_text(pathlib.Path(CONFIG).read_text() + "\nn_layer = 1\n")
    plan = {"config": str(config), "grid": {"learning_rate": ["1e-3"]}, "fixed": {"max_iters": "4"}, "out_root": root}
    [job] = sweep.plan_runs(**plan)
    recorded = recorded_settings(job["argv"])
    finished_run(job["out_dir"], job["argv"], settings={**recorded, "a_key_since_removed": 1})
    assert sweep.plan_runs(**plan)[0]["state"] == "finished"  # the same settings; a key one side lacks is ignored
    config.write_text(config.read_text().replace("n_layer = 1", "n_layer = 2"))  # same path, same flags
    with pytest.raises(sweep.SweepError, match=r"learning_rate=1e-3 holds a run of another sweep \(n_layer=2 here, "
                       r"1 there\); give another --out_root, or --rerun"):
        sweep.plan_runs(**plan)
    assert job["settings"] == recorded  # what launch records in run.json


@pytest.mark.parametrize("exit_code", [-9, 4])  # killed while drawing its sample; stopped, then completed by hand
def test_a_run_evaluated_at_max_iters_is_a_result_whatever_exit_code_run_json_records(tmp_path, capsys, exit_code):
    plain, lr = str(tmp_path / "plain"), str(tmp_path / "lr")
    fixed = {"max_iters": "4"}
    [job] = sweep.plan_runs(CONFIG, {}, [1], fixed, plain)
    finished_run(job["out_dir"], job["argv"], exit_code=exit_code, settings=recorded_settings(job["argv"]))
    for job in sweep.plan_runs(CONFIG, {"learning_rate": ["1e-3"]}, [0, 1], fixed, lr,  # selection seed 0, held-out 1
                               lr_ratios=sweep.lr_ratios_of(CONFIG, fixed, ["learning_rate"])):
        finished_run(job["out_dir"], job["argv"], exit_code=exit_code, settings=recorded_settings(job["argv"]))
    assert sweep.main([CONFIG, "--set", "max_iters=4", "--seeds", "1", "--out_root", plain]) == 0  # skipped, counted
    summary = json.loads(pathlib.Path(plain, "summary.json").read_text())
    [row], [point] = summary["runs"], summary["grid_points"]
    assert row["exit_code"] == exit_code and point["val_loss_mean"] == 2.1  # the recorded code still shows
    assert not sweep.crashed(row) and sweep.final_loss(row) == 2.1
    assert sweep.main([CONFIG, "--set", "max_iters=4", "--seeds", "1", "--lr_grid", "1e-3", "--select_seeds", "0",
                       "--out_root", lr]) == 0
    [point] = json.loads(pathlib.Path(lr, "summary.json").read_text())["lr_points"]
    assert point["best_lr"] == "1e-3" and point["crashed_lrs"] is None and point["val_loss_mean"] == 2.1


def test_a_run_folder_in_use_stops_the_sweep_before_anything_starts(tmp_path, capsys, monkeypatch):
    def refuse(job, threads):
        raise AssertionError(f"{job['out_dir']} was started")

    monkeypatch.setattr(sweep, "launch", refuse)
    OutDirLock(str(tmp_path / "seed=2")).release()  # a folder whose run has ended: free
    with OutDirLock(str(tmp_path / "seed=1")):  # as a train.py started there by hand holds it
        assert sweep.main([CONFIG, "--set", "max_iters=4", "--seeds", "1,2,3", "--out_root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "seed=2" not in err, err
    assert "seed=1: in use by another process" in err and "wait for it to end or stop it" in err, err
    assert sorted(os.listdir(tmp_path)) == [".lock", "seed=1", "seed=2"]  # no seed=3 folder, no summary
    assert os.listdir(tmp_path / "seed=1") == [".lock"]


def test_sigterm_handling_is_main_s_alone_and_undone_after_it(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with sweep.forwarding_stop_signals():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    assert sweep.main([CONFIG, "--set", "max_iters=4", "--out_root", str(tmp_path), "--dry_run"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_attempt_cut_off_before_its_first_checkpoint_starts_anew_and_a_stop_save_resumes(tmp_path):
    """train.py refuses to start over an earlier run's metrics.jsonl without --overwrite, and resumes from
    ckpt_last.pt (a stop signal's save) when there is no ckpt.pt: the sweep plans both accordingly."""
    run = tmp_path / "norm_scheme=pre,seed=1"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "iter": 0, "loss": 4.0}\n')
    [job] = sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], {"max_iters": "4"}, str(tmp_path))
    assert job["state"] == "new" and "--overwrite=True" in job["argv"]
    saved_settings(run / "ckpt_last.pt", [CONFIG, "--max_iters=4", "--norm_scheme=pre", "--seed=1"])
    [job] = sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], {"max_iters": "4"}, str(tmp_path))
    assert job["state"] == "resume" and "--init_from=resume" in job["argv"]


def test_a_run_without_run_json_is_checked_by_its_checkpoint(tmp_path):
    """A sweep stopped while its runs trained leaves no run.json: the checkpoint's settings say whose run it is."""
    run = tmp_path / "norm_scheme=pre,seed=1"
    finished_run(run, [])
    os.remove(run / "run.json")
    with pytest.raises(sweep.SweepError, match="neither a run.json nor a checkpoint"):
        sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], {"max_iters": "4"}, str(tmp_path))
    saved_settings(run / "ckpt.pt", [CONFIG, "--max_iters=4", "--norm_scheme=post", "--seed=1"])
    with pytest.raises(sweep.SweepError, match="another sweep .*norm_scheme=pre here, post there"):
        sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], {"max_iters": "4"}, str(tmp_path))
    saved_settings(run / "ckpt.pt", [CONFIG, "--max_iters=4", "--norm_scheme=pre", "--seed=1"])
    [job] = sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], {"max_iters": "4"}, str(tmp_path))
    assert job["state"] == "finished"
    [row] = sweep.summarize([job["out_dir"]], points=[job["point"]])
    assert row["norm_scheme"] == "pre" and row["seed"] == 1  # the grid values from the job, not a run.json


@pytest.mark.parametrize("content", ['{"runs": [', '{"lr_points": []}', "[1, 2]"])
def test_a_cut_off_or_empty_summary_exits_2_naming_the_file(tmp_path, capsys, content):
    (tmp_path / "summary.json").write_text(content)
    assert sweep.main(["--leaderboard", str(tmp_path)]) == 2
    one_line_error(capsys, "summary.json")
    assert plot.main([str(tmp_path), "--lr_sweep", "--out", str(tmp_path / "lr.png")]) == 2
    one_line_error(capsys, "summary.json")


@pytest.mark.parametrize("edit", [
    lambda s: s["lr_points"][0]["seed_losses"].update({"1": "abc"}),
    lambda s: s["lr_points"][0]["seed_losses"].update({"x": 2.0}),
    lambda s: s["lr_points"][0].update(best_lr="fast"),
    lambda s: s["lr_points"][0].update(val_loss_mean="2.0"),
    lambda s: s["runs"][0].update(learning_rate="fast"),
    lambda s: s["runs"][0].update(seed="one"),
    lambda s: s["runs"][0].update(wall_s="1 s"),
    lambda s: s.update(setup=[1]),
    lambda s: s.update(swept=3),
    lambda s: s.update(select_seeds=["0"]),
])
def test_a_summary_edited_into_other_types_exits_2(tmp_path, capsys, edit):
    lr_sweep(tmp_path, {"pre": curve("1e-3", PRE), "post": curve("1e-3", POST)})
    summary = json.loads((tmp_path / "summary.json").read_text())
    edit(summary)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    capsys.readouterr()
    assert sweep.main(["--leaderboard", str(tmp_path), "--baseline", "norm_scheme=pre"]) == 2
    one_line_error(capsys, "summary.json: ")


def test_metrics_edited_by_hand_are_read_around(tmp_path):
    lines = ['{"kind": "eval", "iter": 4, "val_loss": 2.0, "block_rms": [1.0, 2.0]}', "5", '"text"',
             '{"kind": "status", "status": "diverged"}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    records = plot.load_metrics(str(tmp_path))
    assert len(records) == 2 and plot.diverged_at(records) is None  # a status without its iteration says nothing
    assert plot.curves(records, "block_rms[-2]", "iter", False) == {"": ([4], [1.0])}
    with pytest.raises(plot.PlotError, match=r"block_rms\[9\]: the run logged block_rms for 2 blocks"):
        plot.curves(records, "block_rms[9]", "iter", False)


def test_a_second_sweep_on_the_same_out_root_is_refused(tmp_path, capsys):
    with OutDirLock(str(tmp_path), "--out_root", "sweep"):  # as a sweep running there holds it
        assert sweep.main([CONFIG, "--grid", "norm_scheme=pre", "--set", "max_iters=4", "--out_root",
                           str(tmp_path)]) == 2
    one_line_error(capsys, "is in use by another sweep")
    assert sorted(os.listdir(tmp_path)) == [".lock"]  # no run folder, log or summary touched


def test_another_sweeps_summary_is_kept(tmp_path, capsys):
    sweep.write_summary_files(str(tmp_path), "sweep A", "table A", {})
    sweep.write_summary_files(str(tmp_path), "sweep A", "table A again", {})  # the same sweep: replaced
    assert sorted(os.listdir(tmp_path)) == ["summary.json", "summary.md"]
    sweep.write_summary_files(str(tmp_path), "sweep B", "table B", {})
    kept = sorted(f for f in os.listdir(tmp_path) if f.startswith("summary_"))
    assert len(kept) == 2 and "table A again" in (tmp_path / kept[1]).read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["title"] == "sweep B"
    assert "kept as summary_" in capsys.readouterr().out


def test_a_cut_off_run_json_stops_the_sweep_with_one_line(tmp_path, capsys):
    run = tmp_path / "seed=1"
    finished_run(run, [CONFIG, "--max_iters=4", "--seed=1"])
    (run / "run.json").write_text('{"argv": [')
    assert sweep.main([CONFIG, "--set", "max_iters=4", "--seeds", "1", "--out_root", str(tmp_path)]) == 2
    one_line_error(capsys, "run.json")


def test_a_junk_checkpoint_exits_2_naming_it(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "iter": 0, "val_loss": 3.0}) + "\n")
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "runs.png")]) == 2
    one_line_error(capsys, "ckpt.pt")


def test_a_failed_write_leaves_the_previous_summary_whole(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_text('{"old": 1}')

    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        sweep.write_summary(str(tmp_path), [], [], [], False, "a sweep")
    assert json.loads(path.read_text()) == {"old": 1}


# ----------------------------------------------------------------------------- the leaderboard and the figure


def test_leaderboard_withholds_the_verdict_between_different_setups(tmp_path):
    lr_sweep(tmp_path / "a", {"pre": curve("1e-3", PRE)})
    lr_sweep(tmp_path / "b", {"post": curve("1e-3", POST)}, {**SETUP, "max_iters": 100}, None)
    lr_sweep(tmp_path / "c", {"post": curve("1e-3", POST)}, {**SETUP, "seeds": 5}, None)
    roots = [str(tmp_path / r) for r in "abc"]
    board = {row["label"]: row for row in sweep.leaderboard(roots, {"norm_scheme": "pre"}, LOWER)}
    other, same = board["norm_scheme=post (b)"], board["norm_scheme=post (c)"]
    assert other["verdict"].startswith("no verdict") and "max_iters 100" in other["verdict"]
    assert same["verdict"].startswith("contradicted")  # the seed count is not a setup


def test_a_swept_scheme_column_is_compared_and_an_unswept_one_is_a_setup():
    """--grid norms=... sweeps a column of the scheme, recorded in the settings' overrides: two sweeps that differ
    only there are compared; a column neither sweeps, set differently, withholds the verdict."""
    def summary(**overrides):
        return {"keys": ["norms"], "swept": ["norms", "learning_rate"], "setup": {"n_layer": 4},
                "settings": {"overrides": overrides}}
    base = summary(norms="pre+final")
    assert sweep.setup_difference(summary(norms="pre+qk+final"), base) is None
    assert "attn_scale 1 here" in sweep.setup_difference(summary(norms="pre+qk+final", attn_scale="1"),
                                                         summary(norms="pre+final", attn_scale="1/sqrt(d)"))


def test_leaderboard_refuses_a_summary_that_disagrees_with_its_runs(tmp_path, capsys):
    """A seed's loss edited in summary.json (the verdict reads those), or a run's final loss that its
    metrics.jsonl no longer ends with (a run changed since), is refused, not compared."""
    root = tmp_path / "sweep"
    lr_sweep(root, {"pre": curve("1e-3", PRE), "post": curve("3e-3", shifted(0.03, PRE))})
    path, command = root / "summary.json", ["--leaderboard", str(root), "--baseline", "norm_scheme=pre"]
    summary = json.loads(path.read_text())
    assert sweep.main(command) == 0
    capsys.readouterr()
    edited = json.loads(path.read_text())
    edited["lr_points"][1]["seed_losses"]["2"] -= 0.5
    path.write_text(json.dumps(edited))
    assert sweep.main(command) == 2
    assert "does not agree with its runs (point {'norm_scheme': 'post', 'learning_rate': '3e-3'}: seed_losses" in (
        capsys.readouterr().err)
    run = root / "learning_rate=1e-3,seed=1"  # found under the summary's root, wherever the sweep ran from
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "iter": 4, "val_loss": 1.5}) + "\n")
    summary["runs"][0]["out_dir"] = os.path.join("elsewhere", run.name)
    path.write_text(json.dumps(summary))
    assert sweep.main(command) == 2
    assert f"{run}: final val loss {summary['runs'][0]['val_loss']}, its metrics.jsonl 1.5" in capsys.readouterr().err


def test_leaderboard_states_the_fragile_best_rate_once(tmp_path):
    fragile = curve("1e-3", [2.5, None, 2.48, 2.51, 2.49, 2.5])
    lr_sweep(tmp_path, {"pre": curve("1e-3", PRE), "post": fragile})
    [row] = [r for r in sweep.leaderboard([str(tmp_path)]) if r["label"] == "norm_scheme=post"]
    assert row["edge_warning"].count("diverged or crashed at its best rate") == 1


def test_lr_figure_draws_each_sweeps_own_first_seed(tmp_path):
    lr_sweep(tmp_path / "a", {"pre": curve("1e-3", [2.0, 2.02, 1.98])}, baseline=None, select=[0])
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    renamed = {0: 3, 1: 1, 2: 2}  # seeds 0, 1, 2 become 3, 1, 2: seed 3 ran every rate
    for r in summary["runs"]:
        r["seed"] = renamed[r["seed"]]
    for p in summary["lr_points"]:  # kept in agreement with the runs (read_lr_summary checks it)
        p["seed_losses"] = {str(renamed[int(s)]): v for s, v in p["seed_losses"].items()}
    summary["select_seeds"] = [3]
    (tmp_path / "a" / "summary.json").write_text(json.dumps(summary))
    lr_sweep(tmp_path / "b", {"post": curve("3e-3", [2.5, 2.52, 2.48])}, baseline=None, select=[0])
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    for r in b["runs"]:
        r["seed"] += 4  # seeds 4, 5, 6
    for p in b["lr_points"]:
        p["seed_losses"] = {str(int(s) + 4): v for s, v in p["seed_losses"].items()}
    b["select_seeds"] = [4]
    (tmp_path / "b" / "summary.json").write_text(json.dumps(b))
    ax = plot.draw_lr_sensitivity([str(tmp_path / "a"), str(tmp_path / "b")]).axes[0]
    drawn = [line for line in ax.get_lines() if line.get_linestyle() == "-" and line.get_label()[0] != "_"]
    assert [len(line.get_xdata()) for line in drawn] == [5, 5]  # every rate of both sweeps


def test_lr_figure_legend_states_each_comparison(tmp_path):
    lr_sweep(tmp_path, {"pre": curve("1e-3", PRE), "post": curve("1e-3", POST)}, claims=[({}, "lower", 0.05)])
    legend = [t.get_text() for t in plot.draw_lr_sensitivity([str(tmp_path)]).axes[0].get_legend().get_texts()]
    assert legend[0] == "pre: 2.0000 ± 0.0158 (n=5) at lr 1e-3"  # the baseline
    assert legend[1] == ("post: 2.5000 ± 0.0158 (n=5) at lr 1e-3\n  vs baseline, lower by δ=0.05: contradicted at "
                         "shakespeare_char, L 2, d 16; Δ +0.5000 [+0.5000, +0.5000] mde 0.0000 n 5 vs 5")


def test_lr_figure_title_leaves_out_swept_keys_and_states_the_tasks_context(tmp_path):
    lr_sweep(tmp_path, {"pre": curve("1e-3", [2.0, 2.02, 1.98])}, {**SETUP, "n_layer": 1}, baseline=None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["keys"], summary["setup"] = ["n_layer"], {**SETUP, "n_layer": 1}
    for p in [*summary["runs"], *summary["lr_points"]]:
        p["n_layer"] = 1
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    title = plot.draw_lr_sensitivity([str(tmp_path)])._suptitle.get_text()
    assert "L1" not in title and "d16 T32" in title
    assert sweep.run_setup([ICL], 3)["block_size"] == 32  # the task's 2 * icl_pairs, not GPTConfig's 1024


def test_a_run_continued_past_max_iters_counts_at_the_sweeps_max_iters(tmp_path):
    """A run trained on by hand with a larger --max_iters enters the tables at its evaluation at the sweep's."""
    plain, lr = str(tmp_path / "plain"), str(tmp_path / "lr")
    fixed = {"max_iters": "4"}
    [job] = sweep.plan_runs(CONFIG, {}, [1], fixed, plain)
    finished_run(job["out_dir"], job["argv"], settings=recorded_settings(job["argv"]))
    lr_jobs = sweep.plan_runs(CONFIG, {"learning_rate": ["1e-3"]}, [0, 1], fixed, lr,  # selection seed 0, held-out 1
                              lr_ratios=sweep.lr_ratios_of(CONFIG, fixed, ["learning_rate"]))
    for lr_job in lr_jobs:
        finished_run(lr_job["out_dir"], lr_job["argv"], settings=recorded_settings(lr_job["argv"]))
    for run in (job["out_dir"], *(lr_job["out_dir"] for lr_job in lr_jobs)):
        with open(os.path.join(run, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"kind": "eval", "iter": 8, "train_loss": 1.0, "val_loss": 1.1}) + "\n")
            f.write(json.dumps({"kind": "status", "status": "diverged", "iter": 9}) + "\n")
    assert sweep.main([CONFIG, "--set", "max_iters=4", "--seeds", "1", "--out_root", plain]) == 0
    summary = json.loads(pathlib.Path(plain, "summary.json").read_text())
    [row], [point] = summary["runs"], summary["grid_points"]
    assert (row["val_loss"], row["train_loss"], row["diverged_at"], point["val_loss_mean"]) == (2.1, 2.0, None, 2.1)
    assert sweep.main([CONFIG, "--set", "max_iters=4", "--seeds", "1", "--lr_grid", "1e-3", "--select_seeds", "0",
                       "--out_root", lr]) == 0
    [point] = json.loads(pathlib.Path(lr, "summary.json").read_text())["lr_points"]
    assert point["val_loss_mean"] == 2.1 and point["diverged_lrs"] is None
    assert sweep.leaderboard([lr])[0]["val_loss_mean_std"] == point["val_loss_mean_std"]  # agrees with its runs


def test_a_run_on_data_prepared_again_since_is_refused(tmp_path, data_dir, capsys):
    """A finished or resumable run whose checkpoint names other token files than the dataset holds now (prepared
    again from other text) is neither skipped nor resumed: its loss would be averaged with another corpus's."""
    fixed = {"max_iters": "4", "data_dir": data_dir}
    [job] = sweep.plan_runs(CONFIG, {}, [1], fixed, str(tmp_path))
    finished_run(job["out_dir"], job["argv"], settings=recorded_settings(job["argv"]))
    meta = json.loads(pathlib.Path(data_dir, "shakespeare_char", "meta.json").read_text())
    torch.save({"data_meta": meta}, os.path.join(job["out_dir"], "ckpt.pt"))
    assert sweep.plan_runs(CONFIG, {}, [1], fixed, str(tmp_path))[0]["state"] == "finished"
    torch.save({"data_meta": {**meta, "train_sha256": "0" * 64}}, os.path.join(job["out_dir"], "ckpt.pt"))
    argv = [CONFIG, "--set", "max_iters=4", f"data_dir={data_dir}", "--seeds", "1", "--out_root", str(tmp_path)]
    assert sweep.main(argv) == 2
    one_line_error(capsys, f"{job['out_dir']} was trained on other data than")
    assert sweep.plan_runs(CONFIG, {}, [1], fixed, str(tmp_path), rerun=True)[0]["state"] == "new"


def test_a_grid_of_min_lr_with_an_lr_grid_is_refused(tmp_path, capsys):
    """With --lr_grid, min_lr keeps its config ratio to the swept rate: a grid over it would be overridden."""
    argv = [CONFIG, "--grid", "min_lr=0,1e-5", "--lr_grid", "1e-3,1e-2", "--out_root", str(tmp_path), "--dry_run"]
    assert sweep.main(argv) == 2
    one_line_error(capsys, "--grid min_lr")
    assert sweep.main([*argv[:3], "--set", "min_lr=0", *argv[3:]]) == 2  # --set is fine, not both
    assert sweep.main([*argv[:3], *argv[5:]]) == 0  # a grid over min_lr alone is fine


@pytest.mark.parametrize("key, value", [("wall_s", "1 s"), ("argv", 5), ("exit_code", "0"), ("settings", [1]),
                                        ("point", "seed=1"), ("argv", ["--seed=1", 2])])
def test_a_run_json_edited_into_other_types_exits_2_naming_the_file_and_key(tmp_path, capsys, key, value):
    [job] = sweep.plan_runs(CONFIG, {}, [1], {"max_iters": "4"}, str(tmp_path))
    finished_run(job["out_dir"], job["argv"], settings=recorded_settings(job["argv"]))
    path = pathlib.Path(job["out_dir"], "run.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    assert sweep.main([CONFIG, "--set", "max_iters=4", "--seeds", "1", "--out_root", str(tmp_path)]) == 2
    one_line_error(capsys, f"{path}: {key} ")


def test_a_rate_that_follows_the_swept_one_is_passed_exactly(tmp_path, capsys):
    """min_lr == learning_rate in the config: at every swept rate min_lr is that rate, not a rounding above it."""
    config = tmp_path / "flat.py"
    config.write_text(pathlib.Path(CONFIG).read_text() + "\nmin_lr = learning_rate\n")
    argv = [str(config), "--lr_grid", "1e-3,1.2345678e-3,3e-3", "--out_root", str(tmp_path / "sweep"), "--dry_run"]
    assert sweep.main(argv) == 0
    out = capsys.readouterr().out
    assert "--min_lr=0.0012345678 " in out and "--min_lr=0.001 " in out, out


@pytest.mark.parametrize("rates", ["0,1e-3", "-1e-3,1e-3", "1e-3,inf", "1e-3,nan", "1e-3,,1e-2", "1e-3,3e-3,0.003"])
def test_an_lr_grid_of_a_rate_that_is_not_positive_or_given_twice_is_refused(tmp_path, capsys, rates):
    assert sweep.main([CONFIG, f"--lr_grid={rates}", "--out_root", str(tmp_path), "--dry_run"]) == 2
    one_line_error(capsys, "--lr_grid")


def test_run_json_records_the_commit_of_the_code_that_ran(tmp_path, monkeypatch):
    """A result names the code that made it: launch writes the checkout's commit into run.json (a stub stands in
    for train.py, so only the bookkeeping runs); outside a git checkout there is none to name."""
    head = sweep.code_version()
    if head is None:
        pytest.skip("not a git checkout")
    stub = tmp_path / "stub.py"
    stub.write_text("")
    monkeypatch.setattr(sweep, "TRAIN", str(stub))
    job = {"out_dir": str(tmp_path / "run"), "argv": [], "point": {}, "state": "new", "settings": {}}
    sweep.launch(job, 1)
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())["commit"]
    assert recorded == head and len(recorded.removesuffix("+dirty")) == 40
    assert sweep.code_version(str(tmp_path)) is None


# ----------------------------------------------------------------------------- judged on bits per byte


def bpb_sweep(root, metric: str) -> list[dict]:
    """An lr sweep over two datasets whose tokens differ: char (1 token per byte) and BPE (1/4 token per byte), each
    run's val_bpb = val_loss / ln 2 * tokens per byte; written as sweep.py --lr_grid --metric writes it."""
    per_byte = {"char": 1.0, "bpe": 0.25}
    held = {"char": [1.60, 1.61, 1.59, 1.62, 1.58, 1.60], "bpe": [5.00, 5.02, 4.98, 5.01, 4.99, 5.00]}
    rows = [{"dataset": name, "learning_rate": lr, "seed": seed, "val_loss": x, "val_bpb": x / math.log(2) * ratio,
             "out_dir": f"dataset={name},learning_rate={lr},seed={seed}", "wall_s": 1.0, "diverged_at": None,
             "exit_code": 0}
            for name, ratio in per_byte.items() for lr, xs in curve("1e-3", held[name]).items()
            for seed, x in [*((s, xs[0]) for s in SELECT), *enumerate(xs[1:], start=1)]]
    choice = [{"dataset": name, **sweep.pick_best([r for r in rows if r["dataset"] == name and r["seed"] in SELECT],
                                                  "learning_rate", RATES, metric=metric)} for name in per_byte]
    table = sweep.lr_table(rows, choice, ["dataset"], "learning_rate", {"dataset": "char"}, LOWER, SELECT,
                           setup=SETUP, metric=metric)
    os.makedirs(root, exist_ok=True)
    sweep.write_lr_summary(str(root), rows, table, ["dataset"], "learning_rate", [], "synthetic",
                           {"select_seeds": SELECT, "setup": SETUP, "settings": {},
                            "swept": ["dataset", "learning_rate"], "metric": metric})
    return table


def test_metric_val_bpb_judges_each_arm_on_bits_per_byte(tmp_path, capsys):
    """In nats per token the char model is lower (1.60 against 5.00), in bits per byte the BPE model is (1.80 against
    2.31): --metric val_bpb takes the held-out means and the verdict from val_bpb, says so in the table's header and
    summary.json, and a leaderboard will not mix it with a sweep judged on val_loss."""
    [_, by_bpb] = bpb_sweep(tmp_path / "bpb", "val_bpb")
    assert by_bpb["val_loss_mean"] == pytest.approx(statistics.fmean([5.02, 4.98, 5.01, 4.99, 5.0]) / math.log(2) / 4)
    assert by_bpb["verdict"].startswith("reproduced")
    assert "final val bpb (mean ± std)" in (tmp_path / "bpb" / "summary.md").read_text()
    assert json.loads((tmp_path / "bpb" / "summary.json").read_text())["metric"] == "val_bpb"
    [_, by_loss] = bpb_sweep(tmp_path / "loss", "val_loss")
    assert by_loss["verdict"].startswith("contradicted")
    board = sweep.leaderboard([str(tmp_path / "bpb")], {"dataset": "char"}, LOWER)
    assert [row["label"] for row in board] == ["dataset=bpe", "dataset=char"]  # sorted by mean bpb
    assert sweep.main(["--leaderboard", str(tmp_path / "bpb"), str(tmp_path / "loss")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "val_bpb" in err and "val_loss" in err
    ax = plot.draw_lr_sensitivity([str(tmp_path / "bpb")]).axes[0]  # the figure draws bpb, and says so
    assert ax.get_ylabel() == "final val bpb (first seed)"
    assert max(y for line in ax.get_lines() for y in line.get_ydata()) < 3  # bpb (2.6 at most), not nats (5.2)
    with pytest.raises(plot.PlotError, match="different metrics"):
        plot.draw_lr_sensitivity([str(tmp_path / "bpb"), str(tmp_path / "loss")])

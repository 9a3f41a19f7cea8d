"""The verdict rule's conditions (docs/comparing.md; nanonorm/verdict.py): a decisive word rests on held-out runs
that finished, on seeds no selection in the results folder used, within a family fixed before the runs, at a rate
inside the grid and away from a cliff, paired on the seeds both arms share. Synthetic losses: no training."""

import json
import math
import os
import pathlib

import pytest
from conftest import ROOT
from test_sweep_rules import BASE, PRE, curve, lr_sweep, shifted

import sweep
from nanonorm import verdict as rule
from nanonorm.lr_table import lr_verdict

CONFIG = os.path.join(ROOT, "configs", "cpu_base.py")
INF = math.inf
PRE_NORM = [2.31, 2.30, 2.32, 2.31, 2.30]  # five held-out Pre-Norm seeds


# ----------------------------------------------------------------------------- gap 1: survivors do not decide


@pytest.mark.parametrize("paired", [True, False])
def test_two_survivors_of_five_seeds_decide_nothing(paired):
    """An arm that diverged on 3 of 5 seeds (Fisher: p = 0.17 against 0 of 5, nothing) and whose 2 survivors sit
    0.06 below Pre-Norm: its loss word rests on 2 runs, not the 5 a verdict needs, so it is inconclusive; the
    interval itself (which today's rule read as reproduced) stays in the result."""
    v = rule.verdict([INF, INF, INF, 2.25, 2.24], PRE_NORM, "lower", 0.037, paired=paired)
    assert v["verdict"] == rule.INCONCLUSIVE and v["ci"][1] < 0  # the survivors alone exclude 0
    assert v["p_diverged"] == pytest.approx(1 / 6)  # C(5,3) C(5,0) / C(10,3) * 2 sides: 10/120 * 2
    assert "finished" in v["reason"] and "5" in v["reason"]
    # five finished runs in each arm are enough, whatever else diverged: the same gain on 5 of 6 seeds decides
    six = rule.verdict([INF, 2.25, 2.24, 2.25, 2.26, 2.25], [*PRE_NORM, 2.31], "lower", 0.037, paired=paired)
    assert six["verdict"] == "reproduced"
    # divergence is judged apart, by Fisher's test: 5 of 5 against 0 of 5 (p = 1/126) needs no finished run
    assert rule.verdict([INF] * 5, PRE_NORM, "lower", 0.037)["verdict"] == "contradicted"


# ----------------------------------------------------------------------------- gap 5: pairs on shared seeds


def test_pairs_are_the_seeds_both_arms_share():
    """Seeds 1-5 of an arm against a 12-seed baseline: the comparison pairs the five shared seeds (the arm sits
    0.02 below the baseline on each, a spread of seeds far larger than that), where Welch over the unpaired
    arms sees only noise."""
    base = {s: 2.30 + 0.05 * math.sin(s) for s in range(1, 13)}
    arm = {s: base[s] - 0.02 + 0.001 * (-1) ** s for s in range(1, 6)}
    v = lr_verdict(arm, base, "lower", 0.0, [None, None])
    assert v["paired"] and v["n"] == (5, 5) and v["test"] == "paired t"
    assert v["verdict"] == "reproduced" and v["diff"] == pytest.approx(-0.02, abs=2e-3)  # the mean of ±0.001 wobbles


# ----------------------------------------------------------------------------- gap 3: the family is the claims


GAIN = [-0.02, -0.05, -0.01, -0.04, -0.005]  # a paired gain with p between 0.05 / 3 and 0.05


def test_descriptions_are_no_part_of_a_family():
    """A claim at p in (0.0167, 0.05) beside two described rows (no claim: 'not distinguishable' or 'higher')
    is a family of one: reproduced either way, never corrected for the descriptions beside it."""
    claim = rule.verdict(shifted(GAIN), BASE, "lower", paired=True)
    assert claim["verdict"] == "reproduced" and 0.05 / 3 < claim["p_word"] < 0.05
    quiet = rule.verdict(shifted([0.01, -0.01, 0.02, -0.02, 0.0]), BASE, None, paired=True)
    loud = rule.verdict(shifted(0.3), BASE, None)
    for neighbours in ([quiet, quiet], [loud, loud]):
        corrected = rule.correct_family([claim, *neighbours])
        assert corrected[0]["verdict"] == "reproduced", corrected[0]
        assert [v["verdict"] for v in corrected[1:]] == [v["verdict"] for v in neighbours]


# ----------------------------------------------------------------------------- gap 4: a cliff is an edge


RATES = ["1e-4", "3e-4", "1e-3", "3e-3", "1e-2"]


def test_a_rate_next_to_one_that_diverged_is_an_edge(tmp_path):
    """HybridNorm's curve: 3.68, 3.11, 2.73, then diverged from 3e-3 up. Its pick 1e-3 is the last rate that trains,
    as much an edge as the grid's end: no decisive word, though the arms are far apart."""
    cliff = {"1e-4": [3.68], "3e-4": [3.11], "1e-3": [2.73, 2.75, 2.74, 2.76, 2.73, 2.75], "3e-3": [None],
             "1e-2": [None]}
    table = lr_sweep(tmp_path, {"pre": curve("1e-3", PRE), "hybrid": cliff})
    assert table[1]["verdict"].startswith(rule.INCONCLUSIVE) and "cliff" in table[1]["verdict"], table[1]["verdict"]
    inside = {**cliff, "3e-3": [2.9], "1e-2": [None]}  # the next rate trains: the pick is inside
    assert lr_sweep(tmp_path / "inside", {"pre": curve("1e-3", PRE), "hybrid": inside})[1]["verdict"].startswith(
        "contradicted")


# ----------------------------------------------------------------------------- gap 2: selection seeds are recorded


def stand_in_launch(job: dict, threads: int) -> dict:
    """A stand-in for sweep.launch: the run ends evaluated at max_iters with a loss that depends on its rate and
    seed, as train.py would leave it."""
    os.makedirs(job["out_dir"], exist_ok=True)
    lr, seed = float(job["settings"]["learning_rate"]), job["point"]["seed"]
    loss = 2.0 + 0.3 * abs(math.log10(lr) + 3) + 0.01 * seed
    evals = [{"kind": "eval", "iter": i, "val_loss": loss + 1.0 / (1 + i)} for i in (0, job["settings"]["max_iters"])]
    pathlib.Path(job["out_dir"], "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    info = {"point": job["point"], "argv": job["argv"], "exit_code": 0, "wall_s": 1.0, "threads": 1,
            "settings": job["settings"]}
    pathlib.Path(job["out_dir"], "run.json").write_text(json.dumps(info))
    return info


def test_a_seed_that_selected_a_rate_in_the_folder_is_never_held_out(tmp_path, capsys, monkeypatch):
    """Sweep A picks its rate on seed 0 and holds out 1-5; sweep B, in the same folder, would hold out seed 0, whose
    run at the picked rate won A's selection (the winner's curse): refused, naming the seed, before anything runs."""
    monkeypatch.setattr(sweep, "launch", stand_in_launch)
    root = str(tmp_path / "lr")
    common = [CONFIG, "--set", "max_iters=4", "--lr_grid", "1e-3,1e-2", "--out_root", root]
    assert sweep.main([*common, "--select_seeds", "0", "--seeds", "1,2,3,4,5"]) == 0
    capsys.readouterr()
    before = sorted(os.listdir(root))
    assert sweep.main([*common, "--select_seeds", "6", "--seeds", "0,1,2,3,4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "seed 0" in err and "selection" in err, err
    assert sorted(os.listdir(root)) == before  # nothing ran

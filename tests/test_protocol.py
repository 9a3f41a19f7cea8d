"""The comparison protocol of sweep.py --lr_grid (docs/comparing.md): rates picked on the mean of three selection
seeds and refined at ×√3, the baseline judged at its second-best rate too, claims fixed in a claims file, the
per-run numbers written as results files from which one command regenerates the tables, and a time budget per
call that the same command continues. Runs stand in for train.py (a few lines of JSON each), but for one tiny
sweep trained end to end."""

import json
import math
import os
import pathlib
import shutil

import pytest
from conftest import ROOT, tiny_run_args
from test_sweep_rules import BASE, PRE, RATES, curve, lr_sweep, shifted
from test_tools import TrainInProcess

import plot
import sweep
from nanonorm import lr_table
from nanonorm import verdict as rule
from nanonorm.selection import SELECTION_RECORD

CONFIG = os.path.join(ROOT, "configs", "cpu_base.py")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "results")
DEPTH_CLAIMS = os.path.join(ROOT, "claims", "depth.json")


def standing_in(loss=lambda lr, seed, scheme: 2.0 + 0.3 * (math.log10(lr / 1.6e-3)) ** 2 + 0.01 * seed,
                diagnostics=lambda lr, seed, scheme: {}):
    """A stand-in for sweep.launch: the run ends evaluated at max_iters with loss(rate, seed, scheme) (None: it
    diverged) and the per-block diagnostics(rate, seed, scheme) on that eval line, as train.py would leave it; `calls`
    lists the runs launched."""
    calls = []

    def launch(job: dict, threads: int) -> dict:
        os.makedirs(job["out_dir"], exist_ok=True)
        s = job["settings"]
        x = loss(float(s["learning_rate"]), job["point"]["seed"], s.get("norm_scheme"))
        evals = [{"kind": "eval", "iter": 0, "val_loss": 4.0}]
        evals += [{"kind": "eval", "iter": s["max_iters"], "val_loss": x,
                   **diagnostics(float(s["learning_rate"]), job["point"]["seed"], s.get("norm_scheme"))}] \
            if x is not None else \
            [{"kind": "status", "status": "diverged", "iter": 2}]
        pathlib.Path(job["out_dir"], "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
        info = {"point": job["point"], "argv": job["argv"], "exit_code": 0 if x is not None else 3, "wall_s": 1.0,
                "threads": 1, "settings": s, "commit": "f" * 40}
        pathlib.Path(job["out_dir"], "run.json").write_text(json.dumps(info))
        calls.append(job["out_dir"])
        return info

    launch.calls = calls
    return launch


def claims_file(path, claims: list[dict], baseline: dict | None = None) -> str:
    pathlib.Path(path).write_text(json.dumps({"baseline": baseline or {"norm_scheme": "pre"}, "claims": claims}))
    return str(path)


# ----------------------------------------------------------------------------- rates picked on three seeds, refined


def test_a_rate_picked_on_fewer_than_three_selection_seeds_gives_no_decisive_word(tmp_path):
    """One selection seed moved a baseline's pick by 0.17 nats: a table whose rates were picked on fewer than three
    gives no decisive word, however far apart its arms are."""
    arms = {"pre": curve("1e-3", PRE), "post": curve("1e-3", [2.5, 2.52, 2.48, 2.51, 2.49, 2.5])}
    one = lr_sweep(tmp_path / "one", arms, select=[0])
    assert one[1]["verdict"].startswith(rule.INCONCLUSIVE) and "1 selection seed" in one[1]["verdict"]
    assert lr_sweep(tmp_path / "three", arms, select=[0, 100, 101])[1]["verdict"].startswith("contradicted")


def test_rates_are_picked_on_the_mean_of_three_seeds_then_refined_at_root_3(tmp_path, monkeypatch, capsys):
    """The loss is lowest at 1.6e-3: the coarse grid picks 1e-3 on the mean of its three default selection seeds
    (0, 6, 7 beside held-out 1-5); the rates at ×√3 around it run on the same seeds and 1.73e-3 wins; the held-out
    seeds run there only, and the baseline's also at its second-best rate (1e-3)."""
    launch = standing_in()
    monkeypatch.setattr(sweep, "launch", launch)
    root = tmp_path / "lr"
    assert sweep.main([CONFIG, "--grid", "norm_scheme=pre,post", "--set", "max_iters=4", "--lr_grid", ",".join(RATES),
                       "--seeds", "1,2,3,4,5", "--baseline", "norm_scheme=pre", "--out_root", str(root)]) == 0
    summary = json.loads((root / "summary.json").read_text())
    assert summary["select_seeds"] == [0, 6, 7]
    ran = {(r["norm_scheme"], r["learning_rate"], r["seed"]) for r in summary["runs"]}
    for scheme in ("pre", "post"):
        assert {(lr, s) for sch, lr, s in ran if sch == scheme and s in (0, 6, 7)} == \
            {(lr, s) for lr in [*RATES, "0.000577", "0.00173"] for s in (0, 6, 7)}
    [pre, post] = summary["lr_points"]
    assert pre["best_lr"] == post["best_lr"] == "0.00173" and pre["second_lr"] == "1e-3"
    assert {(lr, s) for sch, lr, s in ran if sch == "post" and s not in (0, 6, 7)} == \
        {("0.00173", s) for s in range(1, 6)}
    assert {(lr, s) for sch, lr, s in ran if sch == "pre" and s not in (0, 6, 7)} == \
        {(lr, s) for lr in ("0.00173", "1e-3") for s in range(1, 6)}
    assert json.loads((root / SELECTION_RECORD).read_text())["seeds"] == [0, 6, 7]
    assert "vs the baseline's second-best rate" in (root / "summary.md").read_text()
    assert "Scale: shakespeare_char, L 4, d 128" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the baseline's second-best rate


def test_a_word_that_changes_with_the_baselines_second_best_rate_depends_on_it(tmp_path):
    """Against Pre-Norm at its best rate (1e-3) the arm is 0.1 lower: reproduced; at Pre-Norm's second-best (3e-3),
    0.15 lower than the arm's own, it is 0.05 higher: contradicted. The word depends on the baseline's rate and
    says so, with both words; an arm far below both keeps its word."""
    second = shifted(-0.15)  # Pre-Norm's held-out seeds at 3e-3
    pre = {"1e-4": [2.4], "3e-4": [2.2], "1e-3": [2.0, *BASE], "3e-3": [2.05, *second], "1e-2": [2.3]}
    arm = curve("1e-3", [1.9, *shifted(-0.1)])
    far = curve("1e-3", [1.5, *shifted(-0.5)])
    table = lr_sweep(tmp_path, {"pre": pre, "arm": arm, "far": far})
    assert table[1]["verdict"].startswith(rule.DEPENDS), table[1]["verdict"]
    assert "reproduced against the baseline at its best rate 1e-3, contradicted at its second-best 3e-3" in \
        table[1]["verdict"]
    assert table[1]["verdict_second"] == "contradicted"
    assert table[2]["verdict"].startswith("reproduced") and table[2]["verdict_second"] == "reproduced"


# ----------------------------------------------------------------------------- a claims file fixes the family


GAIN = [-0.02, -0.05, -0.01, -0.04, -0.005]  # a paired gain with p between 0.05 / 3 and 0.05


def test_a_claims_file_fixes_the_family_whatever_the_table_holds(tmp_path):
    """Three claims of one paper in the file, one of them in this table: Holm's correction runs over the three
    (a claim not in the table counts at p = 1), alone or beside other sweeps, and the word names its family."""
    claims = sweep.read_claims(claims_file(tmp_path / "claims.json", [
        {"row": {"norm_scheme": s}, "claim": "lower", "paper": "Paper X"} for s in ("a", "b", "c")]))
    arms = {"pre": curve("1e-3", [2.0, *BASE]), "a": curve("1e-3", [2.0, *shifted(GAIN)])}
    [_, a] = lr_sweep(tmp_path / "one", arms, claims=claims)
    assert a["verdict"].startswith(rule.INCONCLUSIVE) and "family Paper X: 3 claims, 1 in this table" in a["verdict"]
    assert lr_sweep(tmp_path / "adhoc", arms)[1]["verdict"].startswith("reproduced")  # ad hoc: a family of one
    lr_sweep(tmp_path / "other", {"d": curve("1e-3", [2.0, *shifted(0.3)])}, baseline=None)  # described rows
    alone = sweep.leaderboard([str(tmp_path / "one")], {"norm_scheme": "pre"}, claims)
    beside = sweep.leaderboard([str(tmp_path / "one"), str(tmp_path / "other")], {"norm_scheme": "pre"}, claims)
    [row_alone] = [r for r in alone if r["label"] == "norm_scheme=a"]
    [row_beside] = [r for r in beside if r["label"] == "norm_scheme=a"]
    assert row_alone["verdict"] == row_beside["verdict"] == a["verdict"] and row_alone["family"] == "Paper X"


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "baseline row"),
    ('{"baseline": {"norm_scheme": "pre"}, "claims": [{"row": {"norm_scheme": "a"}, "claim": "better", '
     '"paper": "X"}]}', "claim 'better'"),
    ('{"baseline": {"norm_scheme": "pre"}, "claims": [{"row": {"norm_scheme": "a"}, "claim": "lower", '
     '"delta": -1, "paper": "X"}]}', "delta -1"),
    ('{"baseline": {"norm_scheme": "pre"}, "claims": [{"row": {"norm_scheme": "a"}, "claim": "lower"}]}', "paper"),
    ('{"baseline": {"norm_scheme": "pre"}, "claims": [{"row": {"norm_scheme": "a"}, "claim": "lower", '
     '"paper": "X", "diagnostic": "sink"}]}', "diagnostic 'sink'"),
])
def test_a_claims_file_that_cannot_be_read_exits_2_with_one_line(tmp_path, capsys, content, message):
    (tmp_path / "claims.json").write_text(content)
    lr_sweep(tmp_path, {"pre": curve("1e-3", PRE)}, baseline=None)
    assert sweep.main(["--leaderboard", str(tmp_path), "--claims", str(tmp_path / "claims.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_claims_changed_after_the_runs_began_are_refused(tmp_path, monkeypatch, capsys):
    """The claims an out_root's runs started with are kept there: the same sweep with an edited claims file (a
    δ raised after seeing the runs), or claims given first to a folder that already holds runs, exits 2."""
    monkeypatch.setattr(sweep, "launch", standing_in())
    path = claims_file(tmp_path / "claims.json", [{"row": {"norm_scheme": "post"}, "claim": "lower", "delta": 0.02,
                                                   "paper": "X"}])
    command = [CONFIG, "--grid", "norm_scheme=pre,post", "--set", "max_iters=4", "--lr_grid", "1e-3,1e-2",
               "--seeds", "1", "--select_seeds", "0", "--no-refine"]
    assert sweep.main([*command, "--claims", path, "--out_root", str(tmp_path / "a")]) == 0
    assert sweep.main([*command, "--claims", path, "--out_root", str(tmp_path / "a")]) == 0  # the same: fine
    claims_file(path, [{"row": {"norm_scheme": "post"}, "claim": "lower", "delta": 0.5, "paper": "X"}])
    capsys.readouterr()
    assert sweep.main([*command, "--claims", path, "--out_root", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fixed before the runs" in err, err
    assert sweep.main([*command, "--out_root", str(tmp_path / "b")]) == 0
    assert sweep.main([*command, "--claims", path, "--out_root", str(tmp_path / "b")]) == 2
    assert "made without --claims" in capsys.readouterr().err
    assert sweep.main([*command, "--claims", path, "--row_claim", "norm_scheme=post:lower",
                       "--baseline", "norm_scheme=pre", "--out_root", str(tmp_path / "c")]) == 2


# ----------------------------------------------------------------------------- results as data, tables from them


def test_the_tables_regenerate_from_the_results_files_alone(tmp_path, monkeypatch, capsys):
    """A sweep writes its per-run numbers to --results; with the run folders gone, `sweep.py --tables` prints the
    per-point table the sweep printed, and `plot.py --tables` writes it with a figure per sweep."""
    monkeypatch.setattr(sweep, "launch", standing_in(lambda lr, seed, scheme: 2.0 + 0.3 * math.log10(lr / 1.6e-3) ** 2
                                                     + 0.01 * seed - 0.05 * (scheme == "post")))
    path = claims_file(tmp_path / "claims.json", [{"row": {"norm_scheme": "post"}, "claim": "lower", "delta": 0.02,
                                                   "paper": "X"}])
    results = tmp_path / "results" / "study"
    root = tmp_path / "out" / "lr"
    assert sweep.main([CONFIG, "--grid", "norm_scheme=pre,post", "--set", "max_iters=4", "--lr_grid", ",".join(RATES),
                       "--seeds", "1,2,3,4,5", "--claims", path, "--out_root", str(root), "--results",
                       str(results)]) == 0
    summary = (root / "summary.md").read_text()
    shutil.rmtree(tmp_path / "out")
    capsys.readouterr()
    assert sweep.main(["--tables", str(tmp_path / "results")]) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("Scale:"):].strip()
    assert table in summary and "reproduced at shakespeare_char, L 4, d 128" in table
    assert plot.main(["--tables", str(tmp_path / "results"), "--out", str(tmp_path / "tables")]) == 0  # and figures
    assert (tmp_path / "tables" / "study.md").read_text() == printed
    assert (tmp_path / "tables" / "study_lr.png").stat().st_size > 0


def test_the_mechanism_table_takes_each_point_at_its_rate_on_the_held_out_seeds_against_the_baseline(
        tmp_path, monkeypatch, capsys):
    """The diagnostics a mechanism claim is about (the first-token mass, the largest activation over the median) are
    recorded per block in the results file, and the tables give each point's mean over the blocks at its best rate
    on its held-out seeds, against the baseline's on the same seeds. Off-rate and selection-seed runs carry values
    far away (+3 per decade from the best rate, +5 on a selection seed), so a table that took any of them misses."""
    def diagnostics(lr: float, seed: int, scheme: str) -> dict:
        m = 0.05 + 0.01 * seed + 0.2 * (scheme == "post") + 3 * abs(math.log10(lr / 1.73e-3)) + 5 * (seed in (0, 6, 7))
        return {"attn_first_token_mass": [2 * m, 0.0], "stream_max_over_median": [10.0 + seed, 10.0 + seed]}

    monkeypatch.setattr(sweep, "launch", standing_in(diagnostics=diagnostics))
    results = tmp_path / "results" / "study"
    assert sweep.main([CONFIG, "--grid", "norm_scheme=pre,post", "--set", "max_iters=4", "--lr_grid", ",".join(RATES),
                       "--seeds", "1,2,3,4,5", "--baseline", "norm_scheme=pre", "--out_root", str(tmp_path / "lr"),
                       "--results", str(results)]) == 0
    runs = [json.loads(line) for line in (results / "lr.jsonl").read_text().splitlines()[1:]]
    assert all(r["attn_first_token_mass"] == diagnostics(float(r["learning_rate"]), r["seed"], r["norm_scheme"])[
        "attn_first_token_mass"] and "stream_excess_kurtosis" not in r for r in runs)
    capsys.readouterr()
    assert sweep.main(["--tables", str(tmp_path / "results")]) == 0
    printed = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in printed[printed.index("Mechanism"):].splitlines() if line.startswith("| p")}
    assert rows["pre"][0] == rows["post"][0] == "0.00173"  # both picked the refined rate, where the offset is 0
    assert rows["pre"][1] == "0.08 ± 0.016 (n=5)" and rows["pre"][2] == "13 ± 1.6 (n=5)"  # seeds 1-5, block mean
    assert rows["post"][1] == "0.28 ± 0.016 (n=5); Δ +0.2 [+0.2, +0.2], higher"  # paired on the seeds both share
    assert rows["post"][2] == "13 ± 1.6 (n=5); Δ +0 [+0, +0], not distinguishable"
    assert "excess kurtosis" not in printed and f"alike gives token 0 {lr_table.uniform_head_mass(128):.4f}" in printed
    assert lr_table.uniform_head_mass(2) == 0.5 and lr_table.uniform_head_mass(3) == (1 / 2 + 1 / 3) / 2


def test_mechanism_claims_are_judged_on_the_held_out_values_in_their_papers_family(tmp_path, monkeypatch, capsys):
    """A claims file's mechanism claims (a "diagnostic" each) are judged on the held-out runs' values
    at each arm's best rate, against the baseline's at its best and second-best rates, Holm-corrected with the
    paper's loss claim in one family of three, and the loss claim on the same row is still judged on the loss."""
    def diagnostics(lr: float, seed: int, scheme: str) -> dict:
        return {"attn_first_token_mass": [0.05 + 0.01 * seed + 0.2 * (scheme == "post")],
                "stream_max_over_median": [10.0 + seed], "stream_excess_kurtosis": [0.1 * seed]}

    monkeypatch.setattr(sweep, "launch", standing_in(lambda lr, seed, scheme: 2.0 + 0.3 * math.log10(lr / 1.6e-3) ** 2
                                                     + 0.01 * seed - 0.05 * (scheme == "post"), diagnostics))
    paper = {"row": {"norm_scheme": "post"}, "paper": "X"}
    path = claims_file(tmp_path / "claims.json", [{**paper, "claim": "lower", "delta": 0.02},
                                                  {**paper, "claim": "lower", "diagnostic": "attn_first_token_mass"},
                                                  {**paper, "claim": "on_par", "delta": 1.0,
                                                   "diagnostic": "stream_max_over_median"}])
    assert sweep.main([CONFIG, "--grid", "norm_scheme=pre,post", "--set", "max_iters=4", "--lr_grid", ",".join(RATES),
                       "--seeds", "1,2,3,4,5", "--claims", path, "--out_root", str(tmp_path / "lr"), "--results",
                       str(tmp_path / "results")]) == 0
    capsys.readouterr()
    assert sweep.main(["--tables", str(tmp_path / "results")]) == 0
    printed = capsys.readouterr().out
    table, mechanism = printed.split("Mechanism")
    post = next(line for line in mechanism.splitlines() if line.startswith("| post"))
    mass, peak, kurtosis = [c.strip() for c in post.split("|")[3:6]]
    assert "Δ +0.2 [+0.2, +0.2], claim lower, δ 0: contradicted at shakespeare_char" in mass, mass
    assert "Δ +0 [+0, +0], claim on_par, δ 1: reproduced at" in peak and "family X: 3 claims" in peak, peak
    assert kurtosis.endswith("not distinguishable")  # no claim on it: described
    assert "reproduced at shakespeare_char" in next(line for line in table.splitlines() if line.startswith("| post"))


def test_a_mechanism_cell_prints_the_interval_its_word_comes_from():
    """With a seed lost on one arm (4 shared pairs, fewer than 5), the verdict is Welch's over every seed; the cell
    prints that comparison's Δ and interval, not a paired one of its own, and a judged word is never dropped, even
    on arms that share no seed."""
    values, base = {1: 0.30, 2: 0.31, 3: 0.33, 4: 0.32}, {1: 0.10, 2: 0.12, 3: 0.10, 4: 0.11, 5: 0.30}
    v = lr_table.lr_verdict(values, base, "lower", 0.0, [])
    assert not v["paired"]
    cell = lr_table.mechanism_cell(values, base, lr_table.verdict_columns(v))
    assert f"(n=4); Δ {v['diff']:+.3g} [{v['ci'][0]:+.3g}, {v['ci'][1]:+.3g}], claim lower, δ 0: " in cell, cell
    assert lr_table.mechanism_cell(values, base).endswith(f"[{v['ci'][0]:+.3g}, {v['ci'][1]:+.3g}], higher")
    apart = lr_table.lr_verdict({7: 0.3, 8: 0.4}, {1: 0.1, 2: 0.2}, "lower", 0.0, [])
    assert lr_table.mechanism_cell({7: 0.3, 8: 0.4}, {1: 0.1, 2: 0.2}, lr_table.verdict_columns(apart)).endswith(
        lr_table.verdict_columns(apart)["verdict"])


def test_results_files_record_the_metric_and_the_tables_refuse_to_mix_metrics(tmp_path, monkeypatch, capsys):
    """--metric val_bpb: the results file records the metric and each run's val_bpb; the tables regenerated from it
    are headed by it, and a study holding a sweep judged on val_loss beside it is refused by sweep.py --tables and
    plot.py --tables alike (exit 2, one line naming both), as a leaderboard refuses such sweeps."""
    stand_in = standing_in()

    def launch(job: dict, threads: int) -> dict:  # bits per byte at 4 tokens per byte: val_loss / ln 2 * 4
        info = stand_in(job, threads)
        path = pathlib.Path(job["out_dir"], "metrics.jsonl")
        records = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, **({"val_bpb": r["val_loss"] / math.log(2) * 4}
                                                      if "val_loss" in r else {})}) + "\n" for r in records))
        return info

    monkeypatch.setattr(sweep, "launch", launch)
    study = tmp_path / "results" / "study"
    assert sweep.main([CONFIG, "--grid", "norm_scheme=pre,post", "--set", "max_iters=4", "--lr_grid", ",".join(RATES),
                       "--seeds", "1,2", "--out_root", str(tmp_path / "out" / "bpb"), "--results", str(study),
                       "--metric", "val_bpb"]) == 0
    lines = [json.loads(line) for line in (study / "bpb.jsonl").read_text().splitlines()]
    assert lines[0]["metric"] == "val_bpb"
    assert all(r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2) * 4) for r in lines[1:])  # float rounding
    capsys.readouterr()
    assert sweep.main(["--tables", str(tmp_path / "results")]) == 0
    assert "final val bpb (mean ± std)" in capsys.readouterr().out
    (study / "loss.jsonl").write_text("".join(json.dumps({**line, "metric": "val_loss"}) + "\n" for line in lines))
    for command in (sweep.main, plot.main):
        extra = ["--out", str(tmp_path / "tables")] if command is plot.main else []
        assert command(["--tables", str(tmp_path / "results"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "different metrics" in err and "val_bpb" in err and "val_loss" in err


def test_the_committed_results_fixture_regenerates_its_tables_byte_for_byte(capsys):
    """tests/fixtures/results holds two sweeps of one study (depths 2 and 4, one claims file over both, made with
    runs standing in for train.py): the tables command gives tests/fixtures/results_tables.md exactly. A change to
    how tables print changes both: `python sweep.py --tables tests/fixtures/results > tests/fixtures/results_tables.md`
    after checking the difference."""
    assert sweep.main(["--tables", FIXTURE]) == 0
    assert capsys.readouterr().out == pathlib.Path(ROOT, "tests", "fixtures", "results_tables.md").read_text()


def test_tables_into_a_document_replace_its_block_and_nothing_else(tmp_path, capsys):
    """--into puts each study's tables (headings two levels down) and its figures between the study's two marker
    lines and leaves every other byte of the file as it was; a file without the block is refused before anything
    is written (exit 2, one line naming the lines to add)."""
    begin, end = plot.table_block("depth")
    doc = tmp_path / "doc.md"
    before, after = "# Results\n\nSome words.\n\n", "\n\nMore words, a table | a | b |.\n"
    doc.write_text(f"{before}{begin}\nstale tables\n{end}{after}")
    assert plot.main(["--tables", FIXTURE, "--out", str(tmp_path / "tables"), "--into", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(before + begin + "\n") and text.endswith(end + after) and "stale" not in text
    expected = pathlib.Path(ROOT, "tests", "fixtures", "results_tables.md").read_text()
    for line in expected.splitlines():
        assert ("##" + line if line.startswith("#") else line) in text
    for name in ("L2", "L4"):
        assert f"](tables/depth_{name}.png)" in text and (tmp_path / "tables" / f"depth_{name}.png").exists()
    again = text
    assert plot.main(["--tables", FIXTURE, "--out", str(tmp_path / "tables"), "--into", str(doc)]) == 0
    assert doc.read_text() == again  # the same results give the same document
    capsys.readouterr()
    doc.write_text("# no block here\n")
    assert plot.main(["--tables", FIXTURE, "--out", str(tmp_path / "other"), "--into", str(doc)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and begin in err and end in err
    assert doc.read_text() == "# no block here\n" and not (tmp_path / "other").exists()


def test_reproducing_md_holds_the_tables_its_committed_results_give(tmp_path):
    """Every study under results/ has its block in REPRODUCING.md, and regenerating the tables from results/ alone
    (`python plot.py --tables results/ --out tables/ --into REPRODUCING.md`) leaves REPRODUCING.md as committed:
    its verdict tables are the committed data's."""
    results = os.path.join(ROOT, "results")
    doc = tmp_path / "REPRODUCING.md"
    shutil.copy(os.path.join(ROOT, "REPRODUCING.md"), doc)
    assert plot.main(["--tables", results, "--out", str(tmp_path / "tables"), "--into", str(doc)]) == 0
    assert doc.read_text() == pathlib.Path(ROOT, "REPRODUCING.md").read_text()


# ----------------------------------------------------------------------------- a time budget per call


STUB_TRAIN = """import json, os, signal, sys, time
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(4))  # train.py saves and exits 4
with open(os.path.join(os.path.dirname(flags["out_dir"]), "starts.log"), "a") as f:
    f.write(flags["out_dir"] + "\\n")
time.sleep(0.5)
lr = float(flags["learning_rate"])
with open(os.path.join(flags["out_dir"], "metrics.jsonl"), "w") as f:
    for i, x in ((0, 4.0), (int(flags["max_iters"]), 2.0 + abs(lr - 3e-3) * 10 + 0.01 * int(flags["seed"]))):
        f.write(json.dumps({"kind": "eval", "iter": i, "val_loss": x}) + "\\n")
"""


def test_a_budget_stops_the_runs_and_the_same_command_continues(tmp_path, monkeypatch, capsys):
    """--budget 2.5 with runs of 0.5 s: each call runs a few, stops the one running at the end (SIGTERM),
    exits 4, and the same command goes on until the table is complete (exit 0), every run finished once. A dry run
    first prints the plan of each phase, then, with runs finished, the time they take."""
    stub = tmp_path / "stub_train.py"
    stub.write_text(STUB_TRAIN)
    monkeypatch.setattr(sweep, "TRAIN", str(stub))
    root = tmp_path / "lr"
    command = [CONFIG, "--set", "max_iters=4", "--lr_grid", "1e-3,3e-3,1e-2", "--select_seeds", "0",
               "--seeds", "1,2", "--jobs", "1", "--out_root", str(root), "--budget", "2.5"]
    assert sweep.main([*command, "--dry_run"]) == 0
    plan = capsys.readouterr().out
    assert "selection: 3 runs (3 left)" in plan and "later phases (at most): 4 runs" in plan and "not known" in plan
    codes = []
    while not codes or codes[-1] == sweep.BUDGET_EXIT:
        codes.append(sweep.main(command))
        assert len(codes) < 20, codes
    assert codes[-1] == 0 and codes.count(sweep.BUDGET_EXIT) >= 1, codes
    assert "run the same command to continue" in capsys.readouterr().out
    summary = json.loads((root / "summary.json").read_text())
    assert len(summary["runs"]) == 3 + 2 + 2  # selection, refinement of 3e-3 (1.73e-3, 5.2e-3), held-out
    # every run trained to its end; one the budget's SIGTERM reached after its last eval exits 4, and is finished
    assert all(r["reached_max_iters"] and r["exit_code"] in (0, sweep.BUDGET_EXIT) for r in summary["runs"]), \
        summary["runs"]
    starts = (root / "starts.log").read_text().split()
    finished = [r["out_dir"] for r in summary["runs"]]
    assert sorted(set(starts)) == sorted(finished)  # a stopped run starts again; a finished one never
    assert sweep.main([*command, "--dry_run"]) == 0
    plan = capsys.readouterr().out
    assert "held-out: 2 runs (0 left); at most 0 runs left" in plan and "nothing left to run" in plan, plan
    shutil.rmtree(root / "learning_rate=3e-3,seed=2")  # a held-out run lost: planned again, timed by the others
    assert sweep.main([*command, "--dry_run"]) == 0
    plan = capsys.readouterr().out
    assert "held-out: 2 runs (1 left)" in plan and "s a run (the median of the 6 finished here)" in plan, plan


# ----------------------------------------------------------------------------- a tiny sweep, trained end to end


@pytest.mark.slow
def test_a_tiny_lr_grid_sweep_runs_the_protocol_to_its_verdict_table(data_dir, tmp_path, monkeypatch, capsys):
    """Two schemes of a 2-block d 16 model, 3 iterations each, through the whole protocol: five rates on three
    selection seeds, the refinement, five held-out seeds (the baseline's at its second-best too), a claims file,
    the results file and the tables regenerated from it alone (every run trained in this process)."""
    settings = tiny_run_args(data_dir, "unused", max_iters=3, lr_decay_iters=3, eval_interval=3, eval_iters=1,
                             n_embd=16, n_head=2, sample_tokens=0)
    fixed = [a[2:] for a in settings if not a.startswith(("--out_dir=", "--learning_rate="))]
    monkeypatch.setattr(sweep.CHILDREN, "start", TrainInProcess)
    path = claims_file(tmp_path / "claims.json", [{"row": {"norm_scheme": "post"}, "claim": "lower", "delta": 0.02,
                                                   "paper": "X"}])
    root, results = tmp_path / "lr", tmp_path / "results"
    assert sweep.main([CONFIG, "--grid", "norm_scheme=pre,post", "--lr_grid", "1e-4,1e-3,1e-2,1e-1,1", "--seeds",
                       "1,2,3,4,5", "--claims", path, "--jobs", "1", "--threads_per_run", "1", "--out_root", str(root),
                       "--results", str(results), "--set", *fixed]) == 0
    summary = json.loads((root / "summary.json").read_text())
    [pre, post] = summary["lr_points"]
    assert summary["select_seeds"] == [0, 6, 7] and len(post["seed_losses"]) == 5
    assert post["claim"] == "lower" and post["family"] == "X" and "L 2, d 16" in post["verdict"]
    capsys.readouterr()
    shutil.rmtree(root)
    assert sweep.main(["--tables", str(results)]) == 0
    assert post["verdict"] in capsys.readouterr().out


def test_the_committed_claims_files_read_and_name_their_families():
    """claims/*.json are fixed before their studies' runs: each reads as a claims file, one claim per row and
    diagnostic."""
    for name in os.listdir(os.path.join(ROOT, "claims")):
        claims = sweep.read_claims(os.path.join(ROOT, "claims", name))
        rows = [(tuple(sorted(c.row.items())), c.diagnostic) for c in claims.claims]
        assert len(rows) == len(set(rows)) and all(claims.family_size(c.family) >= 1 for c in claims.claims)


@pytest.mark.parametrize("flags, message", [
    (["--budget", "0"], "--budget 0"),
    (["--tables", "no_such_folder"], "no such folder"),
    (["--results", "results"], "--results goes with --lr_grid"),
    (["--claims", DEPTH_CLAIMS], "--claims goes with --lr_grid"),
    (["--lr_grid", "1e-3", "--claims", DEPTH_CLAIMS, "--row_claim", "norm_scheme=pre:none"], "not both"),
    (["--lr_grid", "1e-3", "--claims", DEPTH_CLAIMS, "--baseline", "norm_scheme=post"], "not the baseline"),
])
def test_bad_protocol_input_exits_2_with_one_line(tmp_path, capsys, flags, message):
    assert sweep.main([CONFIG, "--grid", "norm_scheme=pre,post", "--out_root", str(tmp_path), "--dry_run",
                       *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err

"""sweep.py and plot.py on real tiny train.py runs: summaries, skipping, resuming, divergence, labels, PNGs."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_run_args

import plot
import sweep

CONFIG = os.path.join(ROOT, "configs", "cpu_base.py")


def tiny_settings(data_dir: str) -> dict[str, str]:
    """tiny_run_args as sweep.py --set pairs, 4 iterations; sweep.py chooses out_dir itself."""
    args = tiny_run_args(data_dir, "unused", max_iters=4, lr_decay_iters=4)
    settings = dict(arg[2:].split("=", 1) for arg in args)
    del settings["out_dir"]
    return settings


def read_summary(out_root: str) -> dict:
    with open(os.path.join(out_root, "summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def sweep_root(data_dir, tmp_path_factory) -> str:
    """A finished sweep: norm_scheme=pre,geonorm x seed 1, both runs at once on one thread each."""
    out_root = str(tmp_path_factory.mktemp("sweep"))
    sweep.run_sweep(CONFIG, {"norm_scheme": ["pre", "geonorm"]}, seeds=[1], fixed=tiny_settings(data_dir),
                    out_root=out_root, jobs=2, threads_per_run=1)
    return out_root


@pytest.fixture(scope="module")
def diverged_root(data_dir, tmp_path_factory) -> tuple[str, subprocess.CompletedProcess]:
    """One run with learning rate 1e6, through the command line."""
    out_root = str(tmp_path_factory.mktemp("diverged"))
    fixed = [f"{k}={v}" for k, v in tiny_settings(data_dir).items() if k != "learning_rate"]
    cmd = [sys.executable, "sweep.py", CONFIG, "--grid", "learning_rate=1e6", "--out_root", out_root,
           "--threads_per_run", "1", "--set", *fixed]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return out_root, result


def test_expand_grid_covers_every_combination_then_every_seed():
    points = sweep.expand_grid({"norm_scheme": ["pre", "geonorm"], "learning_rate": [1e-3, 2e-3]}, seeds=[1, 2])
    assert len(points) == 8 and len({tuple(p.items()) for p in points}) == 8
    assert points[:3] == [{"norm_scheme": "pre", "learning_rate": 1e-3, "seed": 1},
                          {"norm_scheme": "pre", "learning_rate": 1e-3, "seed": 2},
                          {"norm_scheme": "pre", "learning_rate": 2e-3, "seed": 1}]
    assert sweep.expand_grid({"norm": ["layernorm"]}) == [{"norm": "layernorm"}]


def test_tied_grid_keys_take_the_same_value(data_dir, tmp_path):
    jobs = sweep.plan_runs(CONFIG, {"learning_rate+min_lr": ["1e-3", "2e-3"]}, None, tiny_settings(data_dir),
                           str(tmp_path))
    assert [job["point"] for job in jobs] == [{"learning_rate+min_lr": "1e-3"}, {"learning_rate+min_lr": "2e-3"}]
    assert {"--learning_rate=2e-3", "--min_lr=2e-3"} <= set(jobs[1]["argv"])
    assert "--learning_rate=1e-3" not in jobs[1]["argv"]  # the grid value replaces the --set one


def test_auto_jobs_give_one_run_all_cores_unless_runs_get_fewer_threads():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert sweep.parallelism("auto", None) == (1, cores)
    assert sweep.parallelism("auto", 1) == (cores, 1)
    assert sweep.parallelism(2, None) == (2, max(1, cores // 2))


def test_sweep_summary_has_finite_losses_timing_and_exit_codes(sweep_root):
    summary = read_summary(sweep_root)
    rows = summary["runs"]
    assert [(r["norm_scheme"], r["seed"]) for r in rows] == [("pre", 1), ("geonorm", 1)]
    for row in rows:
        assert row["exit_code"] == 0 and row["diverged_at"] is None
        assert math.isfinite(row["train_loss"]) and math.isfinite(row["val_loss"])
        assert row["wall_s"] > 0 and row["ms_per_iter"] > 0
        assert os.path.getsize(os.path.join(row["out_dir"], "train.log")) > 0
    assert [p["norm_scheme"] for p in summary["grid_points"]] == ["pre", "geonorm"]
    assert summary["grid_points"][0]["ms_vs_baseline"] == pytest.approx(1.0)  # the first point is the baseline
    with open(os.path.join(sweep_root, "summary.md")) as f:
        assert "final val loss (mean ± std)" in f.read()


def test_rerun_skips_finished_runs(sweep_root, data_dir, monkeypatch):
    def refuse(job, threads):
        pytest.fail(f"launched {job['out_dir']}, which had finished")

    monkeypatch.setattr(sweep, "launch", refuse)
    rows = sweep.run_sweep(CONFIG, {"norm_scheme": ["pre", "geonorm"]}, seeds=[1], fixed=tiny_settings(data_dir),
                           out_root=sweep_root)
    assert [r["exit_code"] for r in rows] == [0, 0]  # taken from the first sweep's run.json
    jobs = sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], tiny_settings(data_dir), sweep_root, rerun=True)
    assert jobs[0]["state"] == "new" and "--overwrite=True" in jobs[0]["argv"]


def test_extra_columns_take_the_last_evaluation_that_logged_them(sweep_root):
    run = os.path.join(sweep_root, "norm_scheme=pre,seed=1")
    evals = [r for r in plot.load_metrics(run) if r["kind"] == "eval"]
    [row] = sweep.summarize([run], extra=["val_loss", "block_rms", "never_logged"])
    assert row["val_loss"] == evals[-1]["val_loss"]
    assert row["block_rms"] is None and row["never_logged"] is None  # lists and missing keys stay empty
    table = sweep.format_table([row], ["val_loss", "never_logged"])
    assert f"{evals[-1]['val_loss']:.4f}" in table and "| -" in table


def test_unfinished_run_resumes_from_its_checkpoint(sweep_root, data_dir, tmp_path):
    run = "norm_scheme=pre,seed=1"
    shutil.copytree(os.path.join(sweep_root, run), tmp_path / run)
    metrics = tmp_path / run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(line for line in lines if json.loads(line)["iter"] < 4))  # no final evaluation
    plan = sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], tiny_settings(data_dir), str(tmp_path))
    assert plan[0]["state"] == "resume" and plan[0]["argv"][-1] == "--init_from=resume"
    os.remove(tmp_path / run / "ckpt.pt")  # nothing to resume from: start again
    plan = sweep.plan_runs(CONFIG, {"norm_scheme": ["pre"]}, [1], tiny_settings(data_dir), str(tmp_path))
    assert plan[0]["state"] == "new" and not any(a.startswith("--init_from") for a in plan[0]["argv"])


def test_diverging_run_is_reported_with_its_iteration(diverged_root):
    out_root, result = diverged_root
    assert result.returncode == 0, result.stdout + result.stderr  # a divergence is a result, not a failure
    (row,) = read_summary(out_root)["runs"]
    status = [r for r in plot.load_metrics(row["out_dir"]) if r["kind"] == "status"]
    assert row["exit_code"] == 3 and status and row["diverged_at"] == status[0]["iter"]
    assert f"diverged at iteration {row['diverged_at']}" in result.stdout
    (point,) = read_summary(out_root)["grid_points"]
    assert point["diverged"] == 1 and point["val_loss_mean"] is None  # a diverged run is not averaged


def test_aggregate_averages_seeds_and_compares_ms_per_iter_to_the_baseline():
    def row(scheme, seed, val, ms, diverged=None):
        return {"norm_scheme": scheme, "seed": seed, "val_loss": val, "ms_per_iter": ms, "diverged_at": diverged,
                "exit_code": 3 if diverged else 0}

    rows = [row("pre", 1, 2.0, 10.0), row("pre", 2, 2.2, 10.0),
            row("geonorm", 1, 1.8, 12.0), row("geonorm", 2, 9.9, 18.0, diverged=7)]
    pre, geonorm = sweep.aggregate(rows, ["norm_scheme"], baseline={"norm_scheme": "pre"})
    assert pre["val_loss_mean"] == pytest.approx(2.1) and pre["val_loss_std"] == pytest.approx(0.02 ** 0.5)
    assert pre["val_loss_mean_std"] == "2.1000 ± 0.1414"
    assert geonorm["diverged"] == 1 and geonorm["val_loss_mean_std"] == "1.8000"
    assert geonorm["ms_vs_baseline"] == pytest.approx(1.5)
    assert "diverged at iteration 7" in sweep.format_table(rows)


def test_differing_flags_name_only_the_flags_that_differ():
    runs = {"out/a": {"norm_scheme": "pre", "geonorm_decay": "harmonic", "n_layer": 4, "out_dir": "out/a"},
            "out/b": {"norm_scheme": "geonorm", "geonorm_decay": "sqrt", "n_layer": 4, "out_dir": "out/b"},
            "out/no_checkpoint": None}
    assert plot.differing_flags(runs) == {"out/a": "norm_scheme=pre, geonorm_decay=harmonic",
                                          "out/b": "norm_scheme=geonorm, geonorm_decay=sqrt",
                                          "out/no_checkpoint": "no_checkpoint"}
    same = {"out/a": {"n_layer": 4}, "out/b/": {"n_layer": 4}}
    assert plot.differing_flags(same) == {"out/a": "a", "out/b/": "b"}  # nothing differs: the names
    # a primitive overridden in one run only: the other run shows its scheme's value, not None
    ablation = {"out/a": {"qk_norm": None, "scheme": {"qk_norm": True}}, "out/b": {"qk_norm": False}}
    assert plot.differing_flags(ablation) == {"out/a": "qk_norm=True", "out/b": "qk_norm=False"}
    # a checkpoint from before a key existed lacks it: not a difference to label
    older = {"out/a": {"n_layer": 4}, "out/b": {"n_layer": 6, "skip_nonfinite": 0}}
    assert plot.differing_flags(older) == {"out/a": "n_layer=4", "out/b": "n_layer=6"}


def test_plot_draws_a_png_labelled_by_the_differing_flags(sweep_root, diverged_root, tmp_path):
    runs = [os.path.join(sweep_root, name) for name in ("norm_scheme=pre,seed=1", "norm_scheme=geonorm,seed=1")]
    fig = plot.draw(runs, ["loss", "val_loss"])
    assert len(fig.axes) == 2
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["norm_scheme=pre", "norm_scheme=geonorm"]
    per_block = plot.draw(runs[:1], ["block_rms"])  # one run: one curve per block (n_layer=2)
    assert [t.get_text() for t in per_block.axes[0].get_legend().get_texts()] == ["block 0", "block 1"]
    diverged = read_summary(diverged_root[0])["runs"][0]["out_dir"]
    crossed = plot.draw([*runs, diverged], ["loss"]).axes[0].get_lines()
    assert [line.get_marker() for line in crossed].count("x") == 1  # the x where the run diverged
    out = tmp_path / "runs.png"
    plot.main([*runs, diverged, "--metric", "loss,val_loss", "--logy", "--smooth", "2", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < out.stat().st_size < 500_000

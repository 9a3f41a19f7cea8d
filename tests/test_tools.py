"""sweep.py, plot.py and sample.py on real tiny train.py runs: summaries, skipping, resuming, divergence, labels,
PNGs, samples."""

import ast
import contextlib
import io
import json
import math
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_run_args

import plot
import sample
import sweep
import train
from nanonorm import runs
from nanonorm import verdict as rule
from nanonorm.lr_table import point_warnings

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
def diverged_root(data_dir, tmp_path_factory) -> tuple[str, int, str]:
    """One run with learning rate 1e6, a train.py process, through sweep.py's command line (its main, in this
    process: test_sweep_runs.py runs sweep.py as a process); the sweep's exit code and what it printed."""
    out_root = str(tmp_path_factory.mktemp("diverged"))
    fixed = [f"{k}={v}" for k, v in tiny_settings(data_dir).items() if k != "learning_rate"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = sweep.main([CONFIG, "--grid", "learning_rate=1e6", "--out_root", out_root, "--threads_per_run", "1",
                           "--set", *fixed])
    return out_root, code, printed.getvalue()


def imported_modules(path: str) -> set[str]:
    """The top-level names a Python file imports, anywhere in it (functions' lazy imports too)."""
    tree = ast.parse(pathlib.Path(ROOT, path).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_sweep_plot_and_runs_import_one_way():
    """nanonorm/runs.py <- sweep.py <- plot.py: what both scripts read of a run lives below them, and no two import
    each other (a cycle that worked only while every import of one was lazy)."""
    assert not {"sweep", "plot"} & imported_modules("nanonorm/runs.py")
    assert "nanonorm.runs" in imported_modules("sweep.py") and "plot" not in imported_modules("sweep.py")
    assert "nanonorm.runs" in imported_modules("plot.py")


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


class WriteCalls:
    """A stdout that keeps every write() call apart."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_runs_at_once_print_whole_lines(tmp_path, monkeypatch):
    """Two runs at a time: a run's start line (from a worker thread) and each outcome (from the main thread)
    reach stdout in one write with their newline, so no line lands inside another."""
    (tmp_path / "train.py").write_text("")  # a run that ends at once
    monkeypatch.setattr(sweep, "TRAIN", str(tmp_path / "train.py"))
    jobs = [{"out_dir": str(tmp_path / f"run{i}"), "state": "new", "argv": [], "point": {"seed": i}, "settings": {}}
            for i in range(4)]
    stdout = WriteCalls()
    with contextlib.redirect_stdout(stdout):
        sweep.execute(jobs, workers=2, threads=1)
    lines = [text for text in stdout.calls if text]
    assert all(line.endswith("\n") and line.count("\n") == 1 for line in lines), lines
    assert sorted(line.split()[0] for line in lines) == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"] + ["start"] * 4


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


def test_sample_resolves_device_auto(data_dir, tmp_path, capsys):
    run = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, run, max_iters=2, eval_interval=2)) == 0
    capsys.readouterr()
    assert sample.main([f"--out_dir={run}", "--max_new_tokens=3", "--device=auto"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and out.out.endswith("-" * 40 + "\n")
    # `sample.py ... | head`: a reader that has gone ends it quietly, as it does a sweep (below)
    assert run_with_closed_stdout(["sample.py", f"--out_dir={run}", "--max_new_tokens=3"]) == (141, "")


def run_with_closed_stdout(argv: list[str]) -> tuple[int, str]:
    """Run `python *argv` with stdout a pipe whose reader is already closed (the reader is gone before the first
    line, so the first write fails: no race with a real `head`); its exit code and stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    finally:
        os.close(write_end)
    return result.returncode, result.stderr


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
    out_root, code, printed = diverged_root
    assert code == 0, printed  # a divergence is a result, not a failure
    (row,) = read_summary(out_root)["runs"]
    status = [r for r in plot.load_metrics(row["out_dir"]) if r["kind"] == "status"]
    assert row["exit_code"] == 3 and status and row["diverged_at"] == status[0]["iter"]
    assert f"diverged at iteration {row['diverged_at']}" in printed
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


def test_list_metrics_read_one_block_or_the_largest():
    records = [{"kind": "eval", "iter": 0, "attn_logit_max": [1.0, 5.0, 2.0]},
               {"kind": "eval", "iter": 10, "attn_logit_max": [7.0, 3.0, 2.0]}]
    assert plot.curves(records, "attn_logit_max[max]", "iter", per_block=True) == {"": ([0, 10], [5.0, 7.0])}
    assert plot.curves(records, "attn_logit_max[1]", "iter", per_block=True) == {"": ([0, 10], [5.0, 3.0])}
    assert list(plot.curves(records, "attn_logit_max", "iter", per_block=True)) == ["block 0", "block 1", "block 2"]


def test_plot_draws_a_png_labelled_by_the_differing_flags(sweep_root, diverged_root, tmp_path):
    runs = [os.path.join(sweep_root, name) for name in ("norm_scheme=pre,seed=1", "norm_scheme=geonorm,seed=1")]
    fig = plot.draw(runs, ["loss", "val_loss"])
    assert len(fig.axes) == 2
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["norm_scheme=pre", "norm_scheme=geonorm"]
    per_block = plot.draw(runs[:1], ["block_rms"])  # one run: one curve per block (n_layer=2)
    assert [t.get_text() for t in per_block.axes[0].get_legend().get_texts()] == ["block 0", "block 1"]
    diverged = read_summary(diverged_root[0])["runs"][0]["out_dir"]
    assert not os.path.exists(os.path.join(diverged, "ckpt.pt"))  # it stopped before its first checkpoint
    crossed = plot.draw([*runs, diverged], ["loss"]).axes[0].get_lines()
    assert [line.get_marker() for line in crossed].count("x") == 1  # the x where the run diverged
    # its label comes from its command line (run.json), in the same flags as the runs with checkpoints
    labels = plot.differing_flags({d: plot.run_config(d) for d in [*runs, diverged]})
    assert labels[diverged] == "norm_scheme=pre, learning_rate=1000000.0, seed=1337"  # the config's seed
    assert labels[runs[1]].startswith("norm_scheme=geonorm, learning_rate=")
    out = tmp_path / "runs.png"
    plot.main([*runs, diverged, "--metric", "loss,val_loss", "--logy", "--smooth", "2", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < out.stat().st_size < 500_000


@pytest.mark.parametrize("argv, message", [
    (["MISSING"], r"MISSING has no metrics.jsonl, or no readable line in it; pass the out_dir of a train.py run"),
    (["GARBLED"], r"GARBLED has no metrics.jsonl, or no readable line in it"),
    (["RUN/metrics.jsonl"], r"every path given is a file; pass train.py out_dirs"),
    (["RUN", "--smooth", "0"], r"--smooth 0 must be at least 1"),
    (["RUN", "--metric", "val_los"], r"no run logged 'val_los' against 'iter'; logged: val_loss"),
    (["RUN", "--metric", "block_rms[x"], r"cannot read metric 'block_rms\[x'"),
    (["RUN", "--ref", "zero"], r"--ref 'zero': write NAME=VALUE with a number"),
    (["RUN", "--ref", "x=inf", "--out", "OUT/fig.png"], r"--ref 'x=inf': a reference line needs a finite value"),
    (["RUN", "--ref", "x=nan", "--out", "OUT/fig.png"], r"--ref 'x=nan': a reference line needs a finite value"),
    (["RUN", "--title", "$\\foo$", "--out", "OUT/fig.png"],
     r"--title '\$\\foo\$': matplotlib .* cannot parse it .*; write \\\$ for a literal"),
    (["RUN", "--out", "OUT/fig.xyz"], r"fig.xyz: matplotlib writes no .xyz files; end it in .*\.png"),
    (["RUN", "--out", "RUN/metrics.jsonl/fig.png"], r"cannot write .*metrics.jsonl.*; give --out a writable path"),
    (["--lr_sweep", "RUN"], r"RUN has no summary.json; pass the --out_root of a sweep.py --lr_grid run"),
    (["--depth", "RUN"], r"RUN has no summary.json; pass the --out_root of a sweep.py --lr_grid run"),
    (["--depth", "--lr_sweep", "RUN"], r"--depth and --lr_sweep draw different figures: give one"),
])
def test_plot_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, message):
    run, garbled = tmp_path / "run", tmp_path / "garbled"
    run.mkdir(), garbled.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "eval", "iter": 0, "val_loss": 2.0}\n')
    (garbled / "metrics.jsonl").write_text("not json\n")
    paths = {"RUN": str(run), "GARBLED": str(garbled), "MISSING": str(tmp_path / "missing"), "OUT": str(tmp_path)}
    argv = [next((a.replace(k, v, 1) for k, v in paths.items() if a.startswith(k)), a) for a in argv]
    message = next((message.replace(k, re.escape(v), 1) for k, v in paths.items() if message.startswith(k)), message)
    assert plot.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: ") and out.err.count("\n") == 1, out.err
    assert re.search(message, out.err), out.err


@pytest.mark.parametrize("line, message", [
    ('{"kind": "eval", "iter": 4, "val_loss": "1.0"}', r'line 2: val_loss is "1.0", not a number or null'),
    ('{"kind": "eval", "iter": "4", "val_loss": 1.0}', r'line 2: iter is "4", not an integer'),
    ('{"kind": "eval", "iter": 4.0, "val_loss": 1.0}', r"line 2: iter is 4.0, not an integer"),
    ('{"kind": "train", "loss": 1.0}', r"line 2: a train line without its iter"),
    ('{"kind": "status", "status": "diverged", "iter": true}', r"line 2: iter is true, not an integer"),
    ('{"kind": "train", "iter": 4, "loss": 1.0, "lr": true}', r"line 2: lr is true, not a number or null"),
    ('{"kind": "eval", "iter": 4, "block_rms": [1.0, "x"]}', r'line 2: block_rms is \[1.0, "x"\], not a number'),
])
def test_metrics_of_the_wrong_type_exit_2_naming_the_line(tmp_path, capsys, line, message):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "iter": 0, "val_loss": 2.0}\n' + line + "\n")
    with pytest.raises(runs.RunFileError, match=re.escape(str(tmp_path / "metrics.jsonl")) + " " + message):
        runs.load_metrics(str(tmp_path))
    with pytest.raises(runs.RunFileError, match=message):  # not a TypeError in sweep's summary
        sweep.summarize([str(tmp_path)])
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "fig.png")]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_metrics_as_train_py_writes_them_are_read(tmp_path):
    lines = [{"kind": "train", "iter": 0, "loss": 4.0, "lr": 1e-3, "ms_per_iter": 5.0, "tokens_per_s": 1e4,
              "mfu": 0.01, "skipped": 0},
             {"kind": "eval", "iter": 0, "train_loss": 4.0, "val_loss": None, "val_xy_loss": 1.0, "best_loss": 0.5,
              "val_loss_per_t": [1.0, None], "block_rms": [1.0, None], "attn_logit_max": [2.0, 3.0],
              "grad_norms": {"wte.weight": 0.1}, "grad_kurtosis": 3.0, "grad_abs_hist": [1, 2]},
             {"kind": "status", "status": "diverged", "iter": 1, "reason": "non-finite", "block": None,
              "nonfinite": ["wte.weight"], "n_nonfinite": 1},
             {"kind": "status", "status": "stopped", "iter": 1, "signal": "SIGTERM", "saved": True}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert plot.load_metrics(str(tmp_path)) == lines
    assert plot.curves(lines, "block_rms[max]", "iter", False) == {"": ([0], [1.0])}  # a null block is no maximum


def test_lr_sweeps_held_out_on_different_seed_counts_give_the_range(monkeypatch):
    """The figure's setup line says how many seeds each best rate holds out; arms with 12 and 5 must not read as 12."""
    summaries = {root: {"runs": [], "lr_points": [], "lr_key": "learning_rate", "keys": ["norm_scheme"],
                        "setup": {"seeds": n, "n_layer": 32}} for root, n in (("a", 12), ("b", 5), ("c", 12))}
    monkeypatch.setattr(sweep, "read_lr_summary", summaries.__getitem__)
    assert plot.load_lr_sweeps(["a", "b", "c"])["setup"]["seeds"] == "5–12"
    assert plot.load_lr_sweeps(["a", "c"])["setup"]["seeds"] == 12


def test_depth_figure_draws_each_arms_held_out_mean_and_sensitivity_at_its_depth(monkeypatch, tmp_path):
    def summary(depth, scheme, losses, sensitivity):
        point = {"norm_scheme": scheme, "best_lr": "1e-2", "val_loss_mean": statistics.mean(losses),
                 "seed_losses": dict(enumerate(losses, 1)), "lr_sensitivity": sensitivity}
        return {"runs": [], "lr_points": [point], "lr_key": "learning_rate", "keys": ["norm_scheme"],
                "setup": {"n_layer": depth, "seeds": len(losses)}}
    summaries = {"pre4": summary(4, "pre", [2.0, 2.2], 0.3), "pre32": summary(32, "pre", [2.5, 2.7, 2.6], 0.2),
                 "lns32": summary(32, "lns", [2.3, 2.3], 0.1), "lns4": summary(4, "lns", [2.4, 2.4], 0.4)}
    monkeypatch.setattr(sweep, "read_lr_summary", summaries.__getitem__)
    loss_ax, sens_ax = plot.draw_depth(["pre32", "lns4", "pre4", "lns32"]).axes
    drawn = {c.get_label(): (list(c.lines[0].get_xdata()), list(c.lines[0].get_ydata()))
             for c in loss_ax.containers}
    assert drawn == {"lns": ([4, 32], [2.4, 2.3]), "pre": ([4, 32], [pytest.approx(2.1), pytest.approx(2.6)])}
    assert sorted(list(line.get_ydata()) for line in sens_ax.lines) == [[0.3, 0.2], [0.4, 0.1]]
    with pytest.raises(plot.PlotError, match="two sweeps give pre at n_layer 4"):
        plot.draw_depth(["pre4", "pre4"])
    summaries["nodepth"] = {**summary(4, "pre", [2.0], None), "setup": {}}
    assert plot.main(["nodepth", "--depth", "--out", str(tmp_path / "d.png")]) == 2


def test_plot_adds_png_to_an_out_without_extension_and_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "eval", "iter": 0, "val_loss": 2.0}\n'
                                       '{"kind": "eval", "iter": 1, "val_loss": 1.0}\n')
    assert plot.main([str(run), "--out", str(tmp_path / "figures" / "curves")]) == 0
    written = tmp_path / "figures" / "curves.png"
    assert capsys.readouterr().out == f"wrote {written}\n" and written.read_bytes()[:4] == b"\x89PNG"


def test_dollar_signs_in_run_names_and_references_are_drawn_as_text(tmp_path, capsys):
    """Matplotlib parses the text between two $ as math; "$x^{$" would fail to draw (a crash at savefig)."""
    runs = [tmp_path / "lr$x^{$a", tmp_path / "lr$x^{$b"]
    for run in runs:
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"kind": "eval", "iter": 0, "val_loss": 2.0}\n'
                                           '{"kind": "eval", "iter": 1, "val_loss": 1.0}\n')
    for chosen in (runs[:1], runs):  # one run: its name in the title; two: in the legend
        out = tmp_path / f"fig{len(chosen)}.png"
        assert plot.main([*map(str, chosen), "--ref", "$base{$=1.5", "--out", str(out)]) == 0, capsys.readouterr().err
        assert out.read_bytes()[:4] == b"\x89PNG"
    legend = plot.draw(list(map(str, runs)), ["val_loss"]).axes[0].get_legend().get_texts()
    assert [t.get_text() for t in legend] == [r"lr\$x^{\$a", r"lr\$x^{\$b"]


def test_seed_means_draw_one_curve_per_setting_with_its_mean_and_band(tmp_path, monkeypatch):
    losses = {("pre", 1): [4.0, 3.0, 2.0], ("pre", 2): [4.2, 3.2, 2.4], ("ngpt", 1): [4.0, 2.5, 2.2],
              ("ngpt", 2): [4.0, 2.7, 2.2]}
    configs = {}
    for (scheme, seed), ys in losses.items():
        run = tmp_path / f"{scheme}_{seed}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "eval", "iter": 50 * i, "val_loss": y}) + "\n"
                                                   for i, y in enumerate(ys)))
        configs[str(run)] = {"norm_scheme": scheme, "seed": seed}
    monkeypatch.setattr(plot, "run_config", lambda d: configs[d])
    fig = plot.draw(list(configs), ["val_loss"], seed_means=True, references={"target": 2.2}, title="setup")
    ax = fig.axes[0]
    curves = {line.get_label(): line.get_ydata().tolist() for line in ax.get_lines() if line.get_label()[0] != "_"}
    assert curves["norm_scheme=pre (mean of 2 seeds)"] == pytest.approx([4.1, 3.1, 2.2])
    assert curves["norm_scheme=ngpt (mean of 2 seeds)"] == pytest.approx([4.0, 2.6, 2.2])
    assert len(ax.collections) == 2  # one min-max band per setting
    assert any(list(line.get_ydata()) == [2.2, 2.2] for line in ax.get_lines())  # the reference line
    assert fig._suptitle.get_text() == "setup"


def test_seed_means_keep_a_diverged_seed_out_of_the_mean_and_name_it(tmp_path, monkeypatch):
    """A seed that diverged before its first checkpoint has no config: it joins its sweep siblings' curve by
    its out_dir's name, stays out of their mean, and is counted in the label."""
    configs = {}
    for seed, ys in ((1, [4.0, 3.0, 2.0]), (2, [4.2, 3.2, 2.4]), (3, [4.1, float("nan")])):
        run = tmp_path / "sweep" / f"learning_rate=1e-2,seed={seed}"
        run.mkdir(parents=True)
        lines = [{"kind": "eval", "iter": 50 * i, "val_loss": y} for i, y in enumerate(ys)]
        if seed == 3:
            lines.append({"kind": "status", "status": "diverged", "iter": 60})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        configs[str(run)] = None if seed == 3 else {"optimizer": "adamw", "seed": seed}
    other = tmp_path / "other" / "seed=1"
    other.mkdir(parents=True)
    (other / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "iter": 0, "val_loss": 4.0}) + "\n")
    configs[str(other)] = {"optimizer": "muon", "seed": 1}
    monkeypatch.setattr(plot, "run_config", lambda d: configs[d])
    ax = plot.draw(list(configs), ["val_loss"], seed_means=True).axes[0]
    curves = {line.get_label(): line.get_ydata().tolist() for line in ax.get_lines() if line.get_label()[0] != "_"}
    assert curves["optimizer=adamw (mean of 2 seeds; 1 diverged: dashed, x)"] == pytest.approx([4.1, 3.1, 2.2])
    assert curves["optimizer=muon (mean of 1 seed)"] == pytest.approx([4.0])
    assert any(line.get_marker() == "x" and line.get_xdata()[0] == 60 for line in ax.get_lines())


# ----------------------------------------------------------------------------- learning-rate sweeps and verdicts


def test_the_interval_uses_students_t_quantiles():
    # paired by seed, five differences: the half-width is t(0.975, 4) = 2.776 (a t table, 4 significant digits,
    # hence the 1e-3 tolerance) times their standard error, around their mean 0.1
    v = rule.compare_arms([1.1, 1.0, 1.2, 1.05, 1.15], [1.0] * 5, paired=True)
    se = statistics.stdev([0.1, 0.0, 0.2, 0.05, 0.15]) / math.sqrt(5)
    assert v["diff"] == pytest.approx(0.1) and v["se"] == pytest.approx(se) and v["df"] == 4
    assert (v["ci"][1] - v["ci"][0]) / 2 == pytest.approx(2.776 * se, rel=1e-3)
    welch = rule.compare_arms([1.0, 1.2, 1.1], [2.0, 2.0, 2.0])  # the second arm has no spread: df = 3 - 1
    assert welch["df"] == pytest.approx(2) and welch["ci"][1] - welch["diff"] == pytest.approx(4.303 * welch["se"],
                                                                                              rel=1e-3)


def test_verdict_rule_on_synthetic_losses():
    base = [2.00, 2.02, 1.98, 2.01, 1.99]
    assert sweep.verdict([1.80, 1.82, 1.78, 1.81, 1.79], base, "lower")["verdict"] == "reproduced"  # clear win
    assert sweep.verdict([2.20, 2.22, 2.18, 2.21, 2.19], base, "lower")["verdict"] == "contradicted"  # clear loss
    assert sweep.verdict([2.01, 1.97, 2.03, 1.99, 2.0], base, "lower")["verdict"] == "inconclusive at this scale"
    assert sweep.verdict([2.20, 2.22, 2.18, 2.21, 2.19], base, "higher")["verdict"] == "reproduced"
    # a small shift shared by every seed: lost in the seed spread unpaired, found when paired by seed
    spread = [2.00, 2.50, 3.00, 2.25, 2.75]
    shifted = [1.990, 2.491, 2.989, 2.240, 2.741]
    assert sweep.verdict(shifted, spread, "lower")["verdict"] == "inconclusive at this scale"
    paired = sweep.verdict(shifted, spread, "lower", paired=True)
    assert paired["verdict"] == "reproduced" and paired["test"] == "paired t" and paired["p"] < 0.05
    # divergence: an arm that diverged on every seed loses to one that trained on every seed
    assert sweep.verdict(base, [math.inf] * 5, "lower")["verdict"] == "reproduced"
    assert sweep.verdict([math.inf] * 5, base, "lower")["verdict"] == "contradicted"
    assert sweep.verdict([1.8], base, "lower")["verdict"] == "inconclusive at this scale"  # one seed: no spread


def lr_row(lr: str, val: float | None, diverged: int | None = None, code: int = 0) -> dict:
    return {"learning_rate": lr, "seed": 1, "val_loss": val, "diverged_at": diverged, "exit_code": code}


def test_best_rate_ranks_a_diverged_run_last_and_keeps_it():
    grid = ["1e-3", "3e-3", "1e-2", "3e-2"]
    rows = [lr_row("1e-3", 2.3), lr_row("3e-3", 2.1), lr_row("1e-2", 2.2), lr_row("3e-2", 1.0, diverged=50, code=3)]
    best = sweep.pick_best(rows, "learning_rate", grid)
    assert best["best_lr"] == "3e-3" and best["diverged_lrs"] == ["3e-2"] and best["edge_warning"] is None
    nan = sweep.pick_best([lr_row("1e-3", math.nan), lr_row("3e-3", 2.5)], "learning_rate", grid)
    assert nan["best_lr"] == "3e-3"  # a non-finite loss never wins
    assert sweep.pick_best([lr_row("1e-3", None, diverged=3, code=3)], "learning_rate", grid)["best_lr"] is None


def test_best_rate_on_an_edge_of_the_grid_warns():
    grid = ["1e-3", "3e-3", "1e-2"]
    low = sweep.pick_best([lr_row("1e-3", 2.0), lr_row("3e-3", 2.1), lr_row("1e-2", 2.2)], "learning_rate", grid)
    high = sweep.pick_best([lr_row("1e-3", 2.3), lr_row("3e-3", 2.1), lr_row("1e-2", 2.0)], "learning_rate", grid)
    assert "lowest" in low["edge_warning"] and "highest" in high["edge_warning"]


def test_lr_sensitivity_caps_each_rate_at_the_initial_loss_and_subtracts_the_best(tmp_path):
    # Wortsman et al. (2023): mean over rates of min(final, initial) - best; a diverged run and one that
    # ends above its start both count at the initial loss (4.0 here)
    def run(lr, final, seed=1, diverged=None):
        out_dir = tmp_path / f"{lr},{seed}"
        out_dir.mkdir()
        (out_dir / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "iter": 0, "val_loss": 4.0}) + "\n")
        return {**lr_row(lr, final, diverged, 3 if diverged else 0), "seed": seed, "out_dir": str(out_dir)}

    rows = [run("1e-3", 2.0), run("1e-2", 1.8), run("1e-1", None, diverged=7), run("3e-1", 5.0)]
    assert sweep.lr_sensitivity(rows, "learning_rate") == pytest.approx((2.0 + 1.8 + 4.0 + 4.0) / 4 - 1.8)
    assert sweep.lr_sensitivity(rows, "learning_rate", {1e-3, 0.01}) == pytest.approx(0.1)  # over those rates only
    assert sweep.lr_sensitivity(rows[2:3], "learning_rate") is None  # no rate trained: nothing to be sensitive to
    assert sweep.lr_sensitivity([lr_row("1e-3", 2.0)], "learning_rate") is None  # no initial loss logged
    later = [run("1e-2", 1.9, seed=2)]
    assert sweep.first_seed_runs(later + rows, "learning_rate") == rows  # the seed that ran every rate


def test_select_seeds_pick_the_rate_on_their_mean_and_are_not_held_out(capsys, tmp_path):
    grid = ["3e-3", "1e-2"]

    def runs(losses):  # {(rate, seed): final loss or None for a divergence}
        return [{**lr_row(lr, x, diverged=None if x else 5, code=0 if x else 3), "seed": seed}
                for (lr, seed), x in losses.items()]

    fragile = runs({("3e-3", 1): 2.1, ("1e-2", 1): 2.0, ("3e-3", 2): 2.2, ("1e-2", 2): None})
    assert sweep.pick_best(fragile[:2], "learning_rate", grid)["best_lr"] == "1e-2"  # one selection seed
    both = sweep.pick_best(fragile, "learning_rate", grid)  # 1e-2 diverged on seed 2: it ranks last
    assert both["best_lr"] == "3e-3" and both["diverged_lrs"] == ["1e-2"]
    noisy = runs({("3e-3", 1): 2.1, ("1e-2", 1): 2.0, ("3e-3", 2): 2.1, ("1e-2", 2): 2.3})
    assert sweep.pick_best(noisy, "learning_rate", grid)["best_lr"] == "3e-3"  # mean 2.10 against 2.15
    # every rate runs on each selection seed; the held-out seeds wait for the best rate
    argv = [CONFIG, "--lr_grid", "1e-3,1e-2", "--seeds", "1,2,3", "--out_root", str(tmp_path), "--dry_run"]
    for select, seeds in (["--select_seeds", "7,8"], (7, 8)), ([], (0, 4, 5)):  # default: three seeds not held out
        assert sweep.main([*argv, *select]) == 0
        commands = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("python")]
        planned = sorted((a, b) for c in commands for a in c if a.startswith("--learning_rate=")
                         for b in c if b.startswith("--seed="))
        assert planned == [(f"--learning_rate={lr}", f"--seed={s}") for lr in ("1e-2", "1e-3") for s in seeds]
    assert sweep.main([*argv, "--select_seeds", "3,4"]) == 2  # seed 3 would pick the rate and judge it
    assert "seed 3 is in both --select_seeds and --seeds" in capsys.readouterr().err
    assert sweep.main([*argv, "--lr_seeds", "2"]) == 2  # the flag it replaces: refused, pointing to it
    assert "--select_seeds" in capsys.readouterr().err
    assert sweep.main([CONFIG, "--select_seeds", "7", "--dry_run"]) == 2  # no rate to pick without --lr_grid


def test_a_dry_run_whose_reader_has_gone_stops_quietly(tmp_path):
    """`sweep.py --dry_run | head`: once the reader closes the pipe, the sweep exits 141 (128 + SIGPIPE, as Unix
    tools do) with nothing on stderr, not a BrokenPipeError traceback."""
    argv = ["sweep.py", CONFIG, "--lr_grid", "1e-3,1e-2", "--out_root", str(tmp_path), "--dry_run"]
    assert run_with_closed_stdout(argv) == (141, "")


def test_a_best_rate_that_fails_on_another_seed_is_flagged():
    # the first seed picks the rate; a later seed diverging there means the pick was fragile
    assert point_warnings(None, {1: 2.0, 2: math.inf, 3: 2.1}) == "diverged or crashed at its best rate on seed 2"
    edge = "best at the lowest rate, the grid's edge: extend --lr_grid beyond it"
    both = point_warnings(edge, {"1": 2.0, "3": math.inf})  # summary.json's seeds are strings
    assert both == edge + "; diverged or crashed at its best rate on seed 3"
    assert point_warnings(None, {1: 2.0, 2: 2.1}) is None


class TrainInProcess:
    """What sweep.CHILDREN.start returns in place of a train.py process: the same run, done in this process by
    train.train on the process's arguments with its output going to the same log, ended with its exit code."""

    def __init__(self, command: list[str], stdout, **options):
        assert command[:2] == [sys.executable, sweep.TRAIN]
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
            self.returncode = train.train(command[2:])

    def wait(self) -> int:
        return self.returncode


def test_lr_sweep_picks_each_rate_on_the_selection_seed_and_judges_on_the_held_out_ones(data_dir, tmp_path,
                                                                                        monkeypatch, capsys):
    """Seed 7 runs every rate and picks each point's best; seeds 1 and 2 run at that rate only and are the only
    seeds the mean ± std, the verdict, the leaderboard and best_lr_runs count. The sweep's 8 runs are done in
    this process, one at a time (TrainInProcess): sweep.py starting its runs as train.py processes, several at
    a time, is tested by sweep_root's and diverged_root's sweeps and test_sweep_runs.py."""
    out_root = str(tmp_path / "lr")
    fixed = [f"{k}={v}" for k, v in tiny_settings(data_dir).items() if k != "learning_rate"]
    monkeypatch.setattr(sweep.CHILDREN, "start", TrainInProcess)
    code = sweep.main([CONFIG, "--grid", "norm_scheme=pre,post", "--lr_grid", "1e-3,1e-2", "--select_seeds", "7",
                       "--seeds", "1,2", "--jobs", "1", "--threads_per_run", "1", "--baseline", "norm_scheme=pre",
                       "--row_claim", "norm_scheme=post:lower:0.05", "--out_root", out_root, "--set", *fixed])
    result = capsys.readouterr()
    assert code == 0, result.out + result.err
    summary = read_summary(out_root)
    assert (summary["select_seeds"], summary["held_out_seeds"]) == ([7], [1, 2])
    # 2 schemes x (2 rates on seed 7 + seeds 1, 2 at the best rate), and the baseline's seeds 1, 2 at its second
    assert len(summary["runs"]) == 2 * (2 + 2) + 2
    for point in summary["lr_points"]:
        runs = [r for r in summary["runs"] if r["norm_scheme"] == point["norm_scheme"]]
        selection = [r for r in runs if r["seed"] == 7]
        assert sorted(r["learning_rate"] for r in selection) == ["1e-2", "1e-3"]  # at every rate
        assert point["best_lr"] == min(selection, key=lambda r: r["val_loss"])["learning_rate"]
        held_out = [r for r in runs if r["seed"] != 7 and r["learning_rate"] == point["best_lr"]]
        assert sorted(r["seed"] for r in held_out) == [1, 2]
        second = [r["seed"] for r in runs if r["seed"] != 7 and r["learning_rate"] != point["best_lr"]]
        assert sorted(second) == ([1, 2] if point["norm_scheme"] == "pre" else [])  # the baseline's second-best
        assert sorted(point["seed_losses"]) == ["1", "2"]  # seed 7 ran the best rate too, and is left out
        assert point["val_loss_mean"] == pytest.approx(statistics.fmean(r["val_loss"] for r in held_out))
        assert f"{point['val_loss_mean']:.4f} ± " in point["val_loss_mean_std"] and "(n=2)" in result.out
    post = summary["lr_points"][1]
    assert (post["claim"], post["delta"], post["n_seeds"]) == ("lower", 0.05, [2, 2])
    assert post["verdict"].startswith("inconclusive at this scale")  # two held-out seeds decide nothing
    assert "| lower | 0.05 |" in result.out and "2 vs 2" in result.out
    # min_lr keeps its ratio to the swept rate (cpu_base: 2e-4 at 2e-3)
    argv = sweep.read_json(os.path.join(summary["runs"][0]["out_dir"], "run.json"))["argv"]
    assert "--min_lr=0.0001" in argv and "--learning_rate=1e-3" in argv
    claims = [({"norm_scheme": "post"}, "lower", 0.05)]
    board = sweep.leaderboard([out_root], {"norm_scheme": "pre"}, claims)
    means = [p["val_loss_mean"] for p in summary["lr_points"]]
    assert [row["val_loss_mean_std"][:6] for row in board] == [f"{m:.4f}"[:6] for m in sorted(means)]
    assert [row["n_seeds"] for row in board if "verdict" in row] == [(2, 2)]  # every arm but the baseline
    for row, point in zip(board, sorted(summary["lr_points"], key=lambda p: p["val_loss_mean"]), strict=True):
        first = [r for r in summary["runs"] if r["norm_scheme"] == point["norm_scheme"] and r["seed"] == 7]
        start = sweep.val_loss_at(first[0]["out_dir"], 0)
        capped = [min(sweep.final_loss(r), start) for r in first]
        assert row["lr_sensitivity"] == pytest.approx(sum(capped) / 2 - min(capped))
        assert point["lr_sensitivity"] == pytest.approx(row["lr_sensitivity"])  # the sweep's own table agrees
    assert sweep.main(["--leaderboard", out_root, "--baseline", "norm_scheme=rms"]) == 2  # not a point
    # the same point in two sweeps: told apart by the sweep's folder, the first one is the baseline
    twin = str(tmp_path / "lr_twin")
    shutil.copytree(out_root, twin)
    board = sweep.leaderboard([out_root, twin], {"norm_scheme": "pre"})
    labels = [row["label"] for row in board]
    assert len(set(labels)) == 4 and "norm_scheme=pre (lr_twin)" in labels
    assert sum("verdict" in row for row in board) == 3
    at_best = sweep.best_lr_runs(out_root, {"norm_scheme": "post"})
    with pytest.raises(sweep.SweepError):
        sweep.best_lr_runs(out_root, {"norm_scheme": "rms"})
    assert sorted(at_best) == [1, 2] and all(f"learning_rate={post['best_lr']}" in d for d in at_best.values())
    # a summary from before the selection seeds were named: the seed that ran every rate is still left out
    legacy = {k: v for k, v in summary.items() if k not in ("select_seeds", "held_out_seeds")}
    best = {p["norm_scheme"]: p["best_lr"] for p in legacy["lr_points"]}
    legacy["runs"] = [r for r in legacy["runs"] if r["seed"] == 7 or r["learning_rate"] == best[r["norm_scheme"]]]
    for p in legacy["lr_points"]:  # written before the baseline's second-best rate had held-out runs
        p.pop("second_lr", None)
        p.pop("second_seed_losses", None)
        p["seed_losses"]["7"] = next(r["val_loss"] for r in legacy["runs"] if r["norm_scheme"] == p["norm_scheme"]
                                     and r["seed"] == 7 and r["learning_rate"] == p["best_lr"])
    pathlib.Path(twin, "summary.json").write_text(json.dumps(legacy))
    assert [row["n_seeds"] for row in sweep.leaderboard([twin], {"norm_scheme": "pre"}, claims)
            if "verdict" in row] == [(2, 2)]
    assert sorted(sweep.best_lr_runs(twin, {"norm_scheme": "post"})) == [1, 2]


def test_steps_to_target_and_loss_at_an_iteration_read_the_evaluations(tmp_path):
    records = [{"kind": "eval", "iter": 0, "val_loss": 4.0}, {"kind": "train", "iter": 10, "loss": 1.0},
               {"kind": "eval", "iter": 50, "val_loss": 2.5}, {"kind": "eval", "iter": 100, "val_loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = str(tmp_path)
    assert sweep.steps_to_target(run, 2.5) == 50  # at or below the target; a train loss of 1.0 does not count
    assert sweep.steps_to_target(run, 1.9) is None
    assert sweep.val_loss_at(run, 100) == 2.0 and sweep.val_loss_at(run, 75) is None
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "status", "iter": 120, "status": "diverged"}) + "\n")
    assert sweep.val_loss_at(run, 150) == math.inf


def test_lr_sweep_refuses_a_swept_key_in_the_grid_and_bad_rates():
    assert sweep.main([CONFIG, "--grid", "learning_rate=1e-3", "--lr_grid", "1e-3,1e-2", "--dry_run"]) == 2
    assert sweep.main([CONFIG, "--lr_grid", "1e-3,fast", "--dry_run"]) == 2
    assert sweep.main([CONFIG, "--lr_grid", "1e-3", "--lr_keys", "matrix_lr", "--dry_run"]) == 2  # None in config


@pytest.mark.parametrize("argv, message", [
    (["no/such/config.py"], r"^error: config file 'no/such/config.py' not found \(see configs/ for examples\)$"),
    ([CONFIG, "--jobs", "0"], r"--jobs '0': give auto or a number of runs at a time \(at least 1\)"),
    ([CONFIG, "--threads_per_run", "0"], r"--threads_per_run 0: give a number of threads of at least 1"),
])
def test_sweep_refuses_a_missing_config_and_no_workers_with_one_line(capsys, argv, message):
    assert sweep.main([*argv, "--grid", "norm_scheme=pre", "--dry_run"]) == 2  # ZeroDivisionError before
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err.strip()), err


def test_lr_sweep_keeps_a_zero_floor_at_zero(capsys):
    # the ICL configs decay to min_lr = 0 (WSD): the floor stays 0 at every swept rate, and a second
    # rate key follows the first at its config ratio (Muon's two rates are equal there)
    icl = os.path.join(ROOT, "configs", "icl_small_lipschitz_muon.py")
    assert sweep.main([icl, "--lr_grid", "1e-2", "--lr_keys", "matrix_lr+learning_rate", "--dry_run"]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert {"--matrix_lr=1e-2", "--learning_rate=0.01", "--min_lr=0"} <= set(command.split())
    assert sweep.main([icl, "--lr_grid", "1e-2", "--lr_keys", "matrix_lr", "--set", "matrix_lr=0", "--dry_run"]) == 2


def test_lr_sensitivity_figure_marks_divergence_spread_references_and_setup(tmp_path):
    def run(scheme, lr, seed, val, diverged=None):
        return {"norm_scheme": scheme, "learning_rate": lr, "seed": seed, "val_loss": val, "diverged_at": diverged,
                "exit_code": 3 if diverged else 0}

    runs = [run("pre", "1e-3", 1, 2.0), run("pre", "1e-2", 1, 1.8), run("pre", "1e-1", 1, None, diverged=9),
            run("pre", "1e-2", 2, 1.9), run("rms", "1e-3", 1, 2.0), run("rms", "1e-2", 1, 1.8005),
            run("rms", "1e-1", 1, None, diverged=4)]
    points = [{"norm_scheme": "pre", "best_lr": "1e-2", "val_loss_mean": 1.85, "val_loss_mean_std": "1.8500 ± 0.0707",
               "seed_losses": {"1": 1.8, "2": 1.9}},
              {"norm_scheme": "rms", "best_lr": "1e-2", "val_loss_mean": 1.8005, "val_loss_mean_std": "1.8005",
               "seed_losses": {"1": 1.8005}}]
    setup = {"n_layer": 4, "n_embd": 128, "block_size": 128, "task": "icl", "data": "least squares (T 16)",
             "max_iters": 400, "optimizer": "adamw", "seeds": 2}
    (tmp_path / "summary.json").write_text(json.dumps({"setup": setup, "lr_key": "learning_rate",
                                                        "keys": ["norm_scheme"], "runs": runs, "lr_points": points}))
    fig = plot.draw_lr_sensitivity([str(tmp_path)], {"zero predictor": 2.5}, heading="the schemes compared")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["rms: 1.8005 at lr 1e-2", "pre: 1.8500 ± 0.0707 at lr 1e-2"]  # sorted by mean loss
    crosses = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert len(crosses) == 2 and len({line.get_ydata()[0] for line in crosses}) == 2  # one per scheme, not stacked
    assert any(list(line.get_ydata()) == [2.5, 2.5] for line in ax.get_lines())  # the reference line
    title = fig._suptitle.get_text()
    assert title.startswith("the schemes compared\n")  # --title heads the setup line, which stays
    assert "L4 d128" in title and "400 steps" in title and "2 seeds" in title
    assert "rms under pre" in title or "pre under rms" in title  # the two curves coincide: said, not hidden
    out = tmp_path / "lr.png"
    plot.main([str(tmp_path), "--lr_sweep", "--ref", "zero predictor=2.5", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

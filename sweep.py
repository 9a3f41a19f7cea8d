"""
Run a grid of train.py runs, then print and save a table of the runs and one over seeds.

    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm,post --seeds 1,2,3
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm --grid learning_rate=1e-3,2e-3 \\
        --set max_iters=200 --set lr_decay_iters=200 --out_root out/lr_sweep --baseline norm_scheme=pre
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm --dry_run   # print the commands
    python sweep.py configs/icl_small_lipschitz_muon.py --grid learning_rate+matrix_lr=1e-3,1e-2   # tied keys
    python plot.py out/lr_sweep/*/ --metric loss,val_loss                           # draw the runs

Each run is `python train.py CONFIG --key=value ... --seed=S --out_dir=OUT_ROOT/key=value,...,seed=S`; its
output goes to out_dir/train.log, its exit code and wall time to out_dir/run.json, and the tables to
OUT_ROOT/summary.md and summary.json. Final losses are the last evaluation's; the mean ± std over seeds
leaves out runs that diverged or crashed. The same command continues a sweep: runs evaluated at max_iters
(or diverged) are skipped unless --rerun, an unfinished run with a checkpoint resumes.
Exit code: 0 if every run finished or diverged (a divergence is a result), 1 if one crashed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import train
from plot import diverged_at, load_metrics

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
OUTCOMES = {0: "finished", 1: "crashed", 2: "bad config", 3: "diverged"}
COLUMNS = {"train_loss": ("final train loss", "{:.4f}"), "val_loss": ("final val loss", "{:.4f}"),  # (header, format)
           "diverged_at": ("diverged", "diverged at iteration {}"), "exit_code": ("exit", "{}"),
           "wall_s": ("wall (s)", "{:.1f}"), "ms_per_iter": ("ms/iter", "{:.1f}"),
           "val_loss_mean_std": ("final val loss (mean ± std)", "{}"),
           "ms_vs_baseline": ("ms/iter vs baseline", "{:.2f}x")}
JOBS_HELP = """runs at a time: N, or auto = max(1, cores // threads_per_run). Each run gets OMP_NUM_THREADS=
threads_per_run, by default all cores, so auto runs one at a time: torch already spreads a run's matmuls over
every core, and runs sharing cores gain little while their ms/iter measures the contention, not the model.
With --jobs N alone, each run gets cores // N threads."""


class SweepError(ValueError):
    """An argument the user has to fix; sweep.py exits with code 2."""


def parse_assignments(items: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not (key and sep and value):
            raise SweepError(f"cannot read {flag} {item!r}; write {flag} key=value")
        pairs[key] = value
    return pairs


def expand_grid(grid: dict[str, list], seeds: list[int] | None = None) -> list[dict]:
    """Every combination of the grid's values (first key slowest), then of the seeds (fastest)."""
    points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    return [{**point, "seed": seed} for point in points for seed in seeds] if seeds else points


def run_name(point: dict) -> str:
    name = ",".join(f"{k}={v}" for k, v in point.items())
    return name.replace(os.sep, "-").replace(" ", "-") or "run"


def run_state(out_dir: str, max_iters: int) -> str:
    """finished (evaluated at max_iters, or diverged), resume (a checkpoint to continue), or new."""
    records = load_metrics(out_dir)
    if diverged_at(records) is not None or any(r.get("kind") == "eval" and r["iter"] >= max_iters for r in records):
        return "finished"
    return "resume" if os.path.exists(os.path.join(out_dir, "ckpt.pt")) else "new"


def plan_runs(config: str | None, grid: dict[str, list], seeds: list[int] | None = None,
              fixed: dict | None = None, out_root: str = "out/sweep", rerun: bool = False) -> list[dict]:
    """One job per run, {point, out_dir, argv, state}; every argv is checked as train.py would."""
    if {"out_dir", "init_from", "overwrite"} & {*grid, *(fixed or {})}:
        raise SweepError("sweep.py sets out_dir, init_from and overwrite itself; use --out_root and --rerun")
    if seeds and "seed" in grid:
        raise SweepError("give the seeds either by --seeds or by --grid seed=..., not both")
    jobs = []
    for point in expand_grid(grid, seeds):
        out_dir = os.path.join(out_root, run_name(point))
        argv = [config] if config else []
        settings = {key: v for k, v in {**(fixed or {}), **point}.items() for key in k.split("+")}  # a+b: tied
        argv += [f"--{k}={v}" for k, v in settings.items()] + [f"--out_dir={out_dir}"]
        try:
            cfg, _ = train.load_config(argv)  # checks every key and value before anything runs
        except train.ConfigError as e:
            raise SweepError(f"{e} (run {run_name(point)})") from None
        state = "new" if rerun else run_state(out_dir, cfg.max_iters)
        if state == "resume":
            argv.append("--init_from=resume")
        elif os.path.exists(os.path.join(out_dir, "ckpt.pt")):
            argv.append("--overwrite=True")
        jobs.append({"point": point, "out_dir": out_dir, "argv": argv, "state": state})
    return jobs


def parallelism(jobs: str | int, threads_per_run: int | None) -> tuple[int, int]:
    """(runs at a time, threads per run) on this machine's cores; see JOBS_HELP."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads_per_run is None:
        threads_per_run = cores if jobs == "auto" else max(1, cores // int(jobs))
    return (max(1, cores // threads_per_run) if jobs == "auto" else int(jobs)), threads_per_run


def launch(job: dict, threads: int) -> dict:
    """Run one job to its end: output to out_dir/train.log, exit code and wall time (summed over
    resumptions) to out_dir/run.json."""
    os.makedirs(job["out_dir"], exist_ok=True)
    info_path = os.path.join(job["out_dir"], "run.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    print(f"start {job['out_dir']}" + (" (resume)" if job["state"] == "resume" else ""), flush=True)
    before = read_json(info_path).get("wall_s", 0.0) if job["state"] == "resume" else 0.0
    start = time.perf_counter()
    with open(os.path.join(job["out_dir"], "train.log"), "a" if job["state"] == "resume" else "w") as log:
        code = subprocess.run([sys.executable, TRAIN, *job["argv"]], stdout=log, stderr=subprocess.STDOUT,
                              env=env).returncode
    info = {"point": job["point"], "argv": job["argv"], "exit_code": code,
            "wall_s": before + time.perf_counter() - start, "threads": threads}
    with open(info_path, "w") as f:
        json.dump(info, f, indent=1)
    return info


def read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def summarize(out_dirs: list[str], extra: list[str] | None = None) -> list[dict]:
    """One row per run: its grid values and seed, final losses, divergence, exit code, time, and the
    `extra` metrics of its last evaluation that logged them (e.g. val_xy_loss, grad_kurtosis)."""
    rows = []
    for out_dir in out_dirs:
        records = load_metrics(out_dir)
        info = read_json(os.path.join(out_dir, "run.json"))
        evals = [r for r in records if r.get("kind") == "eval"]
        ms = [r["ms_per_iter"] for r in records if r.get("kind") == "train" and "ms_per_iter" in r]
        rows.append({"out_dir": out_dir, **info.get("point", {}),
                     "train_loss": evals[-1].get("train_loss") if evals else None,
                     "val_loss": evals[-1].get("val_loss") if evals else None,
                     "diverged_at": diverged_at(records), "exit_code": info.get("exit_code"),
                     "wall_s": info.get("wall_s"), "ms_per_iter": statistics.median(ms) if ms else None,
                     **{key: next((r[key] for r in reversed(evals) if isinstance(r.get(key), (int, float))), None)
                        for key in extra or []}})
    return rows


def aggregate(rows: list[dict], keys: list[str], baseline: dict | None = None) -> list[dict]:
    """One row per grid point over its seeds. ms/iter is relative to the point that has the baseline's
    values on the baseline's keys and this point's on the others (default: the first point)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(str(row.get(k)) for k in keys), []).append(row)
    ms = {values: [r["ms_per_iter"] for r in group if r["ms_per_iter"] is not None] for values, group in groups.items()}
    if not groups:
        return []
    baseline = baseline or dict(zip(keys, next(iter(groups)), strict=True))
    out = []
    for values, group in groups.items():
        ok = [r["val_loss"] for r in group if r["diverged_at"] is None and r["exit_code"] in (0, None)
              and r["val_loss"] is not None and math.isfinite(r["val_loss"])]
        mean = statistics.fmean(ok) if ok else None
        std = statistics.stdev(ok) if len(ok) > 1 else None
        text = "-" if mean is None else f"{mean:.4f}" + (f" ± {std:.4f}" if std is not None else "")
        ref = ms.get(tuple(str(baseline.get(k, v)) for k, v in zip(keys, values, strict=True)))
        rel = statistics.fmean(ms[values]) / statistics.fmean(ref) if ms[values] and ref else None
        diverged = sum(r["diverged_at"] is not None for r in group)
        out.append({**dict(zip(keys, values, strict=True)), "runs": len(group), "val_loss_mean_std": text,
                    "val_loss_mean": mean, "val_loss_std": std, "diverged": diverged, "ms_vs_baseline": rel})
    return out


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A Markdown table with aligned columns; None and NaN show as "-"."""
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))

    def cell(key: str, value: object) -> str:
        if value is None or isinstance(value, float) and math.isnan(value):
            return "-"
        default = "{:.4g}" if isinstance(value, float) else "{}"  # extra metrics
        return COLUMNS.get(key, (key, default))[1].format(value)

    table = [[COLUMNS.get(c, (c,))[0] for c in columns]] + [[cell(c, row.get(c)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["| " + " | ".join(text.ljust(w) for text, w in zip(line, widths, strict=True)) + " |" for line in table]
    return "\n".join([lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]])


def run_sweep(config: str | None, grid: dict[str, list], seeds: list[int] | None = None, fixed: dict | None = None,
              out_root: str = "out/sweep", jobs: str | int = "auto", threads_per_run: int | None = None,
              rerun: bool = False, baseline: dict | None = None, dry_run: bool = False,
              extra: list[str] | None = None) -> list[dict]:
    """Run what is not finished, then print and write the summary; returns summarize()'s rows."""
    todo = plan_runs(config, grid, seeds, fixed, out_root, rerun)
    workers, threads = parallelism(jobs, threads_per_run)
    pending = [job for job in todo if job["state"] != "finished"]
    print(f"{len(todo)} runs, {len(pending)} to run, {workers} at a time with OMP_NUM_THREADS={threads}")
    for job in todo:
        if job["state"] == "finished":
            print(f"skip {job['out_dir']}: finished (--rerun runs it again)")
        elif dry_run:
            print(shlex.join(["python", "train.py", *job["argv"]]))
    if dry_run:
        return []
    with ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(launch, job, threads): job for job in pending}
        try:
            for k, future in enumerate(as_completed(futures), 1):
                job, info = futures[future], future.result()
                outcome = OUTCOMES.get(info["exit_code"], f"exit {info['exit_code']}")
                print(f"[{k}/{len(pending)}] {run_name(job['point'])}: {outcome} in {info['wall_s']:.1f} s"
                      + (f", see {job['out_dir']}/train.log" if info["exit_code"] not in (0, 3) else ""), flush=True)
        except KeyboardInterrupt:
            pool.shutdown(cancel_futures=True)  # start nothing more; the same command continues the sweep
            raise
    rows = summarize([job["out_dir"] for job in todo], extra)
    write_summary(out_root, rows, aggregate(rows, list(grid), baseline), list(grid), bool(seeds),
                  f"Sweep of {config} over {grid}, seeds {seeds or 'of the config'}", extra or [])
    return rows


def write_summary(out_root: str, rows: list[dict], points: list[dict], keys: list[str], seeds: bool, title: str,
                  extra: list[str] = ()):
    """Print the two tables and write them to out_root/summary.md and summary.json."""
    run_columns = [*keys, *(["seed"] if seeds else []), "train_loss", "val_loss", *extra, "diverged_at",
                   "exit_code", "wall_s", "ms_per_iter"]
    text = "\n\n".join([format_table(rows, run_columns),
                        format_table(points, [*keys, "runs", "val_loss_mean_std", "diverged", "ms_vs_baseline"])])
    print("\n" + text)
    os.makedirs(out_root, exist_ok=True)
    with open(os.path.join(out_root, "summary.md"), "w") as f:
        f.write(f"# {title}\n\n{text}\n")
    with open(os.path.join(out_root, "summary.json"), "w") as f:
        json.dump({"runs": rows, "grid_points": points}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a train.py config file, e.g. configs/cpu_base.py")
    parser.add_argument("--grid", action="extend", nargs="+", default=[], metavar="KEY=V1,V2",
                        help="values to sweep (repeatable; the runs are every combination); KEY1+KEY2=V1,V2 "
                        "gives both keys the same value, e.g. learning_rate+matrix_lr=1e-3,1e-2")
    parser.add_argument("--seeds", help="comma-separated seeds, e.g. 1,2,3 (default: the config's seed)")
    parser.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="a setting for every run (repeatable)")
    parser.add_argument("--out_root", help="folder of the runs (default: out/sweep_<config name>)")
    parser.add_argument("--jobs", default="auto", help=JOBS_HELP)
    parser.add_argument("--threads_per_run", type=int, help="OMP_NUM_THREADS of each run (default: see --jobs)")
    parser.add_argument("--baseline", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="key=value: the grid point ms/iter is relative to (default: the first)")
    parser.add_argument("--extra", default="", help="comma-separated metrics of the last eval to add to the run "
                        "table, e.g. val_xy_loss,grad_kurtosis")
    parser.add_argument("--rerun", action="store_true", help="run finished runs again, from scratch")
    parser.add_argument("--dry_run", action="store_true", help="print the train.py commands and stop")
    args = parser.parse_args(argv)
    try:
        grid = {k: v.split(",") for k, v in parse_assignments(args.grid, "--grid").items()}
        baseline = parse_assignments(args.baseline, "--baseline")
        if any(k not in grid or v not in grid[k] for k, v in baseline.items()):
            raise SweepError(f"--baseline {' '.join(args.baseline)} is not in the grid {grid}")
        if args.jobs != "auto" and not args.jobs.isdigit():
            raise SweepError(f"--jobs {args.jobs!r}: give auto or a number of runs at a time")
        if args.seeds and not all(s.isdigit() for s in args.seeds.split(",")):
            raise SweepError(f"--seeds {args.seeds!r}: give whole numbers separated by commas, e.g. 1,2,3")
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
        out_root = args.out_root or os.path.join("out", "sweep_" + os.path.splitext(os.path.basename(args.config))[0])
        rows = run_sweep(args.config, grid, seeds, parse_assignments(args.set, "--set"), out_root, args.jobs,
                         args.threads_per_run, args.rerun, baseline or None, args.dry_run,
                         [k for k in args.extra.split(",") if k])
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: run the same command to continue the sweep", file=sys.stderr)
        return 130
    return int(any(r["exit_code"] not in (0, 3, None) for r in rows))


if __name__ == "__main__":
    sys.exit(main())

"""
Run a grid of train.py runs, then print and save a table of the runs and one over seeds.

    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm,post --seeds 1,2,3
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm --grid learning_rate=1e-3,2e-3 \\
        --set max_iters=200 --set lr_decay_iters=200 --out_root out/lr_sweep --baseline norm_scheme=pre
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm --dry_run   # print the commands
    python sweep.py configs/icl_small_lipschitz_muon.py --grid learning_rate+matrix_lr=1e-3,1e-2   # tied keys
    python plot.py out/lr_sweep/*/ --metric loss,val_loss                           # draw the runs
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,post --lr_grid 3e-4,1e-3,3e-3,1e-2,3e-2 \
        --seeds 1,2,3 --baseline norm_scheme=pre --out_root out/lr      # each scheme at its own best rate
    python plot.py --lr_sweep out/lr                                     # final loss against learning rate

With --lr_grid, every grid point runs every rate on the first seed (on each of the first N with --lr_seeds N);
the rate with the lowest final val loss (mean over those seeds) is its best (a diverged or crashed run ranks
its rate last and stays in the table); the other seeds run at the best rate only. The table gives each
point's best rate, mean ± std (n) at it, the rates that diverged, the learning-rate sensitivity, and a
warning when the best rate is an edge of the grid or failed on a later seed. With --baseline, `verdict`
(below) compares each point's per-seed losses at its best rate with the baseline's: Welch's t-test, or the
paired t-test when both share their seeds, two-sided at p < 0.05, giving "reproduced", "contradicted" or
"inconclusive at this scale" for the claim that the point's loss is lower (--claim higher: higher). Two
rates (muon, manifold_muon):
--lr_keys matrix_lr+learning_rate sweeps matrix_lr and keeps learning_rate at its config ratio to it.

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
from model import GPTConfig
from plot import diverged_at, load_metrics

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
OUTCOMES = {0: "finished", 1: "crashed", 2: "bad config", 3: "diverged"}
COLUMNS = {"train_loss": ("final train loss", "{:.4f}"), "val_loss": ("final val loss", "{:.4f}"),  # (header, format)
           "diverged_at": ("diverged", "diverged at iteration {}"), "exit_code": ("exit", "{}"),
           "wall_s": ("wall (s)", "{:.1f}"), "ms_per_iter": ("ms/iter", "{:.1f}"),
           "val_loss_mean_std": ("final val loss (mean ± std)", "{}"),
           "ms_vs_baseline": ("ms/iter vs baseline", "{:.2f}x"), "best_lr": ("best lr", "{}"),
           "diverged_lrs": ("diverged at lr", "{}"), "verdict": ("verdict vs baseline", "{}"),
           "edge_warning": ("warning", "{}"), "label": ("arm", "{}"), "diff": ("Δ vs baseline", "{:+.4f}"),
           "run_minutes": ("run time (min)", "{:.1f}"), "lr_sensitivity": ("lr sensitivity", "{:.3f}")}
JOBS_HELP = """runs at a time: N, or auto = max(1, cores // threads_per_run). Each run gets OMP_NUM_THREADS=
threads_per_run, by default all cores, so auto runs one at a time: torch already spreads a run's matmuls over
every core, and runs sharing cores gain little while their ms/iter measures the contention, not the model.
With --jobs N alone, each run gets cores // N threads."""


class SweepError(ValueError):
    """An argument the user has to fix; sweep.py exits with code 2."""


def is_positive_number(text: str) -> bool:
    try:
        return float(text) > 0 and math.isfinite(float(text))
    except ValueError:
        return False


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
              fixed: dict | None = None, out_root: str = "out/sweep", rerun: bool = False,
              lr_ratios: tuple[str, dict[str, float]] | None = None) -> list[dict]:
    """One job per run, {point, out_dir, argv, state}; every argv is checked as train.py would.

    lr_ratios (key, {other: ratio}): each run sets `other` to ratio times its value of `key`."""
    if {"out_dir", "init_from", "overwrite"} & {*grid, *(fixed or {})}:
        raise SweepError("sweep.py sets out_dir, init_from and overwrite itself; use --out_root and --rerun")
    if seeds and "seed" in grid:
        raise SweepError("give the seeds either by --seeds or by --grid seed=..., not both")
    jobs = []
    for point in expand_grid(grid, seeds):
        out_dir = os.path.join(out_root, run_name(point))
        argv = [config] if config else []
        settings = {key: v for k, v in {**(fixed or {}), **point}.items() for key in k.split("+")}  # a+b: tied
        if lr_ratios:
            key, ratios = lr_ratios
            settings.update({other: f"{float(settings[key]) * ratio:.6g}" for other, ratio in ratios.items()})
        argv += [f"--{k}={v}" for k, v in settings.items()] + [f"--out_dir={out_dir}"]
        try:
            cfg, _ = train.load_config(argv)  # checks every key and value before anything runs
        except train.ConfigError as e:
            raise SweepError(f"{e} (run {run_name(point)})" if point else str(e)) from None
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


def execute(pending: list[dict], workers: int, threads: int) -> None:
    """Run the jobs, `workers` at a time, printing each outcome as it comes."""
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
    execute(pending, workers, threads)
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


# ----------------------------------------------------------------------------- the verdict rule

VERDICT_P = 0.05  # two-sided significance level of the verdict rule


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0 or x >= 1.0:
        return min(max(x, 0.0), 1.0)
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below the mean: use the symmetry
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return front * f


def t_test_p(t: float, df: float) -> float:
    """Two-sided p-value of Student's t statistic with df degrees of freedom: I_{df/(df+t^2)}(df/2, 1/2)."""
    if math.isinf(t):
        return 0.0
    return _incomplete_beta(df / 2, 0.5, df / (df + t * t))


def compare_arms(a: list[float], b: list[float], paired: bool = False) -> dict:
    """Mean of a minus mean of b, its standard error, t, degrees of freedom and two-sided p.

    Welch's t-test (unequal variances, Welch–Satterthwaite df); paired: the one-sample t-test of the
    per-seed differences a[i] - b[i] (both lists in the same seed order)."""
    if paired:
        diffs = [x - y for x, y in zip(a, b, strict=True)]
        n = len(diffs)
        mean, se2, df = statistics.fmean(diffs), statistics.variance(diffs) / n, n - 1
    else:
        va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
        mean, se2 = statistics.fmean(a) - statistics.fmean(b), va + vb
        df = se2**2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se2 > 0 else len(a) + len(b) - 2
    se = math.sqrt(se2)
    t = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
    return {"diff": mean, "se": se, "t": t, "df": df, "p": t_test_p(t, df)}


def verdict(claimed: list[float], other: list[float], claim: str = "lower", paired: bool = False) -> dict:
    """The one verdict rule: does `claimed` have a lower (claim="lower") or higher final loss than `other`?

    Each list holds one final loss per seed; a diverged run counts as +inf. With every loss finite:
    `compare_arms` (Welch's t-test, or paired by seed), then "reproduced" if p < VERDICT_P and the
    difference has the claimed sign, "contradicted" if p < VERDICT_P against it, else "inconclusive at
    this scale". With divergences: when one arm diverged on every seed and the other on none, the arm
    that trained wins; any other mix is inconclusive. Fewer than 2 seeds per arm: inconclusive."""
    if claim not in ("lower", "higher"):
        raise ValueError(f"claim={claim!r}: choose lower or higher")
    sign = -1.0 if claim == "lower" else 1.0  # the claimed sign of mean(claimed) - mean(other)
    bad_a, bad_b = (sum(not math.isfinite(x) for x in arm) for arm in (claimed, other))
    result = {"n": (len(claimed), len(other)), "diverged": (bad_a, bad_b), "paired": paired,
              "test": "paired t" if paired else "Welch's t", "diff": None, "se": None, "p": None}
    if bad_a or bad_b:
        word = "inconclusive at this scale"
        if bad_a == len(claimed) and bad_b == 0:  # only the claimed arm diverged, on every seed: its loss is higher
            word = "reproduced" if claim == "higher" else "contradicted"
        elif bad_b == len(other) and bad_a == 0:
            word = "reproduced" if claim == "lower" else "contradicted"
        return {**result, "verdict": word}
    if min(len(claimed), len(other)) < 2:
        return {**result, "verdict": "inconclusive at this scale"}
    stats = compare_arms(claimed, other, paired)
    word = "inconclusive at this scale"
    if stats["p"] < VERDICT_P:
        word = "reproduced" if stats["diff"] * sign > 0 else "contradicted"
    return {**result, **stats, "verdict": word}


# ----------------------------------------------------------------------------- learning-rate sweeps


def final_loss(row: dict) -> float:
    """The run's final val loss for the verdict rule and the choice of rate: +inf if it diverged, crashed
    or ended without a finite loss."""
    loss = row.get("val_loss")
    ok = row["diverged_at"] is None and row["exit_code"] in (0, None) and loss is not None and math.isfinite(loss)
    return loss if ok else math.inf


def lr_ratios_of(config: str, fixed: dict, lr_keys: list[str]) -> tuple[str, dict[str, float]]:
    """The first of lr_keys takes the grid's values; every other lr key, and min_lr when learning_rate is
    swept, keeps its ratio to the first from the config (so the schedule's floor scales with the rate)."""
    try:
        cfg, _ = train.load_config([config, *(f"--{k}={v}" for k, v in fixed.items())])
    except train.ConfigError as e:
        raise SweepError(str(e)) from None
    followers = [*lr_keys[1:], *(["min_lr"] if "learning_rate" in lr_keys and "min_lr" not in fixed else [])]
    values = {k: getattr(cfg, k, None) for k in lr_keys + followers}
    first = lr_keys[0]
    # a follower at 0 keeps ratio 0 (a schedule that decays to zero); the swept key must be positive
    missing = [k for k, v in values.items() if not isinstance(v, (int, float)) or v < 0 or (k == first and v == 0)]
    if missing:
        raise SweepError(f"--lr_keys: {', '.join(missing)} must have a value in the config or --set (positive for "
                         f"{first}, >= 0 for the keys that keep their ratio to it)")
    return first, {k: values[k] / values[first] for k in followers if k != first}


def first_seed_runs(rows: list[dict], lr_key: str) -> list[dict]:
    """The runs of one grid point on its first seed: the seed that ran the most rates."""
    rates: dict[int, set] = {}
    for r in rows:
        rates.setdefault(r["seed"], set()).add(float(r[lr_key]))
    first = max(rates, key=lambda s: (len(rates[s]), -s), default=None)
    return [r for r in rows if r["seed"] == first]


def lr_sensitivity(rows: list[dict], lr_key: str, rates: set[float] | None = None) -> float | None:
    """Learning-rate sensitivity as Wortsman et al. (2023) define it, from one grid point's first-seed runs:
    the mean over the grid's (log-spaced) rates of min(final loss, initial loss) - the best final loss.
    A diverged or crashed run, or one that ends above where it started, counts at the initial loss (the
    iteration-0 val loss, one init for every rate); 0 means every rate of the grid is as good as the best.
    It depends on the grid, so points are compared over the same `rates` (default: all the point ran).
    None when no rate trained or no run logged a finite initial loss."""
    rows = [r for r in rows if rates is None or float(r[lr_key]) in rates]
    initial = next((x for r in rows if "out_dir" in r and (x := val_loss_at(r["out_dir"], 0)) is not None
                    and math.isfinite(x)), None)
    finals = [final_loss(r) for r in rows]
    if initial is None or not any(math.isfinite(x) for x in finals):
        return None
    capped = [min(x, initial) for x in finals]
    return statistics.fmean(capped) - min(capped)


def pick_best(rows: list[dict], lr_key: str, lr_values: list[str]) -> dict:
    """The best rate of one grid point from its runs at every rate (on the first seed, or on each of the first
    --lr_seeds): the lowest mean final val loss over those seeds, a rate with a diverged or crashed run ranking
    last; the diverged and crashed rates, and the edge warning."""
    by_rate: dict[str, list[float]] = {}
    for r in rows:
        by_rate.setdefault(r[lr_key], []).append(final_loss(r))
    trained = {lr: statistics.fmean(losses) for lr, losses in by_rate.items() if all(map(math.isfinite, losses))}
    best = min(trained, key=trained.get) if trained else None
    numeric = sorted(float(v) for v in lr_values)
    edge = None
    if best is not None and len(numeric) > 1 and float(best) in (numeric[0], numeric[-1]):
        side = "lowest" if float(best) == numeric[0] else "highest"
        edge = f"best at the {side} rate of the grid: extend --lr_grid beyond it"
    diverged = list(dict.fromkeys(r[lr_key] for r in rows if r["diverged_at"] is not None))
    crashed = list(dict.fromkeys(r[lr_key] for r in rows
                                 if r["diverged_at"] is None and r["exit_code"] not in (0, 3, None)))
    return {"best_lr": best, "diverged_lrs": diverged, "crashed_lrs": crashed, "edge_warning": edge,
            "lr_sensitivity": lr_sensitivity(first_seed_runs(rows, lr_key), lr_key)}


def run_lr_sweep(config: str, grid: dict[str, list], lr_values: list[str], lr_keys: list[str],
                 seeds: list[int] | None = None, fixed: dict | None = None, out_root: str = "out/sweep",
                 jobs: str | int = "auto", threads_per_run: int | None = None, rerun: bool = False,
                 baseline: dict | None = None, claim: str = "lower", dry_run: bool = False,
                 extra: list[str] | None = None, lr_seeds: int = 1) -> list[dict]:
    """Each grid point at its own best learning rate: every rate on the first `lr_seeds` seeds, the best kept
    (lowest mean final val loss over them; a diverged run ranks its rate last), the other seeds at that rate
    only. Returns one row per grid point."""
    fixed = fixed or {}
    seeds = seeds or [train.TrainConfig.seed if "seed" not in fixed else int(fixed.pop("seed"))]
    if not 1 <= lr_seeds <= len(seeds):
        raise SweepError(f"--lr_seeds {lr_seeds}: give 1 to the number of --seeds ({len(seeds)})")
    lr_key, ratios = lr_ratios_of(config, fixed, lr_keys)
    workers, threads = parallelism(jobs, threads_per_run)
    first = plan_runs(config, {**grid, lr_key: lr_values}, seeds[:lr_seeds], fixed, out_root, rerun,
                      (lr_key, ratios))
    pending = [job for job in first if job["state"] != "finished"]
    print(f"{len(first)} runs over {len(lr_values)} rates on seeds {seeds[:lr_seeds]}, {len(pending)} to run, "
          f"{workers} at a time with OMP_NUM_THREADS={threads}; then seeds {seeds[lr_seeds:]} at each point's "
          "best rate")
    if dry_run:
        for job in pending:
            print(shlex.join(["python", "train.py", *job["argv"]]))
        return []
    execute(pending, workers, threads)
    first_rows = summarize([job["out_dir"] for job in first], extra)
    points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    choice = []
    for point in points:
        rows = [r for r in first_rows if all(str(r.get(k)) == str(v) for k, v in point.items())]
        choice.append({**point, **pick_best(rows, lr_key, lr_values)})
    later = seeds[lr_seeds:]
    rest = [job for c, point in zip(choice, points, strict=True) if c["best_lr"] is not None and later
            for job in plan_runs(config, {**{k: [v] for k, v in point.items()}, lr_key: [c["best_lr"]]}, later,
                                 fixed, out_root, rerun, (lr_key, ratios))]
    execute([job for job in rest if job["state"] != "finished"], workers, threads)
    rest_rows = summarize([job["out_dir"] for job in rest], extra)
    table = lr_table(first_rows + rest_rows, choice, list(grid), lr_key, baseline, claim)
    write_lr_summary(out_root, first_rows + rest_rows, table, list(grid), lr_key, extra or [],
                     f"Learning-rate sweep of {config} over {grid}, {lr_key} in {lr_values}"
                     + (f" (scaling {', '.join(ratios)} with it)" if ratios else "") + f", seeds {seeds}"
                     + (f", rates picked on the mean over seeds {seeds[:lr_seeds]}" if lr_seeds > 1 else ""),
                     run_setup(first[0]["argv"], len(seeds)) if first else {})
    return table


def run_setup(argv: list[str], n_seeds: int) -> dict:
    """What a figure's title states of a sweep: model size, data, steps, optimizer, seeds."""
    cfg, model_args = train.load_config(argv)
    size = {k: model_args.get(k, getattr(GPTConfig, k)) for k in ("n_layer", "n_embd", "block_size")}
    data = cfg.dataset if cfg.task == "lm" else f"least squares (T {cfg.icl_pairs})"
    return {**size, "task": cfg.task, "data": data, "dataset": cfg.dataset, "data_dir": cfg.data_dir,
            "batch_size": cfg.batch_size, "max_iters": cfg.max_iters, "optimizer": cfg.optimizer, "seeds": n_seeds}


def point_warnings(edge: str | None, losses: dict[int, float]) -> str | None:
    """The edge warning, and a warning when the best rate (picked on the first seed, or the first --lr_seeds)
    diverged or crashed on a later seed: that pick is fragile, and the mean over the seeds that trained flatters it."""
    failed = sorted(int(s) for s, x in losses.items() if not math.isfinite(x))
    fragile = f"diverged or crashed at its best rate on seed {','.join(map(str, failed))}" if failed else None
    return "; ".join(w for w in (edge, fragile) if w) or None


def lr_table(rows: list[dict], choice: list[dict], keys: list[str], lr_key: str, baseline: dict | None,
             claim: str) -> list[dict]:
    """One row per grid point: best rate, mean ± std (n) of the final val loss at it, and, given a
    baseline point, the verdict rule's word for "this point's loss is `claim` than the baseline's"."""
    def seeds_at_best(c: dict) -> dict[int, float]:
        return {r["seed"]: final_loss(r) for r in rows if all(str(r.get(k)) == str(c[k]) for k in keys)
                and c["best_lr"] is not None and str(r[lr_key]) == str(c["best_lr"])}

    base = next((c for c in choice if baseline and all(str(c[k]) == str(v) for k, v in baseline.items())), None)
    base_losses = seeds_at_best(base) if base else {}
    table = []
    for c in choice:
        losses = seeds_at_best(c)
        finite = [x for x in losses.values() if math.isfinite(x)]
        text = "-" if not finite else f"{statistics.fmean(finite):.4f}" + (
            f" ± {statistics.stdev(finite):.4f}" if len(finite) > 1 else "") + f" (n={len(finite)})"
        row = {**{k: c[k] for k in keys}, "best_lr": c["best_lr"], "val_loss_mean_std": text,
               "val_loss_mean": statistics.fmean(finite) if finite else None, "seed_losses": losses,
               "diverged_lrs": ",".join(c["diverged_lrs"]) or None, "crashed_lrs": c["crashed_lrs"],
               "lr_sensitivity": c["lr_sensitivity"], "edge_warning": point_warnings(c["edge_warning"], losses)}
        if base is not None and c is not base and losses and base_losses:
            paired = sorted(losses) == sorted(base_losses)
            order = sorted(losses)
            v = verdict([losses[s] for s in order], [base_losses[s] for s in (order if paired else base_losses)],
                        claim, paired)
            row["verdict"] = v["verdict"] + (f" (p={v['p']:.3g})" if v["p"] is not None else "")
        table.append(row)
    return table


def write_lr_summary(out_root: str, rows: list[dict], table: list[dict], keys: list[str], lr_key: str,
                     extra: list[str], title: str, setup: dict) -> None:
    """Print the run table and the per-point table; write both to out_root/summary.md and summary.json."""
    run_columns = [*keys, lr_key, "seed", "train_loss", "val_loss", *extra, "diverged_at", "exit_code", "wall_s",
                   "ms_per_iter"]
    point_columns = [*keys, "best_lr", "val_loss_mean_std", "diverged_lrs", "lr_sensitivity",
                     *(["verdict"] if any("verdict" in r for r in table) else []), "edge_warning"]
    cpu_s = sum(r["wall_s"] or 0.0 for r in rows)
    text = "\n\n".join([format_table(rows, run_columns), format_table(table, point_columns),
                        f"{len(rows)} runs, {cpu_s / 60:.1f} min of run time in all."])
    print("\n" + text)
    os.makedirs(out_root, exist_ok=True)
    with open(os.path.join(out_root, "summary.md"), "w") as f:
        f.write(f"# {title}\n\n{text}\n")
    with open(os.path.join(out_root, "summary.json"), "w") as f:
        json.dump({"title": title, "setup": setup, "lr_key": lr_key, "keys": keys, "runs": rows, "lr_points": table},
                  f, indent=1)


def val_loss_at(out_dir: str, iteration: int) -> float | None:
    """A run's val loss at the evaluation of `iteration` (None if it logged none there); +inf after a divergence."""
    records = load_metrics(out_dir)
    stop = diverged_at(records)
    if stop is not None and iteration >= stop:
        return math.inf
    return next((r["val_loss"] for r in records if r.get("kind") == "eval" and r["iter"] == iteration), None)


def steps_to_target(out_dir: str, target: float) -> int | None:
    """The first evaluated iteration whose val loss is at or below `target` (None: never, within the run).
    Its resolution is the run's eval_interval: nGPT's "steps to reach a loss" (Loshchilov et al. Fig. 1)."""
    return next((r["iter"] for r in load_metrics(out_dir) if r.get("kind") == "eval"
                 and r.get("val_loss") is not None and r["val_loss"] <= target), None)


def best_lr_runs(root: str, point: dict) -> dict[int, str]:
    """{seed: out_dir} of one --lr_grid sweep point's runs at its best rate (from root/summary.json)."""
    summary = read_json(os.path.join(root, "summary.json"))
    keys, lr_key = summary.get("keys", []), summary.get("lr_key", "learning_rate")
    best = [p["best_lr"] for p in summary.get("lr_points", []) if all(str(p[k]) == str(point.get(k)) for k in keys)]
    if not best:
        raise SweepError(f"{point} is no point of the --lr_grid sweep in {root}")
    match = {**point, lr_key: best[0]}
    return {r["seed"]: r["out_dir"] for r in summary["runs"] if all(str(r.get(k)) == str(v) for k, v in match.items())}


def leaderboard(roots: list[str], baseline: dict | None = None, claim: str = "lower") -> list[dict]:
    """One table over the per-point tables of several --lr_grid sweeps (their summary.json): every point at
    its own best rate, sorted by mean final val loss, with the verdict rule against the baseline point (the
    first root's, if several match). Points with the same settings in two roots are told apart by the root."""
    points = []
    for root in roots:
        summary = read_json(os.path.join(root, "summary.json"))
        if "lr_points" not in summary:
            raise SweepError(f"{root} holds no summary.json of a --lr_grid sweep")
        for point in summary["lr_points"]:
            keys = summary["keys"]
            runs = [r for r in summary["runs"] if all(str(r.get(k)) == str(point[k]) for k in keys)]
            label = ", ".join(f"{k}={point[k]}" for k in keys) or os.path.basename(os.path.normpath(root))
            losses = {int(s): v for s, v in point["seed_losses"].items()}
            lr_key = summary.get("lr_key", "learning_rate")
            points.append({**point, "label": label, "root": root, "losses": losses, "lr_key": lr_key,
                           "first_runs": first_seed_runs(runs, lr_key),
                           "run_minutes": sum(r.get("wall_s") or 0.0 for r in runs) / 60})
    # the sensitivity depends on the grid: every arm's over the rates all of them ran
    shared = set.intersection(*({float(r[p["lr_key"]]) for r in p["first_runs"]} for p in points)) if points else set()
    over = ", ".join(f"{x:g}" for x in sorted(shared))
    labels = [p["label"] for p in points]
    for p in points:
        if labels.count(p["label"]) > 1:
            p["label"] += f" ({os.path.basename(os.path.normpath(p['root']))})"
    base = next((p for p in points if baseline and all(str(p.get(k)) == str(v) for k, v in baseline.items())), None)
    if baseline and base is None:
        raise SweepError(f"--baseline {baseline} is none of the sweeps' points")
    table = []
    for p in sorted(points, key=lambda p: (p["val_loss_mean"] is None, p["val_loss_mean"] or 0.0)):
        row = {"label": p["label"], "best_lr": p["best_lr"], "val_loss_mean_std": p["val_loss_mean_std"],
               "diverged_lrs": p["diverged_lrs"], "edge_warning": point_warnings(p["edge_warning"], p["losses"]),
               "lr_sensitivity": lr_sensitivity(p["first_runs"], p["lr_key"], shared),
               "lr_sensitivity_rates": over, "run_minutes": p["run_minutes"]}
        if base is not None and p is not base and p["losses"] and base["losses"]:
            paired = sorted(p["losses"]) == sorted(base["losses"])
            seeds = sorted(p["losses"])
            v = verdict([p["losses"][s] for s in seeds],
                        [base["losses"][s] for s in (seeds if paired else sorted(base["losses"]))], claim, paired)
            row["verdict"] = v["verdict"] + (f" (p={v['p']:.3g})" if v["p"] is not None else "")
            row["diff"] = v["diff"]
        table.append(row)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="a train.py config file, e.g. configs/cpu_base.py")
    parser.add_argument("--leaderboard", nargs="+", metavar="OUT_ROOT", help="print one table over these --lr_grid "
                        "sweeps (each point at its best rate, sorted, verdicts against --baseline) and stop")
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
    parser.add_argument("--lr_grid", metavar="V1,V2,...", help="learning rates (log-spaced): each grid point "
                        "runs every rate on the first seed and the other seeds at its best rate")
    parser.add_argument("--lr_keys", default="learning_rate", metavar="KEY1+KEY2",
                        help="the rate(s) --lr_grid sets: the first takes the grid's values, the others keep their "
                        "ratio to it from the config (e.g. matrix_lr+learning_rate for muon); min_lr follows "
                        "learning_rate unless set (default: learning_rate)")
    parser.add_argument("--lr_seeds", type=int, default=1, metavar="N",
                        help="with --lr_grid: run every rate on the first N seeds and pick each point's rate on "
                        "the mean over them (a rate that diverged on one ranks last), not on the first seed alone: "
                        "a steadier pick for N times the grid's runs (default: 1)")
    parser.add_argument("--claim", choices=("lower", "higher"), default="lower",
                        help="with --lr_grid and --baseline: the verdict tests whether each point's final val loss "
                        "is lower (default) or higher than the baseline's")
    parser.add_argument("--rerun", action="store_true", help="run finished runs again, from scratch")
    parser.add_argument("--dry_run", action="store_true", help="print the train.py commands and stop")
    args = parser.parse_args(argv)
    try:
        if args.leaderboard:
            table = leaderboard(args.leaderboard, parse_assignments(args.baseline, "--baseline") or None, args.claim)
            print(format_table(table, ["label", "best_lr", "val_loss_mean_std", "diff", "verdict", "diverged_lrs",
                                       "lr_sensitivity", "run_minutes", "edge_warning"]))
            rates = table[0]["lr_sensitivity_rates"] if table else ""
            print(f"\nlr sensitivity over the rates every arm ran: {rates or 'none'}"
                  f"\n{sum(r['run_minutes'] for r in table):.1f} min of run time in all")
            return 0
        if args.config is None:
            raise SweepError("give a config file to sweep, or --leaderboard OUT_ROOT ...")
        grid = {k: v.split(",") for k, v in parse_assignments(args.grid, "--grid").items()}
        baseline = parse_assignments(args.baseline, "--baseline")
        if any(k not in grid or v not in grid[k] for k, v in baseline.items()):
            raise SweepError(f"--baseline {' '.join(args.baseline)} is not in the grid {grid}")
        if not os.path.isfile(args.config):
            raise SweepError(f"config file {args.config!r} not found (see configs/ for examples)")
        if args.jobs != "auto" and not (args.jobs.isdigit() and int(args.jobs) >= 1):
            raise SweepError(f"--jobs {args.jobs!r}: give auto or a number of runs at a time (at least 1)")
        if args.threads_per_run is not None and args.threads_per_run < 1:
            raise SweepError(f"--threads_per_run {args.threads_per_run}: give a number of threads of at least 1")
        if args.seeds and not all(s.isdigit() for s in args.seeds.split(",")):
            raise SweepError(f"--seeds {args.seeds!r}: give whole numbers separated by commas, e.g. 1,2,3")
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
        out_root = args.out_root or os.path.join("out", "sweep_" + os.path.splitext(os.path.basename(args.config))[0])
        fixed, extra = parse_assignments(args.set, "--set"), [k for k in args.extra.split(",") if k]
        if args.lr_grid:
            lr_keys = args.lr_keys.split("+")
            if set(lr_keys) & {k for key in grid for k in key.split("+")}:
                raise SweepError(f"--lr_keys {args.lr_keys} are swept by --lr_grid; leave them out of --grid")
            if not all(is_positive_number(v) for v in args.lr_grid.split(",")):
                raise SweepError(f"--lr_grid {args.lr_grid!r}: give positive numbers separated by commas")
            table = run_lr_sweep(args.config, grid, args.lr_grid.split(","), lr_keys, seeds, fixed, out_root,
                                 args.jobs, args.threads_per_run, args.rerun, baseline or None, args.claim,
                                 args.dry_run, extra, args.lr_seeds)
            return int(any(row["crashed_lrs"] for row in table))
        rows = run_sweep(args.config, grid, seeds, fixed, out_root, args.jobs, args.threads_per_run, args.rerun,
                         baseline or None, args.dry_run, extra)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: run the same command to continue the sweep", file=sys.stderr)
        return 130
    return int(any(r["exit_code"] not in (0, 3, None) for r in rows))


if __name__ == "__main__":
    sys.exit(main())

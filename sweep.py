"""
Run a grid of train.py runs, then print and save a table of the runs and one over seeds.

    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm,post --seeds 1,2,3
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm --grid learning_rate=1e-3,2e-3 \\
        --set max_iters=200 --set lr_decay_iters=200 --out_root out/lr_sweep --baseline norm_scheme=pre
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm --dry_run   # print the commands
    python sweep.py configs/icl_small_lipschitz_muon.py --grid learning_rate+matrix_lr=1e-3,1e-2   # tied keys
    python plot.py out/lr_sweep/*/ --metric loss,val_loss                           # draw the runs
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,post,geonorm --lr_grid 3e-4,1e-3,3e-3,1e-2,3e-2 \\
        --select_seeds 0 --seeds 1,2,3,4,5 --baseline norm_scheme=pre --out_root out/lr \\
        --row_claim norm_scheme=geonorm:lower:0.05 norm_scheme=post:none    # each scheme at its own best rate
    python plot.py --lr_sweep out/lr                                     # final loss against learning rate

With --lr_grid, every grid point runs every rate on the selection seeds (--select_seeds; default one seed not in
--seeds); the rate with the lowest final val loss (mean over them) is its best (a diverged or crashed run ranks
its rate last and stays in the table); the held-out --seeds run at the best rate only, and they alone enter the
mean ± std and the verdicts: a seed that picked the rate never does (the winner's curse). The table
gives each point's best rate, mean ± std (n) at it, the rates that diverged, the learning-rate sensitivity, and
a warning when the best rate is an edge of the grid or failed on a held-out seed. With --baseline, `verdict`
(below) compares each point's held-out losses at its best rate with the baseline's (paired by seed) for the
claim the point's paper makes against the baseline: --claim lower|higher by --delta (the paper's effect size),
on_par within ±--delta, or none (a description, not a verdict), and --row_claim POINT:CLAIM[:DELTA] for a point
of its own. Each row prints the claim, δ, Δ with its 95% interval, the mde (80% power), n and the word:
reproduced, smaller than claimed, contradicted or inconclusive at this scale (with the seeds it would take),
Holm-corrected over the table's rows. A decisive word needs 5 held-out seeds in each arm, a grid of at least 5
distinct rates and each arm's best rate inside it, not on an edge (a single rate is its own edge): otherwise
the word is "inconclusive at this scale" and the table says why. An arm that trained at no rate gets "no
verdict: trained at no rate". Two rates (muon, manifold_muon):
--lr_keys matrix_lr+learning_rate sweeps matrix_lr and keeps learning_rate at its config ratio to it.
--leaderboard compares only sweeps whose recorded setup and fixed settings agree with the baseline's; a row
of another setup says what differs in place of a verdict. Sweeps trained on different data (the data fingerprints
their summaries record differ) are refused, naming both. Its rows are described, not judged, unless --claim or
--row_claim states what their papers claim (a --row_claim that matches no row is refused). A root given twice (a
trailing slash, a symlink) is read once.

Without --lr_grid every arm runs at one learning rate, which is not a comparison (README, Comparing runs): a plain
grid prints no verdict, and with --baseline (which then only sets the ms/iter reference) it says so under its
tables.

Each run is `python train.py CONFIG --key=value ... --seed=S --out_dir=OUT_ROOT/key=value,...,seed=S`; its
output goes to out_dir/train.log, its exit code, wall time and resolved settings to out_dir/run.json, and
the tables to OUT_ROOT/summary.md and summary.json. Final losses are the last evaluation's up to max_iters (a
run trained on past them by hand counts at them); the mean ± std over seeds leaves out runs that diverged or
crashed. The same command continues a sweep: runs evaluated at max_iters (or diverged) are skipped unless
--rerun, an unfinished run with a checkpoint resumes. A run folder whose run.json records other settings
(another config or one edited since, other --set values: another sweep's run), whose checkpoint was trained
with other settings than the sweep plans (resumed by hand with other flags; a larger max_iters is fine), or on
other data than its dataset holds now (prepared again since), is neither skipped nor resumed: the sweep stops and
names it (another --out_root, or --rerun to replace it). A grid value, seed or rate given
twice is refused, and so is a key in two --grid or --set flags (alone or tied by +), a --set of the rate --lr_grid
sweeps or of the seed beside --seeds, and --grid min_lr with --lr_grid (min_lr follows the rate); run.json and the
summaries are written whole or not at all.
A run whose metrics hold its evaluation at max_iters is a result whatever exit code its run.json records. A
run folder in use by another process (a train.py started by hand) stops the sweep before anything starts. The
sweep notes its dataset's fingerprint (resume.data_fingerprint: tokenizer, vocabulary, each split's token count
and SHA-256) as it starts and its summary records it; a dataset prepared again while the sweep ran, or a run whose
checkpoint names other data, stops it with exit 2 naming the runs, before anything is averaged.
A grid value that would make a run folder's name longer than the file system takes is refused before anything
starts. A run that cannot be launched or whose run.json cannot be written (an OSError: a full disk) is reported in
its line; nothing starts after it, the running runs end, and the summary holds the runs that finished.
Exit code: 0 if every run finished or diverged (a divergence is a result), 1 if one crashed or could not be
launched or recorded (or a summary could not be written), 2 bad arguments, a result file that cannot be read or
a run folder in use; 130 on Ctrl-C or SIGINT, 143 on SIGTERM, 129 on SIGHUP (a closed terminal), to the sweep
alone or its process group: the sweep passes it on to its running runs as SIGTERM, on which they save their last
iteration and stop, waits for them (however many signals follow: no run is left running), starts
nothing more, and the same command continues the sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict

import torch

import prepare_data
import train
from model import GPTConfig
from nanonorm.resume import data_fingerprint, fingerprint_changes
from nanonorm.run_files import (
    CHECKPOINT_NAME,
    LAST_CHECKPOINT_NAME,
    LOCK_NAME,
    OutDirInUse,
    OutDirLock,
    previous_run_files,
    write_atomically,
)
from nanonorm.runs import (
    IGNORED_FLAGS,
    TASK_MODEL_KEYS,
    RunFileError,
    distinct_folders,
    diverged_at,
    load_metrics,
    run_config,
)
from nanonorm.train_config import ConfigError, TrainConfig, exit_with, explicit_settings
from nanonorm.verdict import (  # the rule: sweep.verdict stays importable
    DECISIVE,
    INCONCLUSIVE,
    MIN_RATES,
    correct_family,
    seeds_needed,
    verdict,
    verdict_text,
)

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
OUTCOMES = {0: "finished", 1: "crashed", 2: "bad config", 3: "diverged"}
COLUMNS = {"train_loss": ("final train loss", "{:.4f}"), "val_loss": ("final val loss", "{:.4f}"),  # (header, format)
           "diverged_at": ("diverged", "diverged at iteration {}"), "exit_code": ("exit", "{}"),
           "wall_s": ("wall (s)", "{:.1f}"), "ms_per_iter": ("ms/iter", "{:.1f}"),
           "val_loss_mean_std": ("final val loss (mean ± std)", "{}"),
           "ms_vs_baseline": ("ms/iter vs baseline", "{:.2f}x"), "best_lr": ("best lr", "{}"),
           "diverged_lrs": ("diverged at lr", "{}"), "verdict": ("verdict vs baseline", "{}"),
           "edge_warning": ("warning", "{}"), "label": ("arm", "{}"), "diff": ("Δ vs baseline", "{:+.4f}"),
           "run_minutes": ("run time (min)", "{:.1f}"), "lr_sensitivity": ("lr sensitivity", "{:.3f}"),
           "claim": ("claim", "{}"), "delta": ("δ", "{:g}"), "ci": ("95% interval of Δ", "[{0[0]:+.4f}, {0[1]:+.4f}]"),
           "mde": ("mde (80% power)", "{:.4f}"), "n_seeds": ("n", "{0[0]} vs {0[1]}")}
VERDICT_COLUMNS = ["claim", "delta", "diff", "ci", "mde", "n_seeds", "verdict"]  # each comparison, as tables print it
NO_VERDICT = ("no verdict: a grid without --lr_grid runs every arm at one learning rate, which is not a comparison "
              "(README, Comparing runs); --lr_grid runs each arm at its own best rate and gives the verdict rule's "
              "word")
JOBS_HELP = """runs at a time: N, or auto = max(1, cores // threads_per_run). Each run gets OMP_NUM_THREADS=
threads_per_run, by default all cores, so auto runs one at a time: torch already spreads a run's matmuls over
every core, and runs sharing cores gain little while their ms/iter measures the contention, not the model.
With --jobs N alone, each run gets cores // N threads."""


RESUME_FLAGS = ("init_from", "overwrite")  # what sweep.py adds to a command to resume or redo a run
BOOKKEEPING_KEYS = ("out_dir", *RESUME_FLAGS)  # where a run writes and how it starts, not what it trains


class SweepError(ValueError):
    """An argument the user has to fix; sweep.py exits with code 2."""


def is_positive_number(text: str) -> bool:
    return is_number(text) and float(text) > 0 and math.isfinite(float(text))


def parse_assignments(items: list[str], flag: str) -> dict[str, str]:
    """{key: value} of key=value items; a key given twice, alone or tied to others (a+b=...), is refused: the run
    would train with one value while its folder is named after both."""
    pairs: dict[str, str] = {}
    owner: dict[str, str] = {}  # each single key -> the item key it came in
    for item in items:
        key, sep, value = item.partition("=")
        if not (key and sep and value):
            raise SweepError(f"cannot read {flag} {item!r}; write {flag} key=value")
        for part in key.split("+"):
            if part in owner:
                first = owner[part]
                raise SweepError(f"{flag} {part}= is given twice ({first}={pairs.get(first, value)} and {key}={value})"
                                 "; give each key once")
            owner[part] = key
        pairs[key] = value
    return pairs


def distinct_values(text: str, flag: str) -> list[str]:
    """The comma-separated values of a flag, refusing a value given twice (numbers compared as numbers:
    1e-3 and 0.001 are one rate), which would plan two runs into one folder."""
    values = text.split(",")
    seen: dict[object, str] = {}
    for v in values:
        key = float(v) if is_number(v) else v
        if key in seen:
            raise SweepError(f"{flag}: {seen[key]} and {v} are the same value; give each value once")
        seen[key] = v
    return values


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


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
    if diverged_at(records) is not None or reached_max_iters(records, max_iters):
        return "finished"
    saved = (os.path.exists(os.path.join(out_dir, name)) for name in (CHECKPOINT_NAME, LAST_CHECKPOINT_NAME))
    return "resume" if any(saved) else "new"


def reached_max_iters(records: list[dict], max_iters: int) -> bool:
    """The run logged its evaluation at max_iters: its training is complete, whatever ended its process."""
    return any(r.get("kind") == "eval" and r["iter"] >= max_iters for r in records)


def plan_runs(config: str | None, grid: dict[str, list], seeds: list[int] | None = None,
              fixed: dict | None = None, out_root: str = "out/sweep", rerun: bool = False,
              lr_ratios: tuple[str, dict[str, float]] | None = None) -> list[dict]:
    """One job per run, {point, out_dir, argv, state, settings}; every argv is checked as train.py would.

    lr_ratios (key, {other: ratio}): each run sets `other` to ratio times its value of `key`."""
    if {"out_dir", "init_from", "overwrite"} & {*grid, *(fixed or {})}:
        raise SweepError("sweep.py sets out_dir, init_from and overwrite itself; use --out_root and --rerun")
    if seeds and "seed" in grid:
        raise SweepError("give the seeds either by --seeds or by --grid seed=..., not both")
    check_run_names(out_root, grid, seeds)
    jobs = []
    for point in expand_grid(grid, seeds):
        out_dir = os.path.join(out_root, run_name(point))
        argv = [config] if config else []
        settings = {key: v for k, v in {**(fixed or {}), **point}.items() for key in k.split("+")}  # a+b: tied
        if lr_ratios:
            key, ratios = lr_ratios
            settings.update({other: exact_text(float(settings[key]) * ratio) for other, ratio in ratios.items()})
        argv += [f"--{k}={v}" for k, v in settings.items()] + [f"--out_dir={out_dir}"]
        try:
            cfg, model_args = train.load_config(argv)  # checks every key and value before anything runs
        except train.ConfigError as e:
            raise SweepError(f"{e} (run {run_name(point)})" if point else str(e)) from None
        if any(job["out_dir"] == out_dir for job in jobs):
            raise SweepError(f"two runs would write {out_dir}; give each grid value and seed once")
        state = "new" if rerun else run_state(out_dir, cfg.max_iters)
        settings = resolved_settings(cfg, model_args)
        if state != "new":
            check_same_run(out_dir, argv, settings)
            check_same_data(out_dir, cfg)
            check_trained_settings(out_dir, {k: v for k, v in settings.items()
                                             if k not in TASK_MODEL_KEYS or k in model_args})
        if state == "resume":
            argv.append("--init_from=resume")
        elif previous_run_files(out_dir):  # an attempt cut off before its first checkpoint, or --rerun
            argv.append("--overwrite=True")
        jobs.append({"point": point, "out_dir": out_dir, "argv": argv, "state": state, "settings": settings,
                     "data": os.path.join(cfg.data_dir, cfg.dataset) if cfg.task == "lm" else None})
    return jobs


RUN_FILE_ROOM = 64  # bytes a run's own file names take under its folder (ckpt_<iter>.pt.sha256.<pid>.tmp)


def check_run_names(out_root: str, grid: dict[str, list], seeds: list[int] | None = None) -> None:
    """Refuse a grid whose run folder names (or paths) are longer than the file system takes, before any run
    starts: the run would fail to make its folder while the others went on."""
    folder = os.path.abspath(out_root)
    existing = folder
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    name_max, path_max = path_limit(existing, "PC_NAME_MAX", 255), path_limit(existing, "PC_PATH_MAX", 4096)
    for point in expand_grid(grid, seeds):
        name = run_name(point)
        if len(name.encode()) > name_max:
            key, value = max(point.items(), key=lambda kv: len(str(kv[1]).encode()))
            shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:24]}..."
            raise SweepError(f"the run folder of {key}={shown} would have a name of {len(name.encode())} bytes, over "
                             f"the limit of {name_max} bytes a file name has here; give {key} a shorter value (a "
                             "number in fewer digits), or fewer --grid keys. Nothing was started")
        if len(os.path.join(folder, name).encode()) + RUN_FILE_ROOM > path_max:
            raise SweepError(f"the run folder {os.path.join(folder, name)[:60]}... would have a path longer than the "
                             f"{path_max} bytes a path may have here (with its files); give a shorter --out_root. "
                             "Nothing was started")


def path_limit(folder: str, name: str, default: int) -> int:
    """os.pathconf(folder, name), or the default where the system does not say."""
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError, AttributeError):
        return default


def exact_text(x: float) -> str:
    """x as a flag value: short (%g) where that reads back as x, else every digit it needs (repr), so that train.py
    checks the number the sweep computed (min_lr <= learning_rate), not a rounding of it."""
    text = f"{x:g}"
    return text if float(text) == x else repr(x)


def resolved_settings(cfg: TrainConfig, model_args: dict) -> dict:
    """What a run trains with (its model keys over GPTConfig's defaults, then every training setting), but
    for BOOKKEEPING_KEYS, as JSON stores it (tuples as lists): what run.json records and a later sweep compares."""
    settings = {**asdict(GPTConfig()), **model_args, **asdict(cfg)}
    kept = {k: v for k, v in settings.items() if k not in BOOKKEEPING_KEYS}
    return json.loads(json.dumps(kept, default=str))


def flag_values(argv: list[str]) -> dict[str, str]:
    """{key: value} of a train.py command's --key=value flags, and the config file under "config" (its full
    path), leaving out out_dir (a copied sweep keeps its runs) and what a resumed run adds (RESUME_FLAGS)."""
    flags = dict(a[2:].partition("=")[::2] for a in argv if a.startswith("--"))
    config = [os.path.realpath(a) for a in argv if not a.startswith("--")]
    kept = {k: v for k, v in flags.items() if k not in (*RESUME_FLAGS, "out_dir")}
    return {**kept, "config": config[0] if config else None}


def check_same_run(out_dir: str, argv: list[str], settings: dict | None = None) -> None:
    """Refuse to skip or resume a run whose run.json records other settings (another config, one edited since,
    other --set values: another sweep's run), which would report its losses as this sweep's. `settings` are
    the run's resolved_settings now, compared over the keys both sides have; a run.json without them (an
    older sweep.py's) is compared by the command's flags. A run stopped before its run.json was written (the
    sweep was stopped, or train.py was run by hand) is checked against the settings its checkpoint saved
    instead, and refused if it has none."""
    info = read_run_info(out_dir)
    stored = info.get("argv")
    if settings is not None and "settings" in info:
        mine, theirs = shared_settings(settings, info["settings"])
    elif stored is not None:
        mine, theirs = flag_values(argv), flag_values(stored)
    else:
        saved = run_config(out_dir)  # ckpt.pt's settings; None without it
        if saved is None:
            raise SweepError(f"{out_dir} holds a run with neither a run.json nor a checkpoint, so nothing says it "
                             "is this sweep's; --rerun runs it again (its files are replaced), or move it away")
        mine = {k: v for k, v in explicit_settings(argv).items() if k not in (*RESUME_FLAGS, "out_dir")}
        theirs = {k: saved.get(k, "(unset)") for k in mine}
    differ = [f"{k}={mine.get(k, '(unset)')} here, {theirs.get(k, '(unset)')} there"
              for k in dict.fromkeys([*mine, *theirs]) if mine.get(k) != theirs.get(k)]
    if differ:
        raise SweepError(f"{out_dir} holds a run of another sweep ({'; '.join(differ)}); give another --out_root, "
                         "or --rerun to run it again with these settings (its files are replaced)")


def check_same_data(out_dir: str, cfg: TrainConfig) -> None:
    """Refuse to skip or resume a run trained on other token files than its dataset holds now (prepared again
    since from other text), which would average its loss with runs on another corpus: the token counts and
    digests its checkpoint saved against meta.json's now, as train.py compares them on resume."""
    path = os.path.join(cfg.data_dir, cfg.dataset)
    saved = saved_data_meta(out_dir) if cfg.task == "lm" else None
    now = dataset_fingerprint(path) if saved else None
    if not saved or now is None:
        return
    changed = fingerprint_changes(data_fingerprint(saved), now)
    if changed:
        raise SweepError(f"{out_dir} was trained on other data than {path} holds now (prepared again since: "
                         f"{', '.join(changed)}); --rerun runs it again on this data, or prepare the data as it was")


def dataset_fingerprint(path: str) -> dict | None:
    """The data fingerprint (resume.data_fingerprint) of the dataset at path now; None where it is not prepared,
    which its runs report themselves."""
    if not os.path.exists(os.path.join(path, "meta.json")):
        return None
    try:
        return data_fingerprint(prepare_data.load_meta(path))
    except (FileNotFoundError, ValueError) as e:
        raise SweepError(str(e).replace("\n", " ")) from None


def data_fingerprints(jobs: list[dict]) -> dict[str, dict]:
    """{dataset path: its data fingerprint} of the jobs' datasets as the sweep starts: what each run's result is
    checked against (check_run_data) and the summary records."""
    paths = dict.fromkeys(job["data"] for job in jobs if job.get("data"))
    return {path: fp for path in paths if (fp := dataset_fingerprint(path)) is not None}


def check_run_data(jobs: list[dict], start: dict[str, dict]) -> None:
    """Refuse to summarize a sweep whose dataset was prepared again while it ran (meta.json no longer what it was at
    the start), or whose runs' checkpoints name other data than the start's: their losses would be averaged with
    those of another corpus. Nothing is deleted; the message names the runs trained on the other data."""
    for path, before in start.items():
        now = dataset_fingerprint(path)
        changed = fingerprint_changes(before, now) if now is not None else ["meta.json removed"]
        other = [job["out_dir"] for job in jobs if job.get("data") == path
                 and (meta := saved_data_meta(job["out_dir"])) and fingerprint_changes(before, data_fingerprint(meta))]
        if not (changed or other):
            continue
        what = [f"{path} was prepared again while the sweep ran ({', '.join(changed)})"] if changed else []
        what += [f"{', '.join(other)} trained on other data than it held when the sweep started"] if other else []
        raise SweepError(f"{'; '.join(what)}: runs on two corpora are not averaged together, and no summary was "
                         "written. Prepare the data as it was and run the same command again, or run it with --rerun "
                         "to train every run on the data there now")


def recorded_data(fingerprints: dict[str, dict]) -> dict:
    """What a summary records of its data: {dataset name: fingerprint}, by name so that a sweep moved to another
    data_dir compares equal (a name met twice with other data is kept under its path)."""
    named: dict[str, dict] = {}
    for path, fp in fingerprints.items():
        name = os.path.basename(os.path.normpath(path))
        named[name if named.get(name, fp) == fp else path] = fp
    return {"data_fingerprint": named} if named else {}


def saved_checkpoints(out_dir: str) -> list[tuple[str, dict]]:
    """(path, contents) of the checkpoints a resumed run starts from (ckpt.pt, ckpt_last.pt), those there are."""
    found = []
    for path in (os.path.join(out_dir, n) for n in (CHECKPOINT_NAME, LAST_CHECKPOINT_NAME)):
        if not os.path.exists(path):
            continue
        try:  # mmap: the small dicts are read, not the weights
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises many kinds (RuntimeError, UnpicklingError, EOFError) for a bad file
            raise SweepError(f"{path} cannot be read as a checkpoint ({e.__class__.__name__}); move the run away, "
                             "or --rerun to run it again") from None
        found.append((path, saved if isinstance(saved, dict) else {}))
    return found


def saved_data_meta(out_dir: str) -> dict | None:
    """The meta.json of the data a run trained on, as its checkpoint saved it; None without one."""
    saved = next((c.get("data_meta") for _, c in saved_checkpoints(out_dir)), None)
    return saved if isinstance(saved, dict) else None


def check_trained_settings(out_dir: str, planned: dict) -> None:
    """Refuse to skip or resume a run whose checkpoints say it trained with other settings than this sweep plans
    (`planned`: its resolved settings, but for the model keys the task fills in): resumed or run again by hand with
    other flags, while its run.json still records the sweep's. A larger max_iters is a run trained on past the
    sweep's, which counts at the sweep's (summarize)."""
    for path, saved in saved_checkpoints(out_dir):
        if not isinstance(saved.get("config"), dict):
            continue
        trained = json.loads(json.dumps({**(saved.get("model_args") or {}), **saved["config"]}, default=str))
        differ = [f"{k}={v} here, {trained[k]} in {os.path.basename(path)}" for k, v in planned.items()
                  if k in trained and trained[k] != v and not (k == "max_iters" and past(trained[k], v))]
        if differ:
            raise SweepError(f"{out_dir} was trained with other settings than this sweep plans ({'; '.join(differ)}): "
                             "resumed or run by hand with other flags; give another --out_root, or --rerun to run it "
                             "again with these settings (its files are replaced)")


def past(trained: object, planned: object) -> bool:
    """Whether a run's max_iters lies beyond the sweep's (both whole numbers)."""
    return isinstance(trained, int) and isinstance(planned, int) and trained > planned


def shared_settings(mine: dict, theirs: dict) -> tuple[dict, dict]:
    """Both settings over the keys both have: a key added to the code since a run was recorded says nothing."""
    shared = [k for k in mine if k in theirs]
    return {k: mine[k] for k in shared}, {k: theirs[k] for k in shared}


def parallelism(jobs: str | int, threads_per_run: int | None) -> tuple[int, int]:
    """(runs at a time, threads per run) on this machine's cores; see JOBS_HELP."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads_per_run is None:
        threads_per_run = cores if jobs == "auto" else max(1, cores // int(jobs))
    return (max(1, cores // threads_per_run) if jobs == "auto" else int(jobs)), threads_per_run


class Interrupted(KeyboardInterrupt):
    """A stop signal reached the sweep: it stops as Ctrl-C stops it, with the signal's exit code (128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class NotStarted(Exception):
    """A run the sweep did not start, as an earlier one could not be launched or recorded."""


class LaunchFailed(Exception):
    """Runs that could not be launched, or whose run.json could not be written (an OSError: a full disk, a folder
    that cannot be made): the sweep started nothing after the first. `left`: the out_dirs of the runs that did not
    run to their end and be recorded."""

    def __init__(self, failures: list[str], left: set[str]):
        runs = f"{len(failures)} run{'s' * (len(failures) != 1)}"
        super().__init__(f"{runs} could not be launched or recorded ({'; '.join(failures)}); nothing more was "
                         "started, and the summary holds the runs that finished: fix the cause and run the same "
                         "command to continue")
        self.left = left

    def kept(self, jobs: list[dict]) -> list[dict]:
        """The jobs that ran to their end, or had before."""
        return [job for job in jobs if job["out_dir"] not in self.left]

    @property
    def note(self) -> str:
        return f"incomplete: {self}"


class Children:
    """The train.py processes the sweep runs now, so that a stop signal reaches them and none starts after it."""

    def __init__(self):
        self._lock = threading.RLock()  # a signal handler runs in the main thread, maybe inside `stop`
        self._running: set[subprocess.Popen] = set()
        self.stopping: int | None = None  # the stop signal received
        self.halted = False  # a run could not be launched or recorded: start no other

    def check_running(self) -> None:
        """Interrupted if the sweep is stopping, NotStarted after a failed launch: nothing more starts."""
        if self.stopping is not None:
            raise Interrupted(self.stopping)
        if self.halted:
            raise NotStarted

    def start(self, command: list[str], **options) -> subprocess.Popen:
        """Popen(command), unless the sweep is stopping or halted."""
        with self._lock:
            self.check_running()
            process = subprocess.Popen(command, **options)
            self._running.add(process)
        return process

    def wait(self, process: subprocess.Popen) -> int:
        try:
            return process.wait()
        finally:
            with self._lock:
                self._running.discard(process)

    def stop(self, signum: int) -> None:
        """Start nothing more, and pass the stop signal on to the running children (FORWARDED)."""
        with self._lock:
            self.stopping = signum if self.stopping is None else self.stopping
            running = list(self._running)
        for process in running:
            process.send_signal(FORWARDED.get(signum, signum))  # a child that has just ended is skipped (Popen polls)

    def halt(self) -> None:
        """Start no run after this one (the runs already running go on to their end)."""
        with self._lock:
            self.halted = True

    def reset(self) -> None:
        with self._lock:
            self.stopping, self.halted = None, False


CHILDREN = Children()


# a stop signal to the sweep -> what its runs get: SIGTERM, on which train.py saves and stops however often it comes
# (a second SIGINT would stop it unsaved, and Ctrl-C at the terminal has sent the runs one SIGINT already)
FORWARDED = {signal.SIGINT: signal.SIGTERM, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}


@contextlib.contextmanager
def forwarding_stop_signals() -> Iterator[None]:
    """A stop signal to the sweep (FORWARDED: Ctrl-C, or SIGINT, SIGTERM or SIGHUP sent to its process alone) stops
    it: the running train.py runs get SIGTERM (each saves its last iteration and exits 4), nothing more starts, and
    Interrupted is raised; the sweep then waits for the runs to end, so none is left running. A repeated signal
    only reaches the runs again (a second Ctrl-C at the terminal still stops them at once, unsaved). A signal the
    sweep was started ignoring (nohup, a background job) stays ignored. The previous handlers come back on leaving,
    unless a stop signal came: the sweep is then ending, and a late one is ignored rather than cutting its exit
    short."""
    def handle(signum: int, frame) -> None:
        first = CHILDREN.stopping is None
        CHILDREN.stop(signum)
        if first:
            raise Interrupted(signum)

    CHILDREN.reset()
    previous = {s: signal.signal(s, handle) for s in FORWARDED if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if CHILDREN.stopping is None else signal.SIG_IGN)


def say(line: str) -> None:
    """Print one line in one write: print() writes the text and its newline separately, so a run's start line
    from a worker thread could land between another line and its newline."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def code_version(where: str = os.path.dirname(TRAIN)) -> str | None:
    """The commit of the checkout at `where`, with "+dirty" when tracked files differ from it: run.json records it
    so that a result can be traced to the code that made it. None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", where, *args], capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def launch(job: dict, threads: int) -> dict:
    """Run one job to its end: output to out_dir/train.log; exit code, wall time (summed over resumptions),
    the run's resolved settings and the code's commit to out_dir/run.json. A sweep stopping starts no run
    (Interrupted). An OSError launching it or writing its run.json is returned as its "error", and no run starts
    after it ({"not_started": True})."""
    try:
        info = run_to_end(job, threads)
    except NotStarted:
        return {"not_started": True}
    except OSError as e:
        CHILDREN.halt()
        return {"error": f"could not be launched ({error_text(e)})"}
    try:
        write_atomically(os.path.join(job["out_dir"], "run.json"), json.dumps(info, indent=1).encode())
    except OSError as e:
        CHILDREN.halt()
        return {**info, "error": f"its run.json could not be written ({error_text(e)})"}
    return info


def error_text(e: OSError) -> str:
    """An OSError in a few words: what failed, on which file."""
    return f"{e.strerror or e}: {e.filename}" if e.filename else str(e.strerror or e)


def run_to_end(job: dict, threads: int) -> dict:
    """Start one job's train.py and wait for it; what its run.json records."""
    CHILDREN.check_running()
    os.makedirs(job["out_dir"], exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    say(f"start {job['out_dir']}" + (" (resume)" if job["state"] == "resume" else ""))
    before = read_run_info(job["out_dir"]).get("wall_s", 0.0) if job["state"] == "resume" else 0.0
    start = time.perf_counter()
    with open(os.path.join(job["out_dir"], "train.log"), "a" if job["state"] == "resume" else "w") as log:
        process = CHILDREN.start([sys.executable, TRAIN, *job["argv"]], stdout=log, stderr=subprocess.STDOUT,
                                 env=env)
        code = CHILDREN.wait(process)
    info = {"point": job["point"], "argv": job["argv"], "exit_code": code,
            "wall_s": before + time.perf_counter() - start, "threads": threads, "settings": job["settings"],
            "commit": code_version()}  # the commit of the launch that finished it, when a run resumed
    return info


def read_json(path: str) -> dict:
    """The JSON object in path ({} if there is none); a file cut off or not an object is a SweepError."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (ValueError, OSError) as e:
        raise SweepError(f"{path} cannot be read ({e.__class__.__name__}: cut off or corrupt); move it away or "
                         "delete it, then run the command that wrote it again") from None
    if not isinstance(data, dict):
        raise SweepError(f"{path} holds no JSON object; move it away or delete it, then run the command that "
                         "wrote it again")
    return data


RUN_INFO_TYPES = {"point": (dict,), "argv": (list,), "exit_code": (int, type(None)), "wall_s": (int, float),
                  "threads": (int,), "settings": (dict,)}  # what launch writes to run.json


def read_run_info(out_dir: str) -> dict:
    """out_dir/run.json ({} if there is none), its values checked against what launch writes (RUN_INFO_TYPES):
    one edited into another type is a SweepError naming the file and the key."""
    path = os.path.join(out_dir, "run.json")
    info = read_json(path)
    for key, types in RUN_INFO_TYPES.items():
        value = info.get(key, types[0]())
        if isinstance(value, bool) or not isinstance(value, types) or key == "argv" and not all(
                isinstance(a, str) for a in value):
            raise SweepError(f"{path}: {key} is {value!r}, not what sweep.py writes there (edited by hand?); move "
                             "the run away, or --rerun to run it again")
    return info


def summarize(out_dirs: list[str], extra: list[str] | None = None, points: list[dict] | None = None,
              max_iters: list[int] | None = None) -> list[dict]:
    """One row per run: its grid values and seed (`points`, one per run; default: what its run.json records),
    final losses (of its last evaluation up to its `max_iters`, one per run: a run trained on past them by hand
    counts at them) and that evaluation's iteration, divergence, exit code, whether it reached its `max_iters`
    (the rule run_state skips it by), time, and the `extra` metrics of its last evaluation that logged them
    (e.g. val_xy_loss, grad_kurtosis)."""
    rows = []
    for i, out_dir in enumerate(out_dirs):
        records = load_metrics(out_dir)
        if max_iters:  # a run trained on by hand past max_iters counts at max_iters, as the sweep's other runs
            records = [r for r in records if r.get("iter", 0) <= max_iters[i]]
        info = read_run_info(out_dir)
        evals = [r for r in records if r.get("kind") == "eval"]
        ms = [r["ms_per_iter"] for r in records if r.get("kind") == "train" and "ms_per_iter" in r]
        rows.append({"out_dir": out_dir, **(points[i] if points else info.get("point", {})),
                     "final_iter": evals[-1]["iter"] if evals else None,
                     "train_loss": evals[-1].get("train_loss") if evals else None,
                     "val_loss": evals[-1].get("val_loss") if evals else None,
                     "diverged_at": diverged_at(records), "exit_code": info.get("exit_code"),
                     "reached_max_iters": bool(max_iters) and reached_max_iters(records, max_iters[i]),
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
        ok = [r["val_loss"] for r in group if math.isfinite(final_loss(r))]
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


def busy_runs(jobs: list[dict]) -> list[str]:
    """The out_dirs of the jobs whose folder lock another process holds (a train.py started by hand, or left
    running by a sweep that was killed); the lock is taken and released at once. A folder that was never
    locked is not touched, and one that cannot be locked for another reason is left to train.py to report
    in the run's log."""
    busy = []
    for job in jobs:
        if not os.path.exists(os.path.join(job["out_dir"], LOCK_NAME)):
            continue
        try:
            OutDirLock(job["out_dir"]).release()
        except OutDirInUse:
            busy.append(job["out_dir"])
        except ConfigError:
            continue
    return busy


def execute(pending: list[dict], workers: int, threads: int) -> None:
    """Run the jobs, `workers` at a time, printing each outcome as it comes. A run folder in use by another
    process stops the sweep (SweepError) before any job starts; a stop signal starts nothing more. A run that
    cannot be launched or recorded (an OSError) is reported in its line, nothing starts after it, and LaunchFailed
    is raised once the running runs have ended."""
    if busy := busy_runs(pending):
        raise SweepError(f"{', '.join(busy)}: in use by another process (its id is in the folder's {LOCK_NAME}); "
                         "wait for it to end or stop it, then run the same command again. Nothing was started")
    CHILDREN.reset()
    failures, left, done = [], set(), 0
    with ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(launch, job, threads): job for job in pending}
        try:
            for future in as_completed(futures):
                job, info = futures[future], future.result()
                if "error" in info or "not_started" in info:
                    left.add(job["out_dir"])
                if "not_started" in info:
                    continue
                done += 1
                if "error" in info:
                    failures.append(f"{run_name(job['point'])}: {info['error']}")
                say(f"[{done}/{len(pending)}] {run_name(job['point'])}: {outcome_text(job, info)}")
        except KeyboardInterrupt:
            if CHILDREN.stopping is None:  # a KeyboardInterrupt past forwarding_stop_signals (sweep.py imported)
                CHILDREN.stop(signal.SIGINT)
            pool.shutdown(cancel_futures=True)  # start nothing more; the same command continues the sweep
            raise
    if failures:
        raise LaunchFailed(failures, left)


def outcome_text(job: dict, info: dict) -> str:
    """How a run ended, as its line after it says: its outcome and time, or why it failed to launch or record."""
    if "error" in info and "exit_code" not in info:
        return info["error"]
    outcome = OUTCOMES.get(info["exit_code"], f"exit {info['exit_code']}")
    log = f", see {job['out_dir']}/train.log" if info["exit_code"] not in (0, 3) else ""
    return f"{outcome} in {info['wall_s']:.1f} s{log}" + (f", but {info['error']}" if "error" in info else "")


def summarize_jobs(jobs: list[dict], extra: list[str] | None = None) -> list[dict]:
    """summarize() of plan_runs' jobs: their grid values and max_iters from the plan."""
    return summarize([job["out_dir"] for job in jobs], extra, [job["point"] for job in jobs],
                     [job["settings"]["max_iters"] for job in jobs])


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
    data = data_fingerprints(todo)

    def finish(jobs: list[dict], note: str | None = None) -> list[dict]:
        check_run_data(jobs, data)
        rows = summarize_jobs(jobs, extra)
        notes = "\n\n".join(n for n in (NO_VERDICT if baseline else None, note) if n) or None
        write_summary(out_root, rows, aggregate(rows, list(grid), baseline), list(grid), bool(seeds),
                      f"Sweep of {config} over {grid}, seeds {seeds or 'of the config'}", extra or [], notes,
                      recorded_data(data))
        return rows

    try:
        execute(pending, workers, threads)
    except LaunchFailed as e:
        finish(e.kept(todo), e.note)
        raise
    return finish(todo)


def write_summary(out_root: str, rows: list[dict], points: list[dict], keys: list[str], seeds: bool, title: str,
                  extra: list[str] = (), note: str | None = None, recorded: dict | None = None):
    """Print the two tables (and the note under them) and write them to out_root/summary.md and summary.json, with
    `recorded` (the data the runs trained on)."""
    run_columns = [*keys, *(["seed"] if seeds else []), "train_loss", "val_loss", *extra, "diverged_at",
                   "exit_code", "wall_s", "ms_per_iter"]
    text = "\n\n".join([format_table(rows, run_columns),
                        format_table(points, [*keys, "runs", "val_loss_mean_std", "diverged", "ms_vs_baseline"]),
                        *([note] if note else [])])
    print("\n" + text)
    write_summary_files(out_root, title, text, {**(recorded or {}), "runs": rows, "grid_points": points})


def write_summary_files(out_root: str, title: str, text: str, data: dict) -> None:
    """out_root/summary.md (title, then text) and summary.json (title, then data). A summary of another sweep
    there (another title: other grid values, rates or seeds) is first renamed to summary_<its time>.*, not lost."""
    os.makedirs(out_root, exist_ok=True)
    md, js = (os.path.join(out_root, f"summary.{ext}") for ext in ("md", "json"))
    if os.path.exists(js) and read_json(js).get("title") != title:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(js)))
        for path in (md, js):
            if os.path.exists(path):
                os.replace(path, path.replace("summary.", f"summary_{stamp}.", 1))
        print(f"the summary of another sweep in {out_root} is kept as summary_{stamp}.md and .json")
    write_atomically(md, f"# {title}\n\n{text}\n".encode())
    write_atomically(js, json.dumps({"title": title, **data}, indent=1).encode())


# ----------------------------------------------------------------------------- learning-rate sweeps


def trained_to_end(row: dict) -> bool:
    """The run's training counts as complete: it exited with 0 (or recorded no exit code), or its metrics hold
    the evaluation at max_iters whatever exit code run.json records (killed while drawing its final sample,
    or completed by hand with --init_from=resume after a stop)."""
    return row["exit_code"] in (0, None) or bool(row.get("reached_max_iters"))


def crashed(row: dict) -> bool:
    """A run that ended with an error (a crash or a refused config) before it could train or diverge: not a result."""
    return row["diverged_at"] is None and row["exit_code"] != 3 and not trained_to_end(row)


def final_loss(row: dict) -> float:
    """The run's final val loss for the verdict rule and the choice of rate: +inf if it diverged, crashed
    or ended without a finite loss."""
    loss = row.get("val_loss")
    ok = row["diverged_at"] is None and trained_to_end(row) and loss is not None and math.isfinite(loss)
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


def matches(row: dict, point: dict) -> bool:
    """Whether a run (or point) has every value of `point`, compared as text (a summary's 0.001 is "0.001")."""
    return all(str(row.get(k)) == str(v) for k, v in point.items())


def first_seed_runs(rows: list[dict], lr_key: str) -> list[dict]:
    """The runs of one grid point on its first selection seed: the seed that ran the most rates."""
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
    """The best rate of one grid point from its runs at every rate (on each selection seed): the lowest mean final
    val loss over those seeds, a rate with a diverged or crashed run ranking last; the diverged and crashed
    rates, and the edge warning."""
    by_rate: dict[str, list[float]] = {}
    for r in rows:
        by_rate.setdefault(r[lr_key], []).append(final_loss(r))
    trained = {lr: statistics.fmean(losses) for lr, losses in by_rate.items() if all(map(math.isfinite, losses))}
    best = min(trained, key=trained.get) if trained else None
    numeric = sorted(float(v) for v in lr_values)
    edge = None
    if best is not None and len(set(numeric)) == 1:
        edge = "the grid has one rate: give --lr_grid at least five"
    elif best is not None and float(best) in (numeric[0], numeric[-1]):
        side = "lowest" if float(best) == numeric[0] else "highest"
        edge = f"best at the {side} rate of the grid: extend --lr_grid beyond it"
    diverged = list(dict.fromkeys(r[lr_key] for r in rows if r["diverged_at"] is not None))
    failed = list(dict.fromkeys(r[lr_key] for r in rows if crashed(r)))
    return {"best_lr": best, "diverged_lrs": diverged, "crashed_lrs": failed, "edge_warning": edge,
            "lr_sensitivity": lr_sensitivity(first_seed_runs(rows, lr_key), lr_key)}


def run_lr_sweep(config: str, grid: dict[str, list], lr_values: list[str], lr_keys: list[str],
                 seeds: list[int] | None = None, fixed: dict | None = None, out_root: str = "out/sweep",
                 jobs: str | int = "auto", threads_per_run: int | None = None, rerun: bool = False,
                 baseline: dict | None = None, claims: list | None = None, dry_run: bool = False,
                 extra: list[str] | None = None, select_seeds: list[int] | None = None) -> list[dict]:
    """Each grid point at its own best learning rate, judged on seeds that did not pick it: every rate
    runs on the selection seeds (`select_seeds`; default: one seed not in `seeds`, default_select_seed), the best
    is kept (lowest mean final val loss over them; a diverged run ranks its rate last), and the held-out `seeds`
    run at that rate only. The mean ± std and the verdicts against `baseline` (each point's claim and δ from
    `claims`, see claim_for) use the held-out seeds alone. Returns one row per grid point."""
    fixed = dict(fixed or {})
    if not str(fixed.get("seed", 0)).isdigit():
        raise SweepError(f"--set seed={fixed['seed']}: give a whole number, or several with --seeds")
    seeds = seeds or [train.TrainConfig.seed if "seed" not in fixed else int(fixed.pop("seed"))]
    select = select_seeds or [default_select_seed(seeds)]
    check_held_out(select, seeds)
    lr_key, ratios = lr_ratios_of(config, fixed, lr_keys)
    workers, threads = parallelism(jobs, threads_per_run)
    if len(lr_values) < MIN_RATES and baseline:
        print(f"note: {len(lr_values)} rates; a verdict needs at least {MIN_RATES}, so none will be decisive")
    check_run_names(out_root, {**grid, lr_key: lr_values}, [*select, *seeds])  # the held-out runs' too, up front
    first = plan_runs(config, {**grid, lr_key: lr_values}, select, fixed, out_root, rerun, (lr_key, ratios))
    pending = [job for job in first if job["state"] != "finished"]
    print(f"{len(first)} runs over {len(lr_values)} rates on selection seeds {select}, {len(pending)} to run, "
          f"{workers} at a time with OMP_NUM_THREADS={threads}; then held-out seeds {seeds} at each point's "
          "best rate")
    if dry_run:
        for job in pending:
            print(shlex.join(["python", "train.py", *job["argv"]]))
        return []
    data = data_fingerprints(first)
    points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]

    def picked(first_jobs: list[dict]) -> tuple[list[dict], list[dict]]:  # the selection runs, each point's pick
        rows = summarize_jobs(first_jobs, extra)
        return rows, [{**p, **pick_best([r for r in rows if matches(r, p)], lr_key, lr_values)} for p in points]

    def finish(first_jobs: list[dict], rest_jobs: list[dict], note: str | None = None) -> list[dict]:
        check_run_data(first_jobs + rest_jobs, data)
        first_rows, choice = picked(first_jobs)
        rows = first_rows + summarize_jobs(rest_jobs, extra)
        table = lr_table(rows, choice, list(grid), lr_key, baseline, claims, select)
        write_lr_summary(out_root, rows, table, list(grid), lr_key, extra or [],
                         f"Learning-rate sweep of {config} over {grid}, {lr_key} in {lr_values}"
                         + (f" (scaling {', '.join(ratios)} with it)" if ratios else "")
                         + f", rates picked on seeds {select}, held-out seeds {seeds}",
                         {"select_seeds": select, "held_out_seeds": seeds, **recorded_data(data),
                          **({"setup": run_setup(first[0]["argv"], len(seeds)),
                              "settings": run_settings(first[0]["argv"]),
                              "swept": [*(k for key in grid for k in key.split("+")), lr_key, *ratios]}
                             if first else {})}, note)
        return table

    rest: list[dict] = []
    try:
        execute(pending, workers, threads)
        check_run_data(first, data)  # before the held-out seeds train on other data than picked their rates
        rest = [job for c, point in zip(picked(first)[1], points, strict=True) if c["best_lr"] is not None
                for job in plan_runs(config, {**{k: [v] for k, v in point.items()}, lr_key: [c["best_lr"]]}, seeds,
                                     fixed, out_root, rerun, (lr_key, ratios))]
        execute([job for job in rest if job["state"] != "finished"], workers, threads)
    except LaunchFailed as e:
        finish(e.kept(first), e.kept(rest), e.note)
        raise
    return finish(first, rest)


def run_setup(argv: list[str], n_seeds: int) -> dict:
    """What a figure's title states of a sweep: model size, data, steps, optimizer, seeds."""
    cfg, model_args = train.load_config(argv)
    size = {k: model_args.get(k, getattr(GPTConfig, k)) for k in ("n_layer", "n_embd", "block_size")}
    if cfg.task == "icl" and "block_size" not in model_args:  # the task sets it (icl_task: 2 * icl_pairs)
        size["block_size"] = 2 * cfg.icl_pairs
    data = cfg.dataset if cfg.task == "lm" else f"least squares (T {cfg.icl_pairs})"
    return {**size, "task": cfg.task, "data": data, "dataset": cfg.dataset, "data_dir": cfg.data_dir,
            "batch_size": cfg.batch_size, "max_iters": cfg.max_iters, "optimizer": cfg.optimizer, "seeds": n_seeds}


def run_settings(argv: list[str]) -> dict:
    """Every training and model setting of a run's command (the config's, the flags', the defaults), but for
    the bookkeeping ones: what two sweeps must share for their points to be compared."""
    cfg, model_args = train.load_config(argv)
    settings = {**asdict(GPTConfig()), **model_args, **vars(cfg)}
    return {k: v for k, v in settings.items() if k not in (*IGNORED_FLAGS, "seed")}


def point_warnings(edge: str | None, losses: dict[int, float]) -> str | None:
    """The edge warning, and a warning when the best rate (picked on the selection seeds) diverged or crashed on
    a held-out seed: that pick is fragile, and the mean over the seeds that trained flatters it."""
    failed = sorted(int(s) for s, x in losses.items() if not math.isfinite(x))
    fragile = f"diverged or crashed at its best rate on seed {','.join(map(str, failed))}" if failed else None
    return "; ".join(w for w in (edge, fragile) if w) or None


def grid_shortfall(first_runs: list[dict], lr_key: str, best_lr: str | None) -> str | None:
    """Why one point's learning-rate sweep cannot back a verdict (README, Comparing runs: at least MIN_RATES rates, the
    best not on an edge; a single rate is its own edge), from the rates its first seed ran; None if it can.
    A rate whose run crashed gave no result (a diverged one did), so it counts neither as a rate nor as an edge."""
    failed = sorted({float(r[lr_key]) for r in first_runs if crashed(r)})
    rates = sorted({float(r[lr_key]) for r in first_runs} - set(failed))
    if best_lr is None:
        return "no rate trained: every rate of the grid diverged or crashed"
    if len(rates) < MIN_RATES:
        why = f" ({', '.join(f'{x:g}' for x in failed)} crashed: run the sweep again)" if failed else ""
        return f"{len(rates)} rate{'s' * (len(rates) != 1)} in the grid with a result{why}; the rule needs {MIN_RATES}"
    if float(best_lr) in (rates[0], rates[-1]):
        return "best rate on the grid's edge"
    return None


def lr_verdict(losses: dict, base_losses: dict, claim: str | None, delta: float, shortfalls: list[str | None]) -> dict:
    """The verdict rule on two points' per-seed losses at their best rates, over held-out seeds (paired when they
    share their seeds); a decisive word becomes "inconclusive at this scale" when either grid falls short (a
    description stays, the shortfall said beside it)."""
    seeds = sorted(losses)
    paired = seeds == sorted(base_losses)
    v = verdict([losses[s] for s in seeds], [base_losses[s] for s in (seeds if paired else sorted(base_losses))],
                claim, delta, paired)
    reason = "; ".join(dict.fromkeys(r for r in shortfalls if r))
    if reason:
        downgrade = claim is not None and v["verdict"] in DECISIVE
        v = {**v, "verdict": INCONCLUSIVE if downgrade else v["verdict"],
             "reason": "; ".join(r for r in (v["reason"], reason) if r)}
        if downgrade:
            v["seeds_needed"] = seeds_needed(v)
    return v


def check_held_out(select_seeds: list[int], seeds: list[int]) -> None:
    """Refuse a seed that would both pick the rate and enter the verdict."""
    if common := sorted(set(select_seeds) & set(seeds)):
        raise SweepError(f"seed {','.join(map(str, common))} is in both --select_seeds and --seeds: a seed that "
                         "picks the rate never enters a verdict; give the two lists no seed in common")


def default_select_seed(seeds: list[int]) -> int:
    """The selection seed when --select_seeds is not given: the smallest whole number not among the held-out
    seeds (0 beside --seeds 1,2,3,4,5)."""
    return next(s for s in itertools.count() if s not in seeds)


def selection_seeds(summary: dict, runs: list[dict]) -> set[int]:
    """The seeds that picked a point's rate, from its summary: those it names (select_seeds), or, in a summary
    written before it named them, the seeds of the point's `runs` that ran more than one rate."""
    if "select_seeds" in summary:
        return set(summary["select_seeds"])
    rates: dict[int, set] = {}
    for r in runs:
        rates.setdefault(r["seed"], set()).add(float(r[summary["lr_key"]]))
    return {s for s, ran in rates.items() if len(ran) > 1}


def parse_claim(text: str, flag: str = "--row_claim") -> tuple[dict, str | None, float]:
    """(point, claim, δ) from POINT:CLAIM or POINT:CLAIM:DELTA, POINT as key=value[,key=value], e.g.
    norm_scheme=geonorm:lower:0.05 or norm_scheme=post:none."""
    head, *rest = text.split(":")
    if not head or not 1 <= len(rest) <= 2:
        raise SweepError(f"cannot read {flag} {text!r}; write POINT:CLAIM or POINT:CLAIM:DELTA, e.g. "
                         "norm_scheme=geonorm:lower:0.05 or norm_scheme=post:none")
    return (parse_assignments(head.split(","), flag), *checked_claim(rest[0], rest[1] if rest[1:] else None, flag))


def checked_claim(claim: str, delta: str | None, flag: str = "--claim") -> tuple[str | None, float]:
    """A claim and its δ as the command line gives them, checked: claim one of lower, higher, on_par, none; δ a
    number >= 0 (on_par: > 0, its margin; none: no δ)."""
    if claim not in ("lower", "higher", "on_par", "none"):
        raise SweepError(f"{flag}: claim {claim!r}; choose lower, higher, on_par or none")
    if delta is not None and not (is_number(delta) and math.isfinite(float(delta)) and float(delta) >= 0):
        raise SweepError(f"{flag}: δ {delta!r} is the paper's effect size in nats; give a number >= 0")
    if claim == "on_par" and not (delta and float(delta) > 0):
        raise SweepError(f"{flag}: on_par needs its margin, a δ > 0: on par within ±δ of the baseline")
    if claim == "none" and delta is not None and float(delta) != 0:
        raise SweepError(f"{flag}: claim none tests no effect, so δ {delta} says nothing; leave it out")
    return (None if claim == "none" else claim), float(delta or 0)


def claim_for(point: dict, claims: list | None) -> tuple[str | None, float]:
    """The claim and δ a point is tested for: the last of `claims`, [(point values, claim, δ), ...] (the values {}
    match every point), whose values the point has; (None, 0.0), a description, when none does."""
    return next(((claim, delta) for values, claim, delta in reversed(claims or []) if matches(point, values)),
                (None, 0.0))


def verdict_columns(v: dict) -> dict:
    """The columns a table prints of one comparison: the verdict (the word and why), claim, δ, Δ with its 95%
    interval, mde, n (seeds per arm), p, and what an inconclusive one would take."""
    if "claim" not in v:  # no verdict: trained at no rate, or another setup
        return {"verdict": v["verdict"]}
    return {"verdict": verdict_text(v), "claim": v["claim"] or "none", "delta": v["delta"] if v["claim"] else None,
            "diff": v["diff"], "ci": v["ci"], "mde": v["mde"], "n_seeds": v["n"], "p": v["p"],
            "p_holm": v.get("p_holm"), "seeds_needed": v["seeds_needed"], "diverged_runs": v["diverged"]}


def add_verdicts(tests: list[tuple[dict, dict]]) -> None:
    """Fill each (row, comparison) of one table with the comparison's columns, Holm-corrected over the table."""
    corrected = correct_family([v for _, v in tests])
    for (row, _), v in zip(tests, corrected, strict=True):
        row.update(verdict_columns(v))


def compared(point: dict, base: dict, claim: str | None, delta: float = 0.0) -> dict:
    """The verdict of one point against the baseline point (each a row of an lr table: best_lr, seed_losses at it
    over held-out seeds, grid_shortfall), or {"verdict": "no verdict: ..."} for a point that trained at no rate."""
    if point["best_lr"] is None:
        return {"verdict": "no verdict: trained at no rate (every rate diverged or crashed on the selection seeds)"}
    if base["best_lr"] is None:
        return {"verdict": "no verdict: the baseline trained at no rate"}
    return lr_verdict(point["seed_losses"], base["seed_losses"], claim, delta,
                      [point["grid_shortfall"], base["grid_shortfall"]])


def lr_table(rows: list[dict], choice: list[dict], keys: list[str], lr_key: str, baseline: dict | None,
             claims: list | None = None, select_seeds: list[int] = ()) -> list[dict]:
    """One row per grid point: best rate, mean ± std (n) of the final val loss at it over the held-out seeds
    (every seed but `select_seeds`), and, given a baseline point, the verdict rule against it for each point's
    claim and δ (claim_for(point, claims); lr_verdict: inconclusive when a grid is too short or a best rate on its
    edge), Holm-corrected over the table. A point that trained at no rate says so in place of a verdict."""
    def runs_of(c: dict) -> list[dict]:
        return [r for r in rows if matches(r, {k: c[k] for k in keys})]

    def seeds_at_best(c: dict) -> dict[int, float]:
        return {r["seed"]: final_loss(r) for r in runs_of(c) if c["best_lr"] is not None
                and str(r[lr_key]) == str(c["best_lr"]) and r["seed"] not in select_seeds}

    def shortfall(c: dict) -> str | None:
        return grid_shortfall(first_seed_runs(runs_of(c), lr_key), lr_key, c["best_lr"])

    base = next((c for c in choice if baseline and matches(c, baseline)), None)
    base_losses = seeds_at_best(base) if base else {}
    table, tests = [], []
    for c in choice:
        losses = seeds_at_best(c)
        finite = [x for x in losses.values() if math.isfinite(x)]
        text = "-" if not finite else f"{statistics.fmean(finite):.4f}" + (
            f" ± {statistics.stdev(finite):.4f}" if len(finite) > 1 else "") + f" (n={len(finite)})"
        row = {**{k: c[k] for k in keys}, "best_lr": c["best_lr"], "val_loss_mean_std": text,
               "val_loss_mean": statistics.fmean(finite) if finite else None, "seed_losses": losses,
               "diverged_lrs": ",".join(c["diverged_lrs"]) or None, "crashed_lrs": ",".join(c["crashed_lrs"]) or None,
               "lr_sensitivity": c["lr_sensitivity"], "edge_warning": point_warnings(c["edge_warning"], losses),
               "grid_shortfall": shortfall(c)}
        if base is not None and c is not base:
            tests.append((row, compared(row, {"best_lr": base["best_lr"], "seed_losses": base_losses,
                                              "grid_shortfall": shortfall(base)}, *claim_for(row, claims))))
        table.append(row)
    add_verdicts(tests)
    return table


def write_lr_summary(out_root: str, rows: list[dict], table: list[dict], keys: list[str], lr_key: str,
                     extra: list[str], title: str, recorded: dict, note: str | None = None) -> None:
    """Print the run table and the per-point table (and the note under them); write both to out_root/summary.md and
    summary.json, with `recorded` (the sweep's setup, its settings, the keys it sweeps and its data: what
    --leaderboard compares)."""
    run_columns = [*keys, lr_key, "seed", "train_loss", "val_loss", *extra, "diverged_at", "exit_code", "wall_s",
                   "ms_per_iter"]
    point_columns = [*keys, "best_lr", "val_loss_mean_std", "diverged_lrs", "crashed_lrs", "lr_sensitivity",
                     *(VERDICT_COLUMNS if any("verdict" in r for r in table) else []), "edge_warning"]
    cpu_s = sum(r["wall_s"] or 0.0 for r in rows)
    text = "\n\n".join([format_table(rows, run_columns), format_table(table, point_columns),
                        f"{len(rows)} runs, {cpu_s / 60:.1f} min of run time in all.", *([note] if note else [])])
    print("\n" + text)
    write_summary_files(out_root, title, text,
                        {**recorded, "lr_key": lr_key, "keys": keys, "runs": rows, "lr_points": table})


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
    """{seed: out_dir} of one --lr_grid sweep point's runs at its best rate on the held-out seeds (from
    root/summary.json): a selection seed's run, which picked the rate, is left out."""
    summary = read_json(os.path.join(root, "summary.json"))
    keys, lr_key = summary.get("keys", []), summary.get("lr_key", "learning_rate")
    best = [p["best_lr"] for p in summary.get("lr_points", []) if all(str(p[k]) == str(point.get(k)) for k in keys)]
    if not best:
        raise SweepError(f"{point} is no point of the --lr_grid sweep in {root}")
    runs = [r for r in summary["runs"] if matches(r, point)]
    picked = selection_seeds(summary, runs)
    return {r["seed"]: r["out_dir"] for r in runs if matches(r, {lr_key: best[0]}) and r["seed"] not in picked}


LR_POINT_FIELDS = ("best_lr", "seed_losses", "val_loss_mean")
RUN_FIELDS = ("seed", "val_loss", "diverged_at", "exit_code")


def read_lr_summary(root: str) -> dict:
    """root/summary.json of a --lr_grid sweep, checked for what the leaderboard and plot.py read from it."""
    path = os.path.join(root, "summary.json")
    if not os.path.exists(path):
        raise SweepError(f"{root} has no summary.json; pass the --out_root of a sweep.py --lr_grid run")
    summary = read_json(path)
    if "lr_points" not in summary:  # read_json returns an object or raises
        raise SweepError(f"{root} is a sweep without --lr_grid (its summary.json has no lr_points); "
                         "pass the --out_root of a sweep.py --lr_grid run")
    summary.setdefault("lr_key", "learning_rate")
    keys, points, runs = summary.get("keys"), summary["lr_points"], summary.get("runs")
    fields = ([*keys, *LR_POINT_FIELDS], [*keys, summary["lr_key"], *RUN_FIELDS]) if isinstance(keys, list) else ()
    if not (fields and isinstance(points, list) and points and isinstance(runs, list)
            and all(isinstance(p, dict) and all(f in p for f in fields[0]) and isinstance(p["seed_losses"], dict)
                    for p in points)
            and all(isinstance(r, dict) and all(f in r for f in fields[1]) for r in runs)):
        raise SweepError(f"{path} is incomplete (no points, or a point or run without the fields a --lr_grid "
                         "sweep writes); run the sweep's command again to rewrite it")
    wrong = summary_type_error(summary)
    if wrong:
        raise SweepError(f"{path}: {wrong}, not what a --lr_grid sweep writes (edited by hand?); run the sweep's "
                         "command again to rewrite it")
    stale = summary_mismatch(root, summary)
    if stale:
        raise SweepError(f"{path} does not agree with its runs ({stale}): it was edited, or runs changed since it "
                         "was written; run the sweep's command again to rewrite it")
    return summary


def summary_mismatch(root: str, summary: dict) -> str | None:
    """Where an lr summary disagrees with itself or its runs, or None: each point's seed_losses must be its runs'
    final losses at its best rate (on the held-out seeds, where the summary names its selection seeds), and each
    run's final val loss what its metrics.jsonl ends with. A run is looked for in root under its folder's name
    (the sweep may have been moved since), and checked if it is there: a summary may travel without its runs."""
    keys, lr_key = summary["keys"], summary["lr_key"]
    picked = set(summary.get("select_seeds", []))
    for p in summary["lr_points"]:
        at_best = {**{k: p[k] for k in keys}, lr_key: p["best_lr"]}
        runs = {str(r["seed"]): final_loss(r) for r in summary["runs"]
                if p["best_lr"] is not None and matches(r, at_best) and r["seed"] not in picked}
        stored = {str(s): math.inf if v is None else v for s, v in p["seed_losses"].items()}
        if stored != runs:
            return f"point {at_best}: seed_losses {p['seed_losses']}, its runs' final losses {runs}"
    for r in summary["runs"]:
        if not isinstance(r.get("out_dir"), str):
            continue
        out_dir = os.path.join(root, os.path.basename(os.path.normpath(r["out_dir"])))
        last = r.get("final_iter") if isinstance(r.get("final_iter"), int) else math.inf  # older summaries: none
        evals = [m for m in load_metrics(out_dir) if m.get("kind") == "eval" and m["iter"] <= last]
        if evals and evals[-1].get("val_loss") != r["val_loss"]:
            return f"{out_dir}: final val loss {r['val_loss']}, its metrics.jsonl {evals[-1].get('val_loss')}"
    return None


def summary_type_error(summary: dict) -> str | None:
    """The first value of an lr summary's points and runs whose type the leaderboard cannot read; None if none."""
    def number(x: object) -> bool:
        return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))

    def rate(x: object) -> bool:
        return x is not None and is_positive_number(str(x))

    lr_key = summary["lr_key"]
    for p in summary["lr_points"]:
        if not (p["best_lr"] is None or rate(p["best_lr"])):
            return f"best_lr {p['best_lr']!r} is not a learning rate"
        if not number(p["val_loss_mean"]):
            return f"val_loss_mean {p['val_loss_mean']!r} is not a number"
        if not all(str(k).isdigit() and number(v) for k, v in p["seed_losses"].items()):
            return f"seed_losses {p['seed_losses']!r} is not {{seed: loss}}"
    for r in summary["runs"]:
        if not (isinstance(r["seed"], int) and rate(r[lr_key]) and number(r["val_loss"]) and number(r.get("wall_s"))
                and all(r[k] is None or isinstance(r[k], int) for k in ("diverged_at", "exit_code"))):
            return f"the run {r.get('out_dir', r)} has a seed, {lr_key}, loss, time or exit code of the wrong type"
    for key, kind in (("setup", dict), ("settings", dict), ("swept", list), ("select_seeds", list),
                      ("data_fingerprint", dict)):
        if not isinstance(summary.get(key, kind()), kind):
            return f"{key} is not a {kind.__name__}"
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in summary.get("select_seeds", [])):
        return f"select_seeds {summary['select_seeds']!r} is not a list of seeds"
    if not all(isinstance(fp, dict) for fp in summary.get("data_fingerprint", {}).values()):
        return f"data_fingerprint {summary['data_fingerprint']!r} is not {{dataset: fingerprint}}"
    return None


def check_recorded_data(summaries: list[tuple[str, dict]]) -> None:
    """Refuse to put sweeps trained on different data (their summaries' data_fingerprint: another dataset, or one
    of the same name prepared from other text) in one table or figure, naming the first two that differ. A summary
    written before summaries recorded the data is not checked, and a note says so."""
    recorded = [(root, s["data_fingerprint"]) for root, s in summaries if s.get("data_fingerprint")]
    for root, data in recorded[1:]:
        first, first_data = recorded[0]
        if data != first_data:
            raise SweepError(f"{first} and {root} were trained on different data ({data_difference(first_data, data)})"
                             ": their losses are not comparable; compare sweeps on one dataset, prepared from the "
                             "same text")
    unrecorded = [root for root, s in summaries if not s.get("data_fingerprint")]
    if recorded and unrecorded:
        print(f"note: {', '.join(unrecorded)} record no data fingerprint (summaries written before they did); "
              "their data is not checked against the others'")


def data_difference(a: dict, b: dict) -> str:
    """How two summaries' recorded data differ: the datasets they name, or how one dataset's fingerprint changed."""
    if set(a) != set(b):
        return f"{', '.join(a)} against {', '.join(b)}"
    return "; ".join(f"{name}: {', '.join(fingerprint_changes(a[name], b[name]) or ['other keys'])}"
                     for name in a if a[name] != b[name])


def setup_difference(summary: dict, base: dict) -> str | None:
    """How one sweep's recorded setup and fixed settings differ from the baseline sweep's, over what both
    record and neither sweeps (grid keys, rates); None if they agree."""
    def recorded(s: dict) -> dict:  # a scheme's column overrides count key by key, like any other setting
        both = {**s.get("setup", {}), **s.get("settings", {})}
        return {**{k: v for k, v in both.items() if k != "overrides"}, **(both.get("overrides") or {})}

    swept = {*summary.get("swept", summary["keys"]), *base.get("swept", base["keys"])}
    mine, theirs = recorded(summary), recorded(base)
    differ = [f"{k} {mine[k]} here, {theirs[k]} in the baseline's" for k in mine
              if k in theirs and k not in (*swept, "seeds", "data_dir") and mine[k] != theirs[k]]
    return ", ".join(differ) or None


def leaderboard(roots: list[str], baseline: dict | None = None, claims: list | None = None) -> list[dict]:
    """One table over the per-point tables of several --lr_grid sweeps (their summary.json): every point at
    its own best rate, sorted by mean final val loss, with the verdict rule against the baseline point (the
    first root's, if several match; `compared`, as in each sweep's own table) for each point's claim and δ
    (claim_for(point, claims); no claims: a description of each row, not a verdict), Holm-corrected over the
    table, on held-out seeds only (a seed that picked a rate never counts, see selection_seeds). A point of a
    sweep whose recorded setup or fixed settings differ from the baseline's gets no verdict, and the row says what
    differs. Points with the same settings in two roots are told apart by the root; a root given twice (another
    spelling of one folder) is read once."""
    points = []
    summaries = [(root, read_lr_summary(root)) for root in distinct_folders(roots)]
    check_recorded_data(summaries)
    for root, summary in summaries:
        keys, lr_key = summary["keys"], summary["lr_key"]
        for point in summary["lr_points"]:
            runs = [r for r in summary["runs"] if matches(r, {k: point[k] for k in keys})]
            label = ", ".join(f"{k}={point[k]}" for k in keys) or os.path.basename(os.path.normpath(root))
            first = first_seed_runs(runs, lr_key)
            picked = selection_seeds(summary, runs)
            points.append({**point, "label": label, "root": root, "summary": summary, "lr_key": lr_key,
                           "seed_losses": {int(s): v for s, v in point["seed_losses"].items() if int(s) not in picked},
                           "first_runs": first, "grid_shortfall": grid_shortfall(first, lr_key, point["best_lr"]),
                           "run_minutes": sum(r.get("wall_s") or 0.0 for r in runs) / 60})
    # the sensitivity depends on the grid: every arm's over the rates all of them ran
    shared = set.intersection(*({float(r[p["lr_key"]]) for r in p["first_runs"]} for p in points)) if points else set()
    over = ", ".join(f"{x:g}" for x in sorted(shared))
    labels = [p["label"] for p in points]
    for p in points:
        if labels.count(p["label"]) > 1:
            p["label"] += f" ({os.path.basename(os.path.normpath(p['root']))})"
    base = next((p for p in points if baseline and matches(p, baseline)), None)
    if baseline and base is None:
        raise SweepError(f"--baseline {baseline} is none of the sweeps' points")
    check_claimed_rows(points, claims)
    table, tests = [], []
    for p in sorted(points, key=lambda p: (p["val_loss_mean"] is None, p["val_loss_mean"] or 0.0)):
        row = {"label": p["label"], "best_lr": p["best_lr"], "val_loss_mean_std": p.get("val_loss_mean_std"),
               "diverged_lrs": p.get("diverged_lrs"), "edge_warning": p.get("edge_warning"),  # point_warnings' already
               "lr_sensitivity": lr_sensitivity(p["first_runs"], p["lr_key"], shared),
               "lr_sensitivity_rates": over, "run_minutes": p["run_minutes"]}
        if base is not None and p is not base:
            differ = setup_difference(p["summary"], base["summary"])
            if differ:
                row["verdict"] = f"no verdict: another setup ({differ})"
            else:
                tests.append((row, compared(p, base, *claim_for(p, claims))))
        table.append(row)
    add_verdicts(tests)
    return table


def check_claimed_rows(points: list[dict], claims: list | None) -> None:
    """Refuse a --row_claim that names no row of the leaderboard (a mistyped value would leave its row described,
    not judged), listing the rows there are."""
    for values, _, _ in (claims or [])[1:]:
        if values and not any(matches(p, values) for p in points):
            rows = "; ".join(dict.fromkeys(", ".join(f"{k}={p[k]}" for k in p["summary"]["keys"]) for p in points))
            named = ",".join(f"{k}={v}" for k, v in values.items())
            raise SweepError(f"--row_claim {named} matches no row of the leaderboard; its rows are: {rows}")


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
                        "runs every rate on the selection seeds and the held-out --seeds at its best rate")
    parser.add_argument("--lr_keys", default="learning_rate", metavar="KEY1+KEY2",
                        help="the rate(s) --lr_grid sets: the first takes the grid's values, the others keep their "
                        "ratio to it from the config (e.g. matrix_lr+learning_rate for muon); min_lr follows "
                        "learning_rate unless set (default: learning_rate)")
    parser.add_argument("--select_seeds", metavar="S1,S2,...",
                        help="with --lr_grid: the seeds that run every rate and pick each point's best (on their mean "
                        "final val loss; a rate that diverged on one ranks last); they never enter a verdict "
                        "(default: one seed not in --seeds, the smallest whole number)")
    parser.add_argument("--lr_seeds", type=int, metavar="N", help="replaced by --select_seeds (refused)")
    parser.add_argument("--claim", choices=("lower", "higher", "on_par", "none"), default="none",
                        help="with --baseline: what the paper claims of each point's final val loss against the "
                        "baseline's: lower or higher by --delta, on_par within ±--delta, or none (default: a "
                        "description, lower / higher / not distinguishable, never a verdict word)")
    parser.add_argument("--delta", metavar="NATS", help="the paper's effect size for --claim, in the loss's units "
                        "(from its table; default 0), or the margin of an on_par claim (needed)")
    parser.add_argument("--row_claim", action="extend", nargs="+", default=[], metavar="POINT:CLAIM[:DELTA]",
                        help="a point's own claim and δ over --claim's (repeatable), e.g. "
                        "norm_scheme=geonorm:lower:0.05 norm_scheme=post:none; a row whose paper makes no claim "
                        "against the baseline gets none")
    parser.add_argument("--rerun", action="store_true", help="run finished runs again, from scratch")
    parser.add_argument("--dry_run", action="store_true", help="print the train.py commands and stop")
    args = parser.parse_args(argv)
    with forwarding_stop_signals():
        return run_command(args)


def parse_claims(args: argparse.Namespace) -> list[tuple[dict, str | None, float]]:
    """The claims of --claim/--delta (every point) and --row_claim (a point's own), as claim_for reads them;
    refused without the --baseline they are claims against."""
    given = args.claim != "none" or args.delta is not None or args.row_claim
    if given and not args.baseline:
        raise SweepError("--claim, --delta and --row_claim state what is claimed against --baseline; give "
                         "--baseline key=value")
    return [({}, *checked_claim(args.claim, args.delta)), *(parse_claim(c) for c in args.row_claim)]


def run_command(args: argparse.Namespace) -> int:
    """main() past the parsing: the exit code of what args ask for."""
    try:
        if args.lr_seeds is not None:
            raise SweepError("--lr_seeds is replaced by --select_seeds: the rate is picked on seeds that never enter "
                             "a verdict, e.g. --select_seeds 0 --seeds 1,2,3,4,5 (for --lr_seeds 2 --seeds 1,2,3: "
                             "--select_seeds 1,2 --seeds 3 and more held-out seeds)")
        claims = parse_claims(args)
        if args.leaderboard:
            table = leaderboard(args.leaderboard, parse_assignments(args.baseline, "--baseline") or None, claims)
            print(format_table(table, ["label", "best_lr", "val_loss_mean_std", *VERDICT_COLUMNS, "diverged_lrs",
                                       "lr_sensitivity", "run_minutes", "edge_warning"]))
            rates = table[0]["lr_sensitivity_rates"] if table else ""
            print(f"\nlr sensitivity over the rates every arm ran: {rates or 'none'}"
                  f"\n{sum(r['run_minutes'] for r in table):.1f} min of run time in all")
            return 0
        if args.config is None:
            raise SweepError("give a config file to sweep, or --leaderboard OUT_ROOT ...")
        grid = {k: distinct_values(v, f"--grid {k}") for k, v in parse_assignments(args.grid, "--grid").items()}
        baseline = parse_assignments(args.baseline, "--baseline")
        if any(k not in grid or v not in grid[k] for k, v in baseline.items()):
            raise SweepError(f"--baseline {' '.join(args.baseline)} is not in the grid {grid}")
        for values, _, _ in claims[1:]:
            if any(k not in grid or v not in grid[k] for k, v in values.items()):
                raise SweepError(f"--row_claim: {values} is not a point of the grid {grid}")
        if not os.path.isfile(args.config):
            raise SweepError(f"config file {args.config!r} not found (see configs/ for examples)")
        if args.jobs != "auto" and not (args.jobs.isdigit() and int(args.jobs) >= 1):
            raise SweepError(f"--jobs {args.jobs!r}: give auto or a number of runs at a time (at least 1)")
        if args.threads_per_run is not None and args.threads_per_run < 1:
            raise SweepError(f"--threads_per_run {args.threads_per_run}: give a number of threads of at least 1")
        if args.seeds and not all(s.isdigit() for s in args.seeds.split(",")):
            raise SweepError(f"--seeds {args.seeds!r}: give whole numbers separated by commas, e.g. 1,2,3")
        seeds = [int(s) for s in distinct_values(args.seeds, "--seeds")] if args.seeds else None
        if args.select_seeds and not (args.lr_grid and all(s.isdigit() for s in args.select_seeds.split(","))):
            raise SweepError(f"--select_seeds {args.select_seeds!r}: give whole numbers separated by commas, with "
                             "--lr_grid (they pick each point's learning rate)")
        select = [int(s) for s in distinct_values(args.select_seeds, "--select_seeds")] if args.select_seeds else None
        if select and seeds:
            check_held_out(select, seeds)
        out_root = args.out_root or os.path.join("out", "sweep_" + os.path.splitext(os.path.basename(args.config))[0])
        fixed, extra = parse_assignments(args.set, "--set"), [k for k in args.extra.split(",") if k]
        if both := {k for key in grid for k in key.split("+")} & {k for key in fixed for k in key.split("+")}:
            raise SweepError(f"{', '.join(sorted(both))} given by both --grid and --set; give each key once")
        if seeds and "seed" in {k for key in fixed for k in key.split("+")}:
            raise SweepError(f"--set seed={fixed.get('seed', '...')} and --seeds {args.seeds} both give the seed, and "
                             "--seeds would win; give the seeds by --seeds alone")
        lr_keys, lr_values = args.lr_keys.split("+"), None
        if args.lr_grid:
            if len(set(lr_keys)) != len(lr_keys):
                raise SweepError(f"--lr_keys {args.lr_keys} names a key twice; give each rate once")
            if set(lr_keys) & {k for key in grid for k in key.split("+")}:
                raise SweepError(f"--lr_keys {args.lr_keys} are swept by --lr_grid; leave them out of --grid")
            if lr_keys[0] in {k for key in fixed for k in key.split("+")}:
                raise SweepError(f"--set {lr_keys[0]}: --lr_grid sets {lr_keys[0]} of every run, so this value would "
                                 "be dropped; leave it out of --set (the other --lr_keys and min_lr keep their ratio "
                                 "to it)")
            if "learning_rate" in lr_keys and "min_lr" in {k for key in grid for k in key.split("+")}:
                raise SweepError("--grid min_lr: with --lr_grid, min_lr keeps its config ratio to learning_rate "
                                 "at every rate, whatever --grid says; leave it out of --grid, or give one value "
                                 "for every run by --set min_lr=...")
            if not all(is_positive_number(v) for v in args.lr_grid.split(",")):
                raise SweepError(f"--lr_grid {args.lr_grid!r}: give positive numbers separated by commas")
            lr_values = distinct_values(args.lr_grid, "--lr_grid")
        # one sweep at a time writes an out_root: its runs' logs and run.json files, its summary
        with contextlib.nullcontext() if args.dry_run else OutDirLock(out_root, "--out_root", "sweep"):
            if lr_values:
                table = run_lr_sweep(args.config, grid, lr_values, lr_keys, seeds, fixed, out_root, args.jobs,
                                     args.threads_per_run, args.rerun, baseline or None, claims, args.dry_run,
                                     extra, select)
                return int(any(row["crashed_lrs"] for row in table))
            rows = run_sweep(args.config, grid, seeds, fixed, out_root, args.jobs, args.threads_per_run, args.rerun,
                             baseline or None, args.dry_run, extra)
    except (SweepError, ConfigError, RunFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LaunchFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # a reader that has gone (`| head`): exit_with ends it quietly
        raise
    except OSError as e:  # a summary or a run's file that cannot be written (a full disk) or read
        print(f"error: {error_text(e)}; every run's files are kept: fix the cause and run the same command again "
              "(finished runs are skipped)", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        with contextlib.suppress(OSError):  # a terminal that has gone (SIGHUP) takes no message
            print("interrupted: run the same command to continue the sweep", file=sys.stderr)
        return 128 + e.signum if isinstance(e, Interrupted) else 130
    return int(any(crashed(r) for r in rows))


if __name__ == "__main__":
    exit_with(main)

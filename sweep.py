"""
Run a grid of train.py runs, then print and save a table of the runs and one over seeds.

    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm,post --seeds 1,2,3
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm --grid learning_rate=1e-3,2e-3 \\
        --set max_iters=200 --set lr_decay_iters=200 --out_root out/lr_sweep --baseline norm_scheme=pre
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm --dry_run   # print the commands
    python sweep.py configs/icl_small_lipschitz_muon.py --grid learning_rate+matrix_lr=1e-3,1e-2   # tied keys
    python plot.py out/lr_sweep/*/ --metric loss,val_loss                           # draw the runs
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,post,geonorm --lr_grid 3e-4,1e-3,3e-3,1e-2,3e-2 \\
        --select_seeds 0,6,7 --seeds 1,2,3,4,5 --claims claims/depth.json --out_root out/lr \\
        --results results/cpu_base                                      # each scheme at its own best rate
    python plot.py --tables results/ --out tables/         # every table and figure again, from results/ alone
    python plot.py --lr_sweep out/lr                                     # final loss against learning rate
    python sweep.py configs/cpu_base.py --grid norm_scheme=pre,geonorm --seeds 1,2 --gpus 0,1 --runs_per_gpu 2
    python sweep.py configs/geonorm_125m.py --grid norm_scheme=pre,geonorm --gpus all --gpus_per_run 4   # torchrun
    python sweep.py configs/geonorm_125m.py --grid norm_scheme=pre,geonorm --executor slurm --slurm_partition gpu

What each flag does, the protocol (selection seeds, refinement, held-out seeds), the verdict rule and its words,
claims files, results files, devices and executors, what a continued sweep skips, resumes or refuses, and the exit
codes (0 finished or diverged, 1 a run crashed or could not be launched, 2 bad input, 4 budget spent, 130/143/129
a stop signal, passed on to the running runs, which save): docs/comparing.md.
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
from nanonorm.budget import BUDGET_EXIT, plan_text
from nanonorm.claims import (
    MECHANISM,
    Claims,
    ClaimsError,
    check_fixed_before_runs,
    committed_state,
    read_claims,
)
from nanonorm.launch import (
    EXECUTORS,
    Launcher,
    LaunchError,
    TrainJob,
    device_env,
    device_text,
    gpu_groups,
    parse_gpus,
    run_jobs,
    slurm_parameters,
)
from nanonorm.lr_table import (
    METRICS,
    VERDICT_COLUMNS,
    add_verdicts,
    as_claims,
    comparison,
    crashed,
    final_loss,
    first_seed_runs,
    format_table,
    grid_shortfall,
    held_out_losses,
    lr_sensitivity,
    lr_table,
    matches,
    pick_best,
    point_table_text,
)
from nanonorm.results import ResultsError, study_tables, write_results
from nanonorm.resume import data_fingerprint, fingerprint_changes
from nanonorm.run_files import (
    CHECKPOINT_NAME,
    LAST_CHECKPOINT_NAME,
    LOCK_NAME,
    OutDirInUse,
    OutDirLock,
    code_version,
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
from nanonorm.selection import (
    MIN_SELECT_SEEDS,
    HeldOutError,
    default_select_seeds,
    record_selection_seeds,
    recorded_selection_seeds,
    refined_rates,
    unigram_loss,
)
from nanonorm.selection import check_held_out as check_selection_record
from nanonorm.train_config import ConfigError, TrainConfig, exit_with, explicit_settings
from nanonorm.verdict import MIN_RATES, scale_text
from nanonorm.verdict import verdict as verdict  # sweep.verdict: the rule, where tests and docs call it

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
OUTCOMES = {0: "finished", 1: "crashed", 2: "bad config", 3: "diverged", 4: "stopped with a save (it resumes)",
            5: "its folder was replaced", 6: "no space left: it resumes"}  # train.py's codes (docs/run_files.md)
NO_VERDICT = ("no verdict: a grid without --lr_grid runs every arm at one learning rate, which is not a comparison "
              "(README, Comparing runs); --lr_grid runs each arm at its own best rate and gives the verdict rule's "
              "word")
JOBS_HELP = """runs at a time: N, or auto = max(1, cores // threads_per_run). Each run gets OMP_NUM_THREADS=
threads_per_run, by default all cores, so auto runs one at a time: torch already spreads a run's matmuls over
every core, and runs sharing cores gain little while their ms/iter measures the contention, not the model.
With --jobs N alone, each run gets cores // N threads."""


RESUME_FLAGS = ("init_from", "overwrite")  # what sweep.py adds to a command to resume or redo a run
# where a run writes, how it starts, logs and runs, not what it trains
BOOKKEEPING_KEYS = ("out_dir", *RESUME_FLAGS, "wandb_project", "wandb_group", "deterministic")


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


def cpu_launcher(jobs: str | int = "auto", threads_per_run: int | None = None, executor: str = "process") -> Launcher:
    """Runs on this machine's cores (parallelism), started by `executor`."""
    return Launcher(*parallelism(jobs, threads_per_run), executor=executor)


def gpu_launcher(gpus: list[int], runs_per_gpu: int, gpus_per_run: int, jobs: str, threads_per_run: int | None,
                 executor: str = "process") -> Launcher:
    """Runs on groups of gpus_per_run GPUs, runs_per_gpu at a time on each group: as many workers as slots (fewer
    with --jobs N), and the cores shared among them."""
    groups = gpu_groups(gpus, gpus_per_run)
    slots = len(groups) * runs_per_gpu
    if jobs != "auto" and int(jobs) > slots:
        raise SweepError(f"--jobs {jobs}: more runs at a time than the {slots} GPU slot(s) of --gpus and "
                         "--runs_per_gpu; give --jobs auto, or more --runs_per_gpu")
    workers = slots if jobs == "auto" else int(jobs)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Launcher(workers, threads_per_run or max(1, cores // workers), groups, runs_per_gpu, gpus_per_run,
                    executor)


class Interrupted(KeyboardInterrupt):
    """A stop signal reached the sweep: it stops as Ctrl-C stops it, with the signal's exit code (128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class NotStarted(Exception):
    """A run the sweep did not start, as an earlier one could not be launched or recorded, or the budget ran out."""


class BudgetSpent(Exception):
    """--budget ran out: the running runs saved and stopped, nothing more started; the same command continues."""

    def __init__(self, budget: float, left: int):
        super().__init__(f"the budget of {budget:g} s is spent with {left} run{'s' * (left != 1)} of this phase left "
                         "(stopped runs saved their last iteration): run the same command to continue")


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
        self.budget: float | None = None  # --budget: seconds this call may run runs for
        self.deadline: float | None = None  # when it ends (time.monotonic)
        self.expired = False  # it has: the runs got SIGTERM, and none starts

    def check_running(self) -> None:
        """Interrupted if the sweep is stopping, NotStarted after a failed launch or past the budget: nothing more
        starts."""
        if self.stopping is not None:
            raise Interrupted(self.stopping)
        if self.halted or self.expired:
            raise NotStarted

    def set_budget(self, seconds: float | None) -> None:
        """Give this call `seconds` of run time from now (None: no limit)."""
        self.budget, self.deadline = seconds, None if seconds is None else time.monotonic() + seconds
        self.expired = False

    def expire(self) -> None:
        """The budget has run out: start nothing more, and stop the running runs with a save (SIGTERM: train.py saves
        its last iteration and exits 4; the next call resumes it)."""
        with self._lock:
            self.expired = True
            running = list(self._running)
        for process in running:
            process.send_signal(signal.SIGTERM)

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
            self.stopping, self.halted = None, False  # the budget goes on: set_budget sets it


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


def launch(job: dict, threads: int, launcher: Launcher | None = None,
           devices: contextlib.AbstractContextManager | None = None) -> dict:
    """Run one job to its end (with OMP_NUM_THREADS=threads; on a slot of `devices`, the GPUs it gets, started as
    `launcher` says: default python train.py): output to out_dir/train.log; exit code, wall time (summed over
    resumptions), the run's resolved settings, its GPUs and launcher and the code's commit to out_dir/run.json. A
    sweep stopping starts no run (Interrupted). An OSError launching it or writing its run.json is returned as its
    "error", and no run starts after it ({"not_started": True})."""
    try:
        with devices or contextlib.nullcontext() as gpus:
            info = run_to_end(job, launcher or Launcher(1, threads), gpus)
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


def run_to_end(job: dict, launcher: Launcher, gpus: tuple[int, ...] | None) -> dict:
    """Start one job's train.py (on `gpus`, through launcher's command) and wait for it; what its run.json records."""
    CHILDREN.check_running()
    os.makedirs(job["out_dir"], exist_ok=True)
    env = {**os.environ, **run_environment(launcher, gpus)}
    say(f"start {job['out_dir']}" + (" (resume)" if job["state"] == "resume" else "") + placed_on(gpus))
    before = read_run_info(job["out_dir"]).get("wall_s", 0.0) if job["state"] == "resume" else 0.0
    start = time.perf_counter()
    with open(os.path.join(job["out_dir"], "train.log"), "a" if job["state"] == "resume" else "w") as log:
        process = CHILDREN.start(launcher.command(TRAIN, job["argv"]), stdout=log, stderr=subprocess.STDOUT, env=env)
        code = CHILDREN.wait(process)
    return {**run_record(job, launcher, gpus), "exit_code": code, "wall_s": before + time.perf_counter() - start}


def run_environment(launcher: Launcher, gpus: tuple[int, ...] | None) -> dict[str, str]:
    """What a run's environment adds: its threads, unbuffered output, and its GPUs (CUDA_VISIBLE_DEVICES)."""
    threads = {"OMP_NUM_THREADS": str(launcher.threads)} if launcher.threads else {}  # 0: the node's (SLURM)
    return {**threads, "PYTHONUNBUFFERED": "1", **device_env(gpus)}


def placed_on(gpus: tuple[int, ...] | None) -> str:
    return f" on {device_text(gpus)}" if gpus else ""


def run_record(job: dict, launcher: Launcher, gpus: tuple[int, ...] | None) -> dict:
    """What run.json records of a run beside its exit code and wall time: the commit is the launch's that finished
    it, when a run resumed; gpus are the CUDA devices it was given (null: it saw the machine's)."""
    return {"point": job["point"], "argv": job["argv"], "threads": launcher.threads, "settings": job["settings"],
            "gpus": list(gpus) if gpus else None, "launcher": launcher.launcher_text(), "commit": code_version()}


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
    (the rule run_state skips it by), time, its iteration-0 val loss, the commit that ran it, the `extra`
    metrics of its last evaluation that logged them (e.g. val_xy_loss, grad_kurtosis), and the per-block mechanism
    diagnostics (MECHANISM) of its last evaluation that logged them (None without log_diagnostics)."""
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
                     **{m: evals[-1].get(m) if evals else None for m in METRICS},
                     "diverged_at": diverged_at(records), "exit_code": info.get("exit_code"),
                     "reached_max_iters": bool(max_iters) and reached_max_iters(records, max_iters[i]),
                     "wall_s": info.get("wall_s"), "ms_per_iter": statistics.median(ms) if ms else None,
                     **{f"initial_{m}": next((r.get(m) for r in evals if r["iter"] == 0), None) for m in METRICS},
                     "commit": info.get("commit"),
                     **{key: next((r[key] for r in reversed(evals) if isinstance(r.get(key), (int, float))), None)
                        for key in extra or []},
                     **{key: next((r[key] for r in reversed(evals) if isinstance(r.get(key), list)), None)
                        for key in MECHANISM}})
    return rows


def aggregate(rows: list[dict], keys: list[str], baseline: dict | None = None, metric: str = "val_loss") -> list[dict]:
    """One row per grid point over its seeds, the mean ± std of the final `metric`. ms/iter is relative to the point
    that has the baseline's values on the baseline's keys and this point's on the others (default: the first)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(str(row.get(k)) for k in keys), []).append(row)
    ms = {values: [r["ms_per_iter"] for r in group if r["ms_per_iter"] is not None] for values, group in groups.items()}
    if not groups:
        return []
    baseline = baseline or dict(zip(keys, next(iter(groups)), strict=True))
    out = []
    for values, group in groups.items():
        ok = [x for r in group if math.isfinite(x := final_loss(r, metric))]
        mean = statistics.fmean(ok) if ok else None
        std = statistics.stdev(ok) if len(ok) > 1 else None
        text = "-" if mean is None else f"{mean:.4f}" + (f" ± {std:.4f}" if std is not None else "")
        ref = ms.get(tuple(str(baseline.get(k, v)) for k, v in zip(keys, values, strict=True)))
        rel = statistics.fmean(ms[values]) / statistics.fmean(ref) if ms[values] and ref else None
        diverged = sum(r["diverged_at"] is not None for r in group)
        out.append({**dict(zip(keys, values, strict=True)), "runs": len(group), "val_loss_mean_std": text,
                    "val_loss_mean": mean, "val_loss_std": std, "diverged": diverged, "ms_vs_baseline": rel})
    return out


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


def execute(pending: list[dict], workers: int, threads: int, launcher: Launcher | None = None,
            out_root: str = "out/sweep") -> None:
    """Run the jobs, `workers` at a time (each on a free slot of launcher's GPUs, if it has any), printing each
    outcome as it comes; through submitit when launcher.executor says so (execute_jobs). A run folder in use by
    another process stops the sweep (SweepError) before any job starts; a stop signal starts nothing more. A run
    that cannot be launched or recorded (an OSError) is reported in its line, nothing starts after it, and
    LaunchFailed is raised once the running runs have ended."""
    if launcher is not None and launcher.executor != "process":
        return execute_jobs(pending, launcher, out_root)
    if busy := busy_runs(pending):
        raise SweepError(f"{', '.join(busy)}: in use by another process (its id is in the folder's {LOCK_NAME}); "
                         "wait for it to end or stop it, then run the same command again. Nothing was started")
    CHILDREN.reset()
    failures, left, done = [], set(), 0
    devices = launcher.pool() if launcher else None
    timer = budget_timer(pending)
    with ThreadPoolExecutor(workers) as pool:  # on GPUs, each run takes a slot; on the CPU, launch(job, threads)
        futures = {pool.submit(launch, job, threads, *((launcher, devices.slot()) if devices else ())): job
                   for job in pending}
        try:
            for future in as_completed(futures):
                job, info = futures[future], future.result()
                stopped = info.get("exit_code") in (BUDGET_EXIT, -signal.SIGTERM)  # saved, or stopped before it could
                if "error" in info or "not_started" in info or stopped and CHILDREN.expired:
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
        finally:
            if timer:
                timer.cancel()
    if CHILDREN.expired and not failures:
        raise BudgetSpent(CHILDREN.budget, len(left))
    if failures:
        raise LaunchFailed(failures, left)


def execute_jobs(pending: list[dict], launcher: Launcher, out_root: str) -> None:
    """execute() through submitit (nanonorm.launch.run_jobs): each run a job, its run.json written by the job; a run
    whose earlier SLURM job still holds it is waited for, one whose job ended before it did resumes in a new one."""
    if busy := busy_runs([job for job in pending if not os.path.exists(os.path.join(job["out_dir"], "job.json"))
                          or launcher.executor == "local"]):
        raise SweepError(f"{', '.join(busy)}: in use by another process (its id is in the folder's {LOCK_NAME}); "
                         "wait for it to end or stop it, then run the same command again. Nothing was started")
    CHILDREN.reset()
    done = 0

    def make_job(job: dict, gpus: tuple[int, ...] | None) -> TrainJob:
        return TrainJob(launcher.prefix(TRAIN), job["argv"], job["out_dir"], run_environment(launcher, gpus),
                        run_record(job, launcher, gpus))

    def report(job: dict, info: dict) -> None:
        nonlocal done
        done += 1
        say(f"[{done}/{len(pending)}] {run_name(job['point'])}: {outcome_text(job, info)}")

    def finished(job: dict) -> bool:
        return run_state(job["out_dir"], job["settings"]["max_iters"]) == "finished"

    run_jobs(pending, launcher, out_root, make_job, finished, report, lambda: CHILDREN.stopping is not None)
    if CHILDREN.stopping is not None:
        raise Interrupted(CHILDREN.stopping)


def budget_timer(pending: list[dict]) -> threading.Timer | None:
    """A timer that ends the budget (CHILDREN.expire) at its deadline, started now; None without a budget or jobs.
    Past the deadline already, it has ended."""
    if CHILDREN.deadline is None or not pending:
        return None
    left = CHILDREN.deadline - time.monotonic()
    if left <= 0:
        CHILDREN.expired = True
        return None
    timer = threading.Timer(left, CHILDREN.expire)
    timer.daemon = True
    timer.start()
    return timer


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
              extra: list[str] | None = None, metric: str = "val_loss", launcher: Launcher | None = None) -> list[dict]:
    """Run what is not finished (as `launcher` places the runs; default: on this machine's cores, by jobs and
    threads_per_run), then print and write the summary (the mean ± std of `metric`); returns summarize()'s rows."""
    todo = plan_runs(config, grid, seeds, fixed, out_root, rerun)
    launcher = launcher or cpu_launcher(jobs, threads_per_run)
    pending = [job for job in todo if job["state"] != "finished"]
    print(f"{len(todo)} runs, {len(pending)} to run, {launcher.describe()}")
    for job in todo:
        if job["state"] == "finished":
            print(f"skip {job['out_dir']}: finished (--rerun runs it again)")
    if dry_run:
        print("\n".join(launcher.dry_run_lines("train.py", [job["argv"] for job in pending])))
        return []
    data = data_fingerprints(todo)

    def finish(jobs: list[dict], note: str | None = None) -> list[dict]:
        check_run_data(jobs, data)
        rows = summarize_jobs(jobs, extra)
        notes = "\n\n".join(n for n in (NO_VERDICT if baseline else None, note) if n) or None
        write_summary(out_root, rows, aggregate(rows, list(grid), baseline, metric), list(grid), bool(seeds),
                      f"Sweep of {config} over {grid}, seeds {seeds or 'of the config'}", extra or [], notes,
                      {**recorded_data(data), "metric": metric})
        return rows

    try:
        execute(pending, launcher.workers, launcher.threads, launcher, out_root)
    except LaunchFailed as e:
        finish(e.kept(todo), e.note)
        raise
    return finish(todo)


def write_summary(out_root: str, rows: list[dict], points: list[dict], keys: list[str], seeds: bool, title: str,
                  extra: list[str] = (), note: str | None = None, recorded: dict | None = None):
    """Print the two tables (and the note under them) and write them to out_root/summary.md and summary.json, with
    `recorded` (the data the runs trained on, the metric the means are of)."""
    metric = (recorded or {}).get("metric", "val_loss")
    run_columns = [*keys, *(["seed"] if seeds else []), "train_loss", *dict.fromkeys(["val_loss", metric]), *extra,
                   "diverged_at", "exit_code", "wall_s", "ms_per_iter"]
    text = "\n\n".join([format_table(rows, run_columns),
                        format_table(points, [*keys, "runs", "val_loss_mean_std", "diverged", "ms_vs_baseline"],
                                     metric),
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






def run_lr_sweep(config: str, grid: dict[str, list], lr_values: list[str], lr_keys: list[str],
                 seeds: list[int] | None = None, fixed: dict | None = None, out_root: str = "out/sweep",
                 jobs: str | int = "auto", threads_per_run: int | None = None, rerun: bool = False,
                 baseline: dict | None = None, claims: Claims | list | None = None, dry_run: bool = False,
                 extra: list[str] | None = None, select_seeds: list[int] | None = None, refine: bool = True,
                 results: str | None = None, metric: str = "val_loss",
                 launcher: Launcher | None = None) -> list[dict]:
    """Each grid point at its own best learning rate, judged on seeds that did not pick it (docs/comparing.md): every
    rate runs on the selection seeds (`select_seeds`; default: selection.default_select_seeds, the folder's
    earlier selection seeds, else three not in `seeds`), each point's coarse pick (the lowest mean final val loss
    over them; a diverged run ranks its rate last) is refined by the two rates at ×√3 around it on the same seeds
    (`refine`), and the held-out `seeds` run at the finer grid's best only (the baseline's at its second-best
    too). The mean ± std and the verdicts against `baseline` (each point's claim from `claims`) use the held-out
    seeds alone. A seed that selected a rate in out_root before is refused as a held-out seed. `metric`: the final
    value every pick, mean and verdict is made on (val_loss, or val_bpb). Writes the summary,
    out_root/results.jsonl and, with `results`, a copy there (each recording the metric); returns one row per grid
    point. `launcher` places the runs (default: this machine's cores, by jobs and threads_per_run)."""
    fixed = dict(fixed or {})
    if not str(fixed.get("seed", 0)).isdigit():
        raise SweepError(f"--set seed={fixed['seed']}: give a whole number, or several with --seeds")
    seeds = seeds or [train.TrainConfig.seed if "seed" not in fixed else int(fixed.pop("seed"))]
    select = select_seeds or default_select_seeds(seeds, out_root)
    check_held_out(select, seeds)
    check_not_selected(out_root, seeds)
    lr_key, ratios = lr_ratios_of(config, fixed, lr_keys)
    launcher = launcher or cpu_launcher(jobs, threads_per_run)
    if baseline and (short := protocol_shortfall(lr_values, select)):
        print(f"note: {short}, so no word will be decisive")
    check_run_names(out_root, {**grid, lr_key: lr_values}, [*select, *seeds])  # the held-out runs' too, up front
    coarse = plan_runs(config, {**grid, lr_key: lr_values}, select, fixed, out_root, rerun, (lr_key, ratios))
    points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    context = sweep_context(coarse[0]["argv"], len(seeds)) if coarse else {}

    def picked(selection: list[dict]) -> tuple[list[dict], list[dict]]:  # the selection runs, each point's pick
        rows = summarize_jobs(selection, extra)
        return rows, [{**p, **pick_best([r for r in rows if matches(r, p)], lr_key, unigram=context.get("unigram"),
                                        metric=metric)} for p in points]

    def plan_at(point: dict, rates: list[str], on: list[int]) -> list[dict]:
        return plan_runs(config, {**{k: [v] for k, v in point.items()}, lr_key: rates}, on, fixed, out_root, rerun,
                         (lr_key, ratios))

    def refinement(selection: list[dict]) -> list[dict]:  # the rates at ×√3 around each point's coarse pick
        return [job for c, point in zip(picked(selection)[1], points, strict=True) if refine and c["best_lr"]
                for job in plan_at(point, refined_rates(c["best_lr"], lr_values), select)]

    def held_out(selection: list[dict]) -> list[dict]:  # each point at its best rate, the baseline's second too
        return [job for c, point in zip(picked(selection)[1], points, strict=True) if c["best_lr"] is not None
                for job in plan_at(point, held_out_rates(c, point, baseline), seeds)]

    if dry_run:
        print_plan(coarse, refinement, held_out,
                   len(points) * (len(seeds) + 2 * len(select) * refine) + len(seeds) * bool(baseline),
                   launcher.workers, launcher.threads)
        return []
    if isinstance(claims, Claims) and claims.path:
        check_fixed_before_runs(out_root, claims, any(os.path.isdir(job["out_dir"]) for job in coarse))
    record_selection_seeds(out_root, select)  # before any runs: a sweep stopped early keeps them out of verdicts
    data = data_fingerprints(coarse)

    def finish(selection: list[dict], held: list[dict], note: str | None = None) -> list[dict]:
        check_run_data(selection + held, data)
        selection_rows, choice = picked(selection)
        rows = selection_rows + summarize_jobs(held, extra)
        table = lr_table(rows, choice, list(grid), lr_key, baseline, claims, select, context.get("unigram"),
                         context.get("settings"), context.get("setup"), metric)
        recorded = {"select_seeds": select, "held_out_seeds": seeds, "refined": refine, **recorded_data(data),
                    "metric": metric,
                    **({"setup": context["setup"], "settings": context["settings"],
                        "unigram_loss": context["unigram"], "commit": code_version(),
                        "swept": [*(k for key in grid for k in key.split("+")), lr_key, *ratios]} if coarse else {}),
                    **({"baseline": baseline} if baseline else {}), **claims_record(claims)}
        title = (f"Learning-rate sweep of {config} over {grid}, {lr_key} in {lr_values}"
                 + (f" (scaling {', '.join(ratios)} with it)" if ratios else "")
                 + f", rates picked on seeds {select}" + (" and refined" if refine else "")
                 + f", held-out seeds {seeds}")
        write_lr_summary(out_root, rows, table, list(grid), lr_key, extra or [], title, recorded, note)
        write_results(out_root, results, {"title": title, "keys": list(grid), "lr_key": lr_key, "points": points,
                                          **recorded}, rows, list(grid), lr_key)
        return table

    fine: list[dict] = []
    held: list[dict] = []
    try:
        execute([job for job in coarse if job["state"] != "finished"], launcher.workers, launcher.threads, launcher,
                out_root)
        check_run_data(coarse, data)  # before more runs train on other data than picked their rates
        fine = refinement(coarse)
        execute([job for job in fine if job["state"] != "finished"], launcher.workers, launcher.threads, launcher,
                out_root)
        check_run_data(coarse + fine, data)
        held = held_out(coarse + fine)
        execute([job for job in held if job["state"] != "finished"], launcher.workers, launcher.threads, launcher,
                out_root)
    except LaunchFailed as e:
        finish(e.kept(coarse + fine), e.kept(held), e.note)
        raise
    return finish(coarse + fine, held)


def held_out_rates(choice: dict, point: dict, baseline: dict | None) -> list[str]:
    """The rates a point's held-out seeds run at: its best, and for the baseline its second-best too (every verdict
    is also judged against the baseline there)."""
    second = choice.get("second_lr") if baseline and matches(point, baseline) else None
    return [choice["best_lr"], *([second] if second is not None else [])]


def protocol_shortfall(lr_values: list[str], select: list[int]) -> str | None:
    """Why a sweep's plan cannot give a decisive word, whatever its runs show: too few rates or selection seeds."""
    why = [f"{len(lr_values)} rates (a verdict needs at least {MIN_RATES})" if len(lr_values) < MIN_RATES else None,
           f"{len(select)} selection seed{'s' * (len(select) != 1)} (a verdict needs {MIN_SELECT_SEEDS})"
           if len(select) < MIN_SELECT_SEEDS else None]
    return "; ".join(filter(None, why)) or None


def check_not_selected(out_root: str, seeds: list[int]) -> None:
    """selection.check_held_out as a SweepError: no seed that selected a rate in out_root is held out there."""
    try:
        check_selection_record(out_root, seeds)
    except HeldOutError as e:
        raise SweepError(str(e)) from None


def sweep_context(argv: list[str], n_seeds: int) -> dict:
    """What a sweep's table states beside its words and checks its picks by: its setup (the scale), its settings
    (what claims and other sweeps are matched on) and its data's unigram loss (a cliff's floor; None off the lm
    task or where the data is not prepared)."""
    cfg, _ = train.load_config(argv)
    unigram = unigram_loss(cfg.data_dir, cfg.dataset) if cfg.task == "lm" else None
    return {"setup": run_setup(argv, n_seeds), "settings": run_settings(argv), "unigram": unigram}


def claims_record(claims: Claims | list | None) -> dict:
    """What a summary and a results file record of the claims, so that the tables regenerate from the results
    alone: the claims file (its path, digest, whether it is committed, and its text), or the ad hoc claims."""
    claims = as_claims(claims)
    if claims.path:
        return {"claims": {"path": claims.path, "sha256": claims.sha256, "state": committed_state(claims.path),
                           "text": claims.text}}
    ad_hoc = [[c.row, c.claim, c.delta] for c in claims.claims if c.claim is not None]
    return {"ad_hoc_claims": [[c.row, c.claim, c.delta] for c in claims.claims]} if ad_hoc else {}


def finished_wall_times(jobs: list[dict]) -> list[float]:
    """The wall times (s) run.json records of the jobs' finished runs: what a plan estimates the rest by."""
    return [t for job in jobs if job["state"] == "finished"
            and isinstance(t := read_run_info(job["out_dir"]).get("wall_s"), (int, float))]


def print_plan(coarse: list[dict], refinement, held_out, later: int, workers: int, threads: int) -> None:
    """A dry run's plan: the runs of each phase (selection, refinement, held-out) and how many are left, each
    phase planned exactly once the one before it has run (`refinement`, `held_out`: its jobs from the selection
    jobs), else counted at most (`later`); from the finished runs' times, how long the rest takes and how many calls
    of --budget (budget.plan_text); then the commands of the selection runs left."""
    def left(jobs: list[dict]) -> int:
        return sum(job["state"] != "finished" for job in jobs)

    phases, done = {"selection": (len(coarse), left(coarse))}, list(coarse)
    if not left(coarse):
        fine = refinement(coarse)
        phases["refinement"], done = (len(fine), left(fine)), done + fine
        if not left(fine):
            held = held_out(coarse + fine)
            phases["held-out"], done = (len(held), left(held)), done + held
    if len(phases) < 3:
        phases["later phases (at most)"] = (later, None)
    print(plan_text(phases, finished_wall_times(done), workers, CHILDREN.budget))
    print(f"{workers} at a time with OMP_NUM_THREADS={threads}"
          + ("; the selection runs left:" if left(coarse) else ""))
    for job in coarse:
        if job["state"] != "finished":
            print(shlex.join(["python", "train.py", *job["argv"]]))


def run_setup(argv: list[str], n_seeds: int) -> dict:
    """What a figure's title and a verdict's scale state of a sweep: model size, data, steps, tokens trained on,
    optimizer, seeds."""
    cfg, model_args = train.load_config(argv)
    size = {k: model_args.get(k, getattr(GPTConfig, k)) for k in ("n_layer", "n_embd", "block_size")}
    if cfg.task == "icl" and "block_size" not in model_args:  # the task sets it (icl_task: 2 * icl_pairs)
        size["block_size"] = 2 * cfg.icl_pairs
    data = cfg.dataset if cfg.task == "lm" else f"least squares (T {cfg.icl_pairs})"
    tokens = cfg.max_iters * cfg.gradient_accumulation_steps * cfg.batch_size * size["block_size"]
    return {**size, "task": cfg.task, "data": data, "dataset": cfg.dataset, "data_dir": cfg.data_dir,
            "batch_size": cfg.batch_size, "max_iters": cfg.max_iters, "optimizer": cfg.optimizer, "seeds": n_seeds,
            "tokens": tokens}


def run_settings(argv: list[str]) -> dict:
    """Every training and model setting of a run's command (the config's, the flags', the defaults), but for
    the bookkeeping ones: what two sweeps must share for their points to be compared."""
    cfg, model_args = train.load_config(argv)
    settings = {**asdict(GPTConfig()), **model_args, **vars(cfg)}
    return {k: v for k, v in settings.items() if k not in (*IGNORED_FLAGS, "seed")}





def check_held_out(select_seeds: list[int], seeds: list[int]) -> None:
    """Refuse a seed that would both pick the rate and enter the verdict."""
    if common := sorted(set(select_seeds) & set(seeds)):
        raise SweepError(f"seed {','.join(map(str, common))} is in both --select_seeds and --seeds: a seed that "
                         "picks the rate never enters a verdict; give the two lists no seed in common")


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







def write_lr_summary(out_root: str, rows: list[dict], table: list[dict], keys: list[str], lr_key: str,
                     extra: list[str], title: str, recorded: dict, note: str | None = None) -> None:
    """Print the run table and the per-point table (and the note under them); write both to out_root/summary.md and
    summary.json, with `recorded` (the sweep's setup, its settings, the keys it sweeps, its data and the metric it
    judges on: what --leaderboard compares)."""
    metric = recorded.get("metric", "val_loss")
    run_columns = [*keys, lr_key, "seed", "train_loss", *dict.fromkeys(["val_loss", metric]), *extra, "diverged_at",
                   "exit_code", "wall_s", "ms_per_iter"]
    cpu_s = sum(r["wall_s"] or 0.0 for r in rows)
    text = "\n\n".join([format_table(rows, run_columns), point_table_text(table, keys, recorded.get("setup"), metric),
                        f"{len(rows)} runs, {cpu_s / 60:.1f} min of run time in all.", *([note] if note else [])])
    print("\n" + text)
    write_summary_files(out_root, title, text,
                        {**recorded, "lr_key": lr_key, "keys": keys, "runs": rows, "lr_points": table})


def val_loss_at(out_dir: str, iteration: int, metric: str = "val_loss") -> float | None:
    """A run's val loss (`metric`) at the evaluation of `iteration` (None if it logged none there); +inf after a
    divergence."""
    records = load_metrics(out_dir)
    stop = diverged_at(records)
    if stop is not None and iteration >= stop:
        return math.inf
    return next((r.get(metric) for r in records if r.get("kind") == "eval" and r["iter"] == iteration), None)


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
    keys, lr_key, metric = summary["keys"], summary["lr_key"], summary_metric(summary)
    picked = set(summary.get("select_seeds", []))
    for p in summary["lr_points"]:
        at_best = {**{k: p[k] for k in keys}, lr_key: p["best_lr"]}
        runs = {str(r["seed"]): final_loss(r, metric) for r in summary["runs"]
                if p["best_lr"] is not None and matches(r, at_best) and r["seed"] not in picked}
        stored = {str(s): math.inf if v is None else v for s, v in p["seed_losses"].items()}
        if stored != runs:
            return f"point {at_best}: seed_losses {p['seed_losses']}, its runs' final losses {runs}"
        if p.get("second_seed_losses"):  # a baseline's held-out runs at its second-best rate
            second = {**at_best, lr_key: p.get("second_lr")}
            runs = {str(r["seed"]): final_loss(r, metric) for r in summary["runs"] if matches(r, second)
                    and r["seed"] not in picked}
            if {str(s): math.inf if v is None else v for s, v in p["second_seed_losses"].items()} != runs:
                return f"point {second}: second_seed_losses {p['second_seed_losses']}, its runs' final losses {runs}"
    for r in summary["runs"]:
        if not isinstance(r.get("out_dir"), str):
            continue
        out_dir = os.path.join(root, os.path.basename(os.path.normpath(r["out_dir"])))
        last = r.get("final_iter") if isinstance(r.get("final_iter"), int) else math.inf  # older summaries: none
        evals = [m for m in load_metrics(out_dir) if m.get("kind") == "eval" and m["iter"] <= last]
        if evals and evals[-1].get("val_loss") != r["val_loss"]:
            return f"{out_dir}: final val loss {r['val_loss']}, its metrics.jsonl {evals[-1].get('val_loss')}"
    return None


def summary_metric(summary: dict) -> str:
    """The metric an lr summary judged on: val_loss for summaries written before they recorded one."""
    return summary.get("metric", "val_loss")


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
    if summary_metric(summary) not in METRICS:
        return f"metric {summary['metric']!r} is none of {', '.join(METRICS)}"
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


def leaderboard(roots: list[str], baseline: dict | None = None, claims: Claims | list | None = None) -> list[dict]:
    """One table over the per-point tables of several --lr_grid sweeps (their summary.json): every point at
    its own best rate, sorted by mean final val loss, with the verdict rule against the baseline point (the
    first root's, if several match; at its best rate and its second-best, as in each sweep's own table) for each
    point's claim (claims.for_row of its values over its sweep's settings; no claim: a description, not a
    verdict), Holm-corrected within each family of claims, on held-out seeds only (a seed that selected a rate
    in its sweep's folder never counts, see board_point). A point of a sweep whose recorded setup or fixed
    settings differ from the baseline's gets no verdict, and the row says what differs. Points with the same
    settings in two roots are told apart by the root; a root given twice (another spelling of one folder) is read
    once."""
    claims = as_claims(claims)
    summaries = [(root, read_lr_summary(root)) for root in distinct_folders(roots)]
    check_recorded_data(summaries)
    metrics = {root: summary_metric(s) for root, s in summaries}
    if len(set(metrics.values())) > 1:
        raise SweepError("the sweeps were judged on different metrics (" + ", ".join(f"{r}: {m}" for r, m in
                         metrics.items()) + "): run them again with one --metric to compare them")
    points = [board_point(root, summary, point) for root, summary in summaries for point in summary["lr_points"]]
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
               "lr_sensitivity": lr_sensitivity(p["first_runs"], p["lr_key"], shared, summary_metric(p["summary"])),
               "metric": summary_metric(p["summary"]),
               "lr_sensitivity_rates": over, "run_minutes": p["run_minutes"]}
        if base is not None and p is not base:
            differ = setup_difference(p["summary"], base["summary"])
            if differ:
                row["verdict"] = f"no verdict: another setup ({differ})"
            else:
                setup = p["summary"].get("setup")
                tests.append({**comparison(p, base, claims.for_row({**p["summary"].get("settings", {}), **p}),
                                           scale_text({**setup, **p}) if setup else None), "row": row})
        table.append(row)
    add_verdicts(tests, claims)
    return table


def board_point(root: str, summary: dict, point: dict) -> dict:
    """One point of a sweep's summary as the leaderboard compares it: its held-out losses at its best rate (and at
    its second-best, for a baseline), leaving out every seed that selected a rate in its folder (the summary's
    selection seeds and those out_root/selection_seeds.json keeps), and why its grid cannot back a verdict."""
    keys, lr_key, metric = summary["keys"], summary["lr_key"], summary_metric(summary)
    runs = [r for r in summary["runs"] if matches(r, {k: point[k] for k in keys})]
    try:
        picked = selection_seeds(summary, runs) | recorded_selection_seeds(root)
    except HeldOutError as e:
        raise SweepError(str(e)) from None
    selection = [r for r in runs if r["seed"] in picked]
    return {**point, "label": ", ".join(f"{k}={point[k]}" for k in keys) or os.path.basename(os.path.normpath(root)),
            "root": root, "summary": summary, "lr_key": lr_key,
            "seed_losses": {int(s): v for s, v in point["seed_losses"].items() if int(s) not in picked},
            "second_seed_losses": held_out_losses(runs, lr_key, point.get("second_lr"), picked, metric),
            "first_runs": first_seed_runs(selection, lr_key),
            "grid_shortfall": grid_shortfall(selection, lr_key, point["best_lr"], summary.get("unigram_loss"), metric),
            "run_minutes": sum(r.get("wall_s") or 0.0 for r in runs) / 60}


def check_claimed_rows(points: list[dict], claims: Claims) -> None:
    """Refuse an ad hoc --row_claim that names no row of the leaderboard (a mistyped value would leave its row
    described, not judged), listing the rows there are. A claims file's claims may name rows of other tables."""
    for claim in () if claims.path else claims.claims:
        if claim.row and not any(matches(p, claim.row) for p in points):
            rows = "; ".join(dict.fromkeys(", ".join(f"{k}={p[k]}" for k in p["summary"]["keys"]) for p in points))
            named = ",".join(f"{k}={v}" for k, v in claim.row.items())
            raise SweepError(f"--row_claim {named} matches no row of the leaderboard; its rows are: {rows}")


# ----------------------------------------------------------------------------- tables from the results files


def results_tables(folder: str) -> str:
    """--tables: the verdict tables (markdown) of every study under a results folder, from its files alone
    (results.study_tables); plot.py --tables writes them with a learning-rate figure per sweep."""
    return "\n\n".join(text for _, text, _ in study_tables(folder))


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
                        "final val loss; a rate that diverged on one ranks last); they never enter a verdict, in this "
                        f"folder ever (default: {MIN_SELECT_SEEDS} seeds not in --seeds, the smallest whole numbers; a "
                        f"decisive word needs {MIN_SELECT_SEEDS})")
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
    parser.add_argument("--claims", metavar="FILE", help="a claims file (nanonorm/claims.py: JSON, committed before "
                        "the runs): each row's claim, δ, paper and family; the baseline is its own. Replaces --claim "
                        "and --row_claim, whose claims are ad hoc (one family of their own rows)")
    parser.add_argument("--refine", action=argparse.BooleanOptionalAction, default=True,
                        help="with --lr_grid: after the grid, run the two rates at ×√3 around each point's pick on the "
                        "selection seeds and take the finer grid's best (default: on)")
    parser.add_argument("--results", metavar="DIR", help="with --lr_grid: also write the sweep's per-run numbers to "
                        "DIR/<out_root's name>.jsonl (a study's folder of results, kept in git)")
    parser.add_argument("--tables", metavar="DIR", help="print the verdict tables of the results files under DIR (its "
                        "*.jsonl and each subfolder's: one study each) from those files alone, and stop (plot.py "
                        "--tables DIR --out OUT writes them with their figures)")
    parser.add_argument("--budget", type=float, metavar="SECONDS", help="run runs for at most this long in this call "
                        f"(a GPU's lease): at the end the running runs save and stop, the sweep exits {BUDGET_EXIT}, "
                        "and the same command continues; with --jobs N, N runs share the device at a time")
    parser.add_argument("--metric", choices=METRICS, default="val_loss",
                        help="the final value each rate pick, mean and verdict is made on: val_loss (nats per token) "
                        "or val_bpb (bits per byte of the val text, comparable across tokenizers; LM runs)")
    parser.add_argument("--gpus", metavar="IDS|all", help="this node's CUDA devices for the runs, e.g. 0,1,2,3, or "
                        "all (every visible one): each run gets its own through CUDA_VISIBLE_DEVICES (default: none "
                        "set, every run sees what the sweep sees)")
    parser.add_argument("--runs_per_gpu", type=int, default=1, metavar="K",
                        help="runs at a time on each GPU (or group of --gpus_per_run GPUs): small models share one")
    parser.add_argument("--gpus_per_run", type=int, default=1, metavar="N",
                        help="GPUs of each run: N > 1 launches it by torchrun --standalone --nproc_per_node=N")
    parser.add_argument("--executor", choices=EXECUTORS, default="process",
                        help="process: each run a child of the sweep; local: the same through submitit's local "
                        "executor; slurm: each run a SLURM job (submitit). The same command continues a sweep")
    parser.add_argument("--slurm_partition", help="--executor slurm: the partition of the jobs")
    parser.add_argument("--slurm_time", type=int, default=24 * 60, metavar="MINUTES",
                        help="--executor slurm: each job's time limit; a run past it saves and is resubmitted to "
                        "resume (default: 1440)")
    parser.add_argument("--slurm_gpus_per_job", type=int, metavar="N",
                        help="--executor slurm: GPUs per job (default: --gpus_per_run; 0 for CPU jobs)")
    parser.add_argument("--slurm_extra", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="--executor slurm: more sbatch options, e.g. account=proj qos=high constraint=h100")
    parser.add_argument("--wandb_group", metavar="NAME", help="with --set wandb_project=...: the wandb group of the "
                        "runs (default: the name of --out_root)")
    parser.add_argument("--rerun", action="store_true", help="run finished runs again, from scratch")
    parser.add_argument("--dry_run", action="store_true", help="print the train.py commands and stop")
    args = parser.parse_args(argv)
    with forwarding_stop_signals():
        return run_command(args)


def parse_claims(args: argparse.Namespace) -> tuple[Claims, dict | None]:
    """The claims and the baseline: a claims file's (--claims; a --baseline must agree with its own), or the ad hoc
    claims of --claim/--delta (every point) and --row_claim (a point's own), refused without the --baseline they
    are claims against."""
    baseline = parse_assignments(args.baseline, "--baseline") or None
    adhoc = args.claim != "none" or args.delta is not None or args.row_claim
    if args.claims:
        if adhoc:
            raise SweepError("give the claims by --claims FILE or by --claim/--delta/--row_claim, not both")
        try:
            claims = read_claims(args.claims)
        except ClaimsError as e:
            raise SweepError(str(e)) from None
        if baseline and baseline != claims.baseline:
            raise SweepError(f"--baseline {' '.join(args.baseline)} is not the baseline of {args.claims} "
                             f"({claims.baseline}); leave --baseline out, or give the file's")
        return claims, claims.baseline
    if adhoc and not baseline:
        raise SweepError("--claim, --delta and --row_claim state what is claimed against --baseline; give "
                         "--baseline key=value")
    return as_claims([({}, *checked_claim(args.claim, args.delta)), *(parse_claim(c) for c in args.row_claim)]), \
        baseline


def print_leaderboard(roots: list[str], baseline: dict | None, claims: Claims) -> None:
    """--leaderboard: the table over the sweeps, the rates its sensitivity is over and its run time."""
    table = leaderboard(roots, baseline, claims)
    print(format_table(table, ["label", "best_lr", "val_loss_mean_std", *VERDICT_COLUMNS, "verdict_second",
                               "diverged_lrs", "lr_sensitivity", "run_minutes", "edge_warning"],
                       table[0]["metric"] if table else "val_loss"))
    rates = table[0]["lr_sensitivity_rates"] if table else ""
    print(f"\nlr sensitivity over the rates every arm ran: {rates or 'none'}"
          f"\n{sum(r['run_minutes'] for r in table):.1f} min of run time in all")


def in_grid(values: dict, grid: dict[str, list]) -> bool:
    """Whether every key=value is a value of the grid."""
    return all(k in grid and v in grid[k] for k, v in values.items())


def make_launcher(args: argparse.Namespace, dry_run: bool) -> Launcher:
    """Where and how the runs go, from --jobs, --threads_per_run, --gpus, --runs_per_gpu, --gpus_per_run,
    --executor and the --slurm_* options. A dry run takes any --gpus ids (it starts nothing)."""
    for flag, value in (("--runs_per_gpu", args.runs_per_gpu), ("--gpus_per_run", args.gpus_per_run)):
        if value < 1:
            raise SweepError(f"{flag} {value}: give a whole number of at least 1")
    slurm_given = args.slurm_partition or args.slurm_gpus_per_job is not None or args.slurm_extra
    if slurm_given and args.executor != "slurm":
        raise SweepError("--slurm_partition, --slurm_gpus_per_job and --slurm_extra are options of SLURM jobs; give "
                         "--executor slurm too")
    if args.executor == "slurm":
        if args.gpus or args.runs_per_gpu != 1:
            raise SweepError("--gpus and --runs_per_gpu place runs on this node's GPUs; on SLURM each job gets "
                             "--slurm_gpus_per_job GPUs of its own")
        gpus = args.gpus_per_run if args.slurm_gpus_per_job is None else args.slurm_gpus_per_job
        slurm = slurm_parameters(args.slurm_partition, args.slurm_time, gpus, args.threads_per_run, args.slurm_extra)
        return Launcher(1, args.threads_per_run or 0, gpus_per_run=args.gpus_per_run, executor="slurm", slurm=slurm)
    if args.gpus is None:
        if args.runs_per_gpu != 1 or args.gpus_per_run != 1:
            raise SweepError("--runs_per_gpu and --gpus_per_run place runs on GPUs; give --gpus 0,1,... or all")
        return cpu_launcher(args.jobs, args.threads_per_run, args.executor)
    visible = torch.cuda.device_count()
    gpus = parse_gpus(args.gpus, visible)
    if not dry_run and max(gpus) >= visible:
        raise SweepError(f"--gpus {args.gpus}: this machine has {visible} visible CUDA device(s), numbered from 0; "
                         "give ids below that, or all")
    return gpu_launcher(gpus, args.runs_per_gpu, args.gpus_per_run, args.jobs, args.threads_per_run, args.executor)


def with_wandb_group(config: str, fixed: dict, group: str | None, out_root: str) -> dict:
    """The --set settings, with every run's wandb group (--wandb_group, default out_root's name) when the runs log
    to wandb (wandb_project set by the config or --set) and no --set names the group."""
    project = fixed.get("wandb_project", explicit_settings([config]).get("wandb_project"))
    if not project:
        if group:
            raise SweepError("--wandb_group groups the runs in wandb; give --set wandb_project=NAME too (or a config "
                             "that sets it)")
        return fixed
    return fixed if "wandb_group" in fixed else {**fixed, "wandb_group": group or os.path.basename(
        os.path.normpath(out_root))}


def run_command(args: argparse.Namespace) -> int:
    """main() past the parsing: the exit code of what args ask for."""
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        print(f"error: --budget {args.budget:g}: give the seconds this call may run runs for, a number > 0",
              file=sys.stderr)
        return 2
    CHILDREN.set_budget(args.budget)
    try:
        return run_commands(args)
    finally:
        CHILDREN.set_budget(None)


def run_commands(args: argparse.Namespace) -> int:
    """run_command's work: the exit code of what args ask for."""
    try:
        if args.lr_seeds is not None:
            raise SweepError("--lr_seeds is replaced by --select_seeds: the rate is picked on seeds that never enter "
                             "a verdict, e.g. --select_seeds 0 --seeds 1,2,3,4,5 (for --lr_seeds 2 --seeds 1,2,3: "
                             "--select_seeds 1,2 --seeds 3 and more held-out seeds)")
        if args.tables:
            print(results_tables(args.tables), end="")
            return 0
        claims, baseline = parse_claims(args)
        if args.leaderboard:
            print_leaderboard(args.leaderboard, baseline, claims)
            return 0
        if args.config is None:
            raise SweepError("give a config file to sweep, or --leaderboard OUT_ROOT ..., or --tables RESULTS")
        if not args.lr_grid and (args.claims or args.results):
            raise SweepError(f"{'--claims' if args.claims else '--results'} goes with --lr_grid: a grid at one rate "
                             "gives no verdict and writes no results; give --lr_grid RATES")
        grid = {k: distinct_values(v, f"--grid {k}") for k, v in parse_assignments(args.grid, "--grid").items()}
        if baseline and not in_grid(baseline, grid):
            if not claims.path:
                raise SweepError(f"--baseline {' '.join(args.baseline)} is not in the grid {grid}")
            baseline = None  # a claims file's baseline swept elsewhere: the leaderboard judges these rows
        for claim in () if claims.path else claims.claims:
            if not in_grid(claim.row, grid):
                raise SweepError(f"--row_claim: {claim.row} is not a point of the grid {grid}")
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
        launcher = make_launcher(args, args.dry_run)
        fixed = with_wandb_group(args.config, fixed, args.wandb_group, out_root)
        # one sweep at a time writes an out_root: its runs' logs and run.json files, its summary
        with contextlib.nullcontext() if args.dry_run else OutDirLock(out_root, "--out_root", "sweep"):
            if lr_values:
                table = run_lr_sweep(args.config, grid, lr_values, lr_keys, seeds, fixed, out_root, args.jobs,
                                     args.threads_per_run, args.rerun, baseline, claims, args.dry_run,
                                     extra, select, args.refine, args.results, args.metric, launcher)
                return int(any(row["crashed_lrs"] for row in table))
            rows = run_sweep(args.config, grid, seeds, fixed, out_root, args.jobs, args.threads_per_run, args.rerun,
                             baseline, args.dry_run, extra, args.metric, launcher)
    except BudgetSpent as e:
        print(f"budget: {e}")
        return BUDGET_EXIT
    except (SweepError, ConfigError, RunFileError, ClaimsError, ResultsError, LaunchError) as e:
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

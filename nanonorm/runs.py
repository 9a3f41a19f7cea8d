"""
The files a train.py run leaves in its out_dir, as sweep.py and plot.py read them: metrics.jsonl (its records,
the iteration it diverged at) and the settings it ran with (from its checkpoint, or from the command line its
run.json records).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

# bookkeeping keys that differ between runs without changing what is trained
IGNORED_FLAGS = ("out_dir", "data_dir", "init_from", "overwrite", "wandb_run_name", "wandb_project", "wandb_group",
                 "deterministic")  # where and how a run logs and runs, not what it trains
# model keys train.py fills in from the data or the task when no flag sets them
TASK_MODEL_KEYS = ("vocab_size", "block_size", "in_features", "out_features", "embed_fan_in")


class RunFileError(ValueError):
    """A run's file that cannot be read as train.py writes it (a metric of the wrong type, a junk checkpoint):
    sweep.py and plot.py print it and exit with code 2."""


def load_metrics(out_dir: str) -> list[dict]:
    """The records of out_dir/metrics.jsonl ([] if there is none); a line cut off mid-write, or one that is not
    a JSON object (a file edited by hand), is skipped. A record with a value of the wrong type (an iter that is
    not an integer, a metric that is not a number or null) raises RunFileError."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    records = []
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                problem = record_problem(record)
                if problem:
                    raise RunFileError(f"{path} line {number}: {problem}; fix or delete that line")
                records.append(record)
    return records


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def record_problem(record: dict) -> str | None:
    """What is wrong with the types of one metrics.jsonl record, as train.py writes them, or None: iter an integer
    (a status line may lack it); in every other line each metric a number or null (non-finite values are
    written as null), or a list of them."""
    kind, it = record.get("kind"), record.get("iter")
    if ("iter" in record or kind in ("train", "eval")) and not (isinstance(it, int) and is_number(it)):
        return f"iter is {json.dumps(it)}, not an integer" if "iter" in record else f"a {kind} line without its iter"
    if kind == "status":
        return None
    for key, value in record.items():
        values = value if isinstance(value, list) else [value]
        if key != "kind" and not isinstance(value, dict) and not all(v is None or is_number(v) for v in values):
            return f"{key} is {json.dumps(value)}, not a number or null"
    return None


def run_config(out_dir: str) -> dict | None:
    """The model and training settings saved in out_dir/ckpt.pt, model keys first, and under "scheme" the
    primitives the run's scheme used. Without a checkpoint (a run that diverged before its first one),
    the settings its sweep.py command line gave (out_dir/run.json); None without either. A run stopped before
    its first ckpt.pt has its settings in the stop signal's ckpt_last.pt."""
    path = next((p for p in (os.path.join(out_dir, name) for name in ("ckpt.pt", "ckpt_last.pt"))
                 if os.path.exists(p)), None)
    if path is None:
        return command_line_config(out_dir)
    import torch

    from model import GPTConfig

    # mmap: only the two small dicts are read, not the weights and optimizer state
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many kinds (RuntimeError, UnpicklingError, EOFError) for a bad file
        raise RunFileError(f"{path} cannot be read as a checkpoint ({e.__class__.__name__}); move it away to label "
                        "the run by its run.json or folder name") from None
    model_args = ckpt.get("model_args", {})
    try:  # the scheme's primitives as the run used them (an override left at None takes the row's value)
        scheme = GPTConfig(**model_args).scheme._asdict()
    except (TypeError, ValueError):  # a checkpoint from another version of model.py
        scheme = {}
    return {**model_args, **ckpt.get("config", {}), "scheme": scheme}


def command_line_config(out_dir: str) -> dict | None:
    """The training and model settings of out_dir/run.json's argv (config file and flags), the model's
    defaults for the rest but for the keys the task sets (TASK_MODEL_KEYS: missing); None if there is no
    such file or it no longer parses. The config file is looked up from here, then from this file's
    project's folder (sweep.py's cwd)."""
    import contextlib
    import io

    from model import GPTConfig
    from nanonorm.train_config import ConfigError, load_config

    try:
        with open(os.path.join(out_dir, "run.json")) as f:
            argv = list(json.load(f)["argv"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if argv and not argv[0].startswith("--") and not os.path.exists(argv[0]):
        argv[0] = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), argv[0])
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its "no effect" warnings were the run's to give
            cfg, model_args = load_config(argv)
        scheme = GPTConfig(**model_args).scheme._asdict()
    except (ConfigError, OSError, TypeError, ValueError):
        return None
    # the model keys left at their defaults, but those the task fills in (the vocabulary, the vector sizes)
    defaults = {k: v for k, v in asdict(GPTConfig()).items() if k not in TASK_MODEL_KEYS}
    return {**defaults, **model_args, **vars(cfg), "scheme": scheme}


def distinct_folders(paths: list[str]) -> list[str]:
    """paths with each folder once, in their order: two spellings of one folder (a trailing slash, a symlink,
    out/sweep/*/ beside out/sweep/a) would count its runs twice. Each one left out is named in a note."""
    kept, seen = [], {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            print(f"note: {path} is {seen[real]} again; read once")
            continue
        seen[real] = path
        kept.append(path)
    return kept


def diverged_at(records: list[dict]) -> int | None:
    """The iteration of a run's "diverged" status line, if it has one."""
    return next((r["iter"] for r in records if r.get("kind") == "status" and r.get("status") == "diverged"
                 and isinstance(r.get("iter"), int)), None)  # a line without its iteration (edited by hand): skipped

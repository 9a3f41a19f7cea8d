"""
Checkpoints: what a resumed or eval-only run starts from, what it checks first, and when a run saves.

Reproducibility: micro-batch k of iteration i (k counts over all ranks) sees data and dropout masks
that depend only on (seed, i, k) (lm_task.stream_seed). A checkpoint holds the model, the optimizer
state (every optimizer here keeps its full state on rank 0), the GradScaler and the iteration, so a run
killed at any moment and resumed with --init_from=resume continues bitwise as if never stopped.
Resuming with another number of processes also sees the same batches and masks; only float summation
order changes (gradients summed by all-reduce instead of accumulated locally, and the logged loss
likewise), so losses then agree to rounding (~1e-6 relative), not bitwise. On resume the config's
hyperparameters (learning rate, weight decay, ...) apply; the architecture is the checkpoint's and may
not be changed, except dropout. The data must be the data the checkpoint was trained on (check_same_data)
and the settings must fit its model (resume_model_args): a failed check exits 2 before the model is built.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, replace

import torch

from model import GPTConfig
from nanonorm.guards import Dist, StopSignals, agreed
from nanonorm.run_files import (
    CHECKPOINT_NAME,
    LAST_CHECKPOINT_NAME,
    METRICS_NAME,
    NO_SPACE,
    MetricsLog,
    WandbRun,
    foreign_checkpoint,
    foreign_files,
    load_checkpoint,
    move_dropped_checkpoints,
    previous_run_files,
    remove_previous_run,
    save_checkpoint,
    save_latest_checkpoint,
    unwritable,
)
from nanonorm.train_config import TRAIN_KEYS, ConfigError, TrainConfig


def checkpoint_to_load(cfg: TrainConfig) -> str | None:
    """The checkpoint a resumed or eval-only run starts from (the stop save when it is the newer, see
    save_stop_checkpoint); None for a new run. Checked before out_dir is claimed, so a mistyped out_dir
    is not created."""
    if cfg.init_from == "scratch":
        return None
    last = os.path.join(cfg.out_dir, LAST_CHECKPOINT_NAME)
    if cfg.init_from == "resume" and os.path.isfile(last):
        return last
    ckpt_path = os.path.join(cfg.out_dir, CHECKPOINT_NAME)
    if not os.path.exists(ckpt_path):
        needs = "init_from='eval' evaluates out_dir's checkpoint" if cfg.init_from == "eval" else "init_from='resume'"
        raise ConfigError(f"{needs}, but there is no checkpoint at {ckpt_path}; train one first "
                          "(init_from='scratch') or fix --out_dir")
    return ckpt_path


def starting_point(cfg: TrainConfig, device: str) -> dict | None:
    """The checkpoint a resumed or eval-only run starts from; None for a new run, which may replace an earlier
    run's files (checkpoints, or only a metrics.jsonl) only with --overwrite=True."""
    path = checkpoint_to_load(cfg)
    if path is not None:
        try:
            return checked_contents(load_checkpoint(path, device), cfg)
        except ConfigError as e:
            if os.path.basename(path) != LAST_CHECKPOINT_NAME:
                raise
            # the best evaluation's ckpt.pt is still there to go back to
            raise ConfigError(f"{e}; or delete {path} and its .sha256 to resume from {CHECKPOINT_NAME}, the best "
                              "evaluation's checkpoint") from None
    earlier = previous_run_files(cfg.out_dir)  # exactly what --overwrite deletes: each is named first
    if earlier and not cfg.overwrite:
        raise ConfigError(f"an earlier run already exists in {cfg.out_dir} ({', '.join(earlier)}); continue "
                          "it with --init_from=resume, choose another --out_dir, or pass --overwrite=True to delete "
                          "those files and start anew")
    folders, foreign = foreign_files(cfg.out_dir, earlier)
    if folders:  # a new run deletes the earlier run's files, not folders: refuse now, not after the setup
        raise ConfigError(f"{', '.join(folders)} in {cfg.out_dir} is a folder, not a run's file, and a new run "
                          "deletes files only; move it away or choose another --out_dir")
    if foreign:  # nor anything a run did not put among the checkpoints a resume moved aside
        raise ConfigError(f"{', '.join(foreign)} in {cfg.out_dir} is not a checkpoint that a resume moved aside, and "
                          "a new run deletes only a run's files; move it away or choose another --out_dir")
    return None


# what a resumed run reads, and its type (an evaluation reads all but the optimizer state)
CHECKPOINT_FIELDS = {"model": dict, "optimizer": dict, "model_args": dict, "config": dict, "iter_num": int,
                     "best_val_loss": float}


def checked_contents(checkpoint: dict, cfg: TrainConfig) -> dict:
    """The checkpoint, if it holds every field this resumed or eval-only run reads (checked before anything is
    built)."""
    needed = {k: kind for k, kind in CHECKPOINT_FIELDS.items() if k != "optimizer" or cfg.init_from != "eval"}
    wrong = [k for k, kind in needed.items() if not isinstance(checkpoint.get(k), kind)]
    if wrong:
        raise foreign_checkpoint(cfg.out_dir, KeyError(f"{', '.join(wrong)} missing or of another type"))
    return checkpoint


def resumed_settings(cfg: TrainConfig, model_args: dict, checkpoint: dict | None) -> tuple[TrainConfig, dict]:
    """The config and model keys the task is built from: a resumed or eval-only run keeps the checkpoint's
    compact_vocab, and its block_size and other model keys unless it sets them (a clash stops in
    resume_model_args); its task must be this run's."""
    if checkpoint is None:
        return cfg, model_args
    task = checkpoint["config"].get("task", "lm")
    if task != cfg.task:
        raise ConfigError(f"the checkpoint was trained on task={task!r}, this run asks for task={cfg.task!r}; its "
                          f"model does not fit the other task's inputs. Pass --task={task}, or start a new run "
                          "with another --out_dir")
    compact = checkpoint["config"].get("compact_vocab", False)
    if cfg.compact_vocab and not compact:
        raise ConfigError("cannot resume: the checkpoint was trained without compact_vocab, so its model has "
                          "the full vocabulary; drop --compact_vocab or start a new run with another --out_dir")
    return replace(cfg, compact_vocab=compact), {**checkpoint["model_args"], **model_args}


SPLIT_FINGERPRINT = ("train_tokens", "val_tokens", "train_sha256", "val_sha256")  # meta.json's, per split


def data_fingerprint(meta: dict) -> dict:
    """What tells one prepared dataset's data from another's, from its meta.json: the tokenizer and vocabulary
    size, a char vocabulary by its SHA-256 (two texts of other letters can give the same ids), and each split's
    token count and digest (SPLIT_FINGERPRINT; a dataset prepared before digests were recorded has counts only)."""
    fingerprint = {k: meta[k] for k in ("tokenizer", "vocab_size", *SPLIT_FINGERPRINT) if k in meta}
    if isinstance(meta.get("chars"), list):
        fingerprint["chars_sha256"] = hashlib.sha256(json.dumps(meta["chars"]).encode()).hexdigest()
    return fingerprint


def fingerprint_changes(before: dict, after: dict) -> list[str]:
    """How two data fingerprints differ, key by key over the keys both have (digests shortened)."""
    return [f"{k} {short(before[k])} -> {short(after[k])}" for k in before if k in after and before[k] != after[k]]


def short(value: object) -> str:
    """A meta.json value for a message: a digest by its first 12 hex digits."""
    return f"{value[:12]}..." if isinstance(value, str) and len(value) == 64 else repr(value)


def check_same_data(cfg: TrainConfig, checkpoint: dict, task) -> None:
    """A resumed or evaluated model reads token ids as its training data defined them: another dataset is
    fine only if the same ids mean the same tokens (same tokenizer, characters and compact ids). The
    checkpoint's own dataset, prepared again since from other text, is refused: the run would go on (or be
    evaluated) on data other than the data its log and checkpoint name."""
    saved = checkpoint.get("data_meta")
    if saved is None or not hasattr(task, "data"):
        return
    keys = ("tokenizer", "vocab_size", "chars", "token_ids")
    differ = [k for k in keys if saved.get(k) != task.data.meta.get(k)]
    same_name = checkpoint["config"].get("dataset") == cfg.dataset
    if differ and same_name:
        raise ConfigError(f"{task.data.path} was prepared again since this checkpoint was saved ({', '.join(differ)} "
                          "differ), so the model would read the wrong tokens; prepare the data as it was, or start "
                          "a new run with another --out_dir")
    if differ:
        raise ConfigError(f"{task.data.path} does not encode text as the checkpoint's training data did ("
                          f"{', '.join(differ)} differ), so the model would read the wrong tokens; use the dataset "
                          f"it was trained on (--dataset={checkpoint['config']['dataset']}) or start a new run "
                          "with another --out_dir")
    if not same_name:
        return
    # the token files' counts and digests, not the source: meta.json records --input as typed, so the same
    # file from another folder differs there; a dataset prepared before digests were recorded has counts only
    now = task.data.meta
    changed = [f"{k} {short(saved[k])} -> {short(now[k])}" for k in SPLIT_FINGERPRINT
               if k in saved and k in now and saved[k] != now[k]]
    if changed:
        raise ConfigError(f"{task.data.path} was prepared again since this checkpoint was saved ({', '.join(changed)})"
                          ", so the run would not go on with the data it was trained on; prepare the data as it was, "
                          "or start a new run with another --out_dir (to train on the new text from this checkpoint, "
                          "prepare it under another dataset name and pass --dataset)")


def resume_model_args(cfg: TrainConfig, model_args: dict, task, checkpoint: dict) -> dict:
    """The checkpoint's architecture, after checking that this run's settings fit it."""
    saved, old = checkpoint["model_args"], checkpoint["config"]
    if old["optimizer"] != cfg.optimizer and cfg.init_from != "eval":
        raise ConfigError(f"the checkpoint was trained with optimizer={old['optimizer']!r}, this run asks for "
                          f"{cfg.optimizer!r}; its optimizer state would not fit. Pass --optimizer={old['optimizer']}")
    wanted = {**task.model_defaults, **model_args}
    clash = [f"{k}={saved.get(k)!r} (this run: {v!r})" for k, v in wanted.items()
             if k != "dropout" and saved.get(k) != v]
    if clash:
        raise ConfigError(f"cannot resume: the checkpoint's model has {', '.join(clash)}. A resumed run keeps the "
                          "checkpoint's model and data layout (only dropout may change); drop those settings "
                          "or start a new run with another --out_dir")
    return {**saved, **{k: v for k, v in model_args.items() if k == "dropout"}}


def model_config(cfg: TrainConfig, model_args: dict, task, checkpoint: dict | None) -> GPTConfig:
    """The model's config: the task's defaults under the config's keys or, resumed, the checkpoint's (checked
    first); an impossible value or a vocabulary smaller than the data's is a ConfigError."""
    if checkpoint is not None:
        model_args = resume_model_args(cfg, model_args, task, checkpoint)
    else:
        model_args = {**task.model_defaults, **model_args}
    try:
        gptconf = GPTConfig(**model_args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except TypeError as e:  # a key GPTConfig lacks: the checkpoint's (the config's keys are checked)
        raise foreign_checkpoint(cfg.out_dir, e) from None
    if cfg.task == "lm" and gptconf.vocab_size < task.data.vocab_size:
        raise ConfigError(f"vocab_size={gptconf.vocab_size} is smaller than the dataset's vocabulary of "
                          f"{task.data.vocab_size} tokens; drop --vocab_size (the data sets it) or raise it")
    return gptconf


def load_weights(model: torch.nn.Module, checkpoint: dict, out_dir: str) -> None:
    """The checkpoint's weights into `model`; weights that do not fit are named as a foreign checkpoint."""
    try:
        model.load_state_dict(checkpoint["model"])
    except RuntimeError as e:  # missing, extra or misshapen weights
        raise foreign_checkpoint(out_dir, e) from None


def load_optimizer_state(optimizer: torch.optim.Optimizer, checkpoint: dict, cfg: TrainConfig) -> None:
    """The checkpoint's optimizer state (not for an evaluation, which needs none), under this run's
    hyperparameters: the config's learning rate, weight decay, ... win over the checkpoint's."""
    if cfg.init_from == "eval":
        return
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:  # groups or state that do not match the parameters
        raise foreign_checkpoint(cfg.out_dir, e) from None
    for group, fresh in zip(optimizer.param_groups, settings, strict=True):
        group.update(fresh)  # the config's hyperparameters win over the checkpoint's


def resume_summary(cfg: TrainConfig, checkpoint: dict, log: MetricsLog) -> str:
    """The lines a resumed or eval-only run starts with: where it starts and the settings it changes, then what it
    moved aside (log.moved)."""
    changed = [f"{k} {v!r} -> {getattr(cfg, k)!r}" for k, v in checkpoint["config"].items()
               if k in TRAIN_KEYS and k not in ("init_from", "overwrite") and getattr(cfg, k) != v]
    return (f"{'evaluating' if cfg.init_from == 'eval' else 'resuming'} at iter {checkpoint['iter_num']} "
            f"(saved by {checkpoint['world_size']} process(es))"
            + (f"; changed: {', '.join(changed)}" if changed else "") + (f"\n{log.moved}" if log.moved else ""))


def open_log(cfg: TrainConfig, ddp: Dist, device: str, checkpoint: dict | None, reevaluates: bool,
             model_config: dict | None = None) -> MetricsLog:
    """metrics.jsonl. A new run deletes the earlier run's files only now, with everything
    ready; a resumed run continues the log from its checkpoint (reevaluates: its eval line is written again) and
    moves the kept checkpoints past it aside (set_branch_aside). With wandb_project, rank 0 also logs its lines,
    the config (`model_config` and cfg) and the commit to wandb."""
    if ddp.master and checkpoint is None:
        removed = remove_previous_run(cfg.out_dir)
        if removed:
            print(f"overwrite: deleted the earlier run's {', '.join(removed)} from {cfg.out_dir}")
    log = agreed(lambda: set_branch_aside(cfg, ddp, checkpoint, MetricsLog(
        cfg.out_dir, ddp.master and cfg.init_from != "eval", checkpoint["iter_num"] if checkpoint else None,
        reevaluates=reevaluates, logged_lines=checkpoint.get("metrics_lines") if checkpoint else None)),
                 device, f"continue {METRICS_NAME}")
    if cfg.wandb_project and log.enabled:
        log.mirror = WandbRun(cfg.out_dir, cfg.wandb_project, cfg.wandb_group,
                              {**(model_config or {}), **asdict(cfg)}, resumed=checkpoint is not None)
    return log


def set_branch_aside(cfg: TrainConfig, ddp: Dist, checkpoint: dict | None, log: MetricsLog) -> MetricsLog:
    """A resume goes on from its checkpoint's iteration: the kept checkpoints past it are of a branch it abandons
    (it went back: always_save_checkpoint=False after the run got worse, or a kill between a ckpt_<N>.pt and its
    ckpt.pt). They move to a dropped_after_iter_<N> folder before this run writes any of its own, so none is
    replaced and out_dir's are all of one branch; log.moved says so, after the log's own line."""
    if not ddp.master or checkpoint is None or cfg.init_from != "resume":
        return log
    try:
        folder = move_dropped_checkpoints(cfg.out_dir, checkpoint["iter_num"])
    except OSError as e:
        if e.errno in NO_SPACE:  # the checksums are copied
            raise unwritable(os.path.join(cfg.out_dir, f"dropped_after_iter_{checkpoint['iter_num']}"), e) from None
        raise ConfigError(f"cannot move the kept checkpoints past iter {checkpoint['iter_num']} aside in "
                          f"{cfg.out_dir} ({e.strerror or e}); nothing of them was lost, fix the cause and resume "
                          "again") from None
    if folder is not None:
        line = (f"kept checkpoints past iter {checkpoint['iter_num']} moved to {folder}: this run goes on from the "
                f"checkpoint at iter {checkpoint['iter_num']}")
        log.moved = f"{log.moved}\n{line}" if log.moved else line
    return log


def save_evaluated(cfg: TrainConfig, iteration: int, checkpoint_state: Callable[[], dict], improved: bool,
                   stop: StopSignals) -> None:
    """After a finite evaluation: ckpt_<iter>.pt every keep_every iterations (first, so that a kill between
    the two saves loses neither), and ckpt.pt if always_save_checkpoint or the val loss `improved`. A second
    SIGINT waits for the saves to complete (stop.saving_first)."""
    keep, latest = cfg.keep_every and iteration % cfg.keep_every == 0, cfg.always_save_checkpoint or improved
    state = checkpoint_state() if keep or latest else None
    with stop.saving_first():
        if keep:
            save_checkpoint(os.path.join(cfg.out_dir, f"ckpt_{iteration}.pt"), state)
        if latest:
            save_latest_checkpoint(cfg.out_dir, state)

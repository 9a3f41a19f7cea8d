"""
The files of a run in its out_dir: the checkpoint (ckpt.pt, written atomically) and the metrics log
(metrics.jsonl, one JSON object per line).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle

import torch

from train_config import ConfigError

CHECKPOINT_FORMAT = "nanonorm-checkpoint-v1"


def save_checkpoint(path: str, state: dict) -> None:
    """Write atomically (temp file, fsync, rename, fsync of the folder): a crash at any moment
    leaves the previous file or the new one under `path`, and at most a stale `path`.tmp."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX)
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(path: str, device: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"init_from='resume' but there is no checkpoint at {path}; "
                          "train with init_from='scratch' first or fix --out_dir")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated zip, a text file, a pickle of other objects, ...
        why = ("weights-only loading refused its contents" if isinstance(e, pickle.UnpicklingError)  # long, off-topic
               else f"{type(e).__name__}: {' '.join(str(e).split())[:160]}")
        raise ConfigError(f"checkpoint {path} cannot be read ({why}); it may be truncated, or not a nanoNorm "
                          "checkpoint. Nothing was changed; restore it or start a new run with another --out_dir"
                          ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path} is not a nanoNorm checkpoint (no '{CHECKPOINT_FORMAT}' marker); nothing was changed")
    return state


class MetricsLog:
    """metrics.jsonl: one JSON object per line. A fresh run starts it anew, a resumed run drops the
    lines past its checkpoint (and a line cut short by a kill), an eval-only run appends."""

    def __init__(self, out_dir: str, enabled: bool, resume_iter: int | None = None, append: bool = False,
                 wandb_run=None):
        self.path, self.enabled, self.wandb = os.path.join(out_dir, "metrics.jsonl"), enabled, wandb_run
        self.checkpoint_path = os.path.join(out_dir, "ckpt.pt")
        if not enabled or append or not os.path.exists(self.path):
            return
        if resume_iter is None:
            os.remove(self.path)
            return
        with open(self.path) as f:
            kept = [line for line in f if self._before_resume(line, resume_iter)]
        with open(self.path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(self.path + ".tmp", self.path)

    @staticmethod
    def _before_resume(line: str, resume_iter: int) -> bool:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return False  # cut short by a kill mid-write
        # the resumed run re-logs the evaluation at resume_iter and everything after it
        it = record.get("iter", 0)
        return it < resume_iter or (it == resume_iter and record.get("kind") == "train")

    def write(self, **record) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("iter"))

"""
The files of a run in its out_dir, and the rules that keep them from lying:

    .lock             held (flock) by the one run writing this folder; the kernel releases it however the run ends
    ckpt.pt           the last checkpoint (always_save_checkpoint=False: the best evaluation's), written atomically
    ckpt.pt.sha256    its SHA-256 (`sha256sum -c ckpt.pt.sha256` checks it), verified on every load
    ckpt_last.pt      always_save_checkpoint=False only: a stop signal's save, kept while it is newer than ckpt.pt
    ckpt_<iter>.pt    kept checkpoints (keep_every), each with its own .sha256
    metrics.jsonl     one strict JSON object per line; a non-finite number is written as null
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import math
import os
import pickle
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from typing import BinaryIO

import torch

from nanonorm.train_config import ConfigError

CHECKPOINT_FORMAT = "nanonorm-checkpoint-v1"
LOCK_NAME, METRICS_NAME, CHECKPOINT_NAME, LAST_CHECKPOINT_NAME = ".lock", "metrics.jsonl", "ckpt.pt", "ckpt_last.pt"
RUN_FILE_PATTERNS = ("ckpt*.pt", "ckpt*.pt.sha256", "ckpt*.tmp", "metrics.jsonl*")  # what one run writes


# ----------------------------------------------------------------------------- the out_dir lock


class OutDirInUse(ConfigError):
    """Another process holds the out_dir's lock."""


class OutDirLock:
    """An exclusive lock on out_dir for as long as this object lives (flock on out_dir/.lock). The kernel
    drops an flock when its process ends, even by SIGKILL, so a dead run never leaves its folder locked."""

    def __init__(self, out_dir: str, flag: str = "--out_dir", holder: str = "run"):
        """flag names the option that chose the folder, holder what holds the lock, in the messages."""
        if not out_dir:
            raise ConfigError(f"{flag[2:]} is empty; give the {holder} a folder with {flag}=PATH")
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise ConfigError(f"{flag[2:]} {out_dir!r} is a file, not a folder; choose another {flag}")
        self.path = os.path.join(out_dir, LOCK_NAME)
        try:
            os.makedirs(out_dir, exist_ok=True)
            _probe_writable(out_dir)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot write to {flag[2:]} {out_dir!r} ({e.strerror}); choose a writable {flag}"
                              ) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(self.fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise OutDirInUse(f"{flag[2:]} {out_dir!r} is in use by another {holder} (process {pid} holds "
                              f"{self.path}); wait for it to end, stop it, or choose another {flag}") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None

    def __enter__(self) -> OutDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _probe_writable(out_dir: str) -> None:
    """Create and remove a file: a read-only out_dir can still hold an earlier run's writable .lock."""
    fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".probe-")
    os.close(fd)
    os.remove(probe)


def previous_run_files(out_dir: str) -> list[str]:
    """The checkpoints and metrics an earlier run left in out_dir (sorted names)."""
    folder = glob.escape(out_dir)  # an out_dir such as run[1] is a name, not a pattern
    found = {os.path.basename(p) for pattern in RUN_FILE_PATTERNS for p in glob.glob(os.path.join(folder, pattern))}
    return sorted(found)


def remove_previous_run(out_dir: str) -> list[str]:
    """Delete what an earlier run left (checkpoints, their checksums, metrics), so a new run never mixes
    with it. Returns the names removed."""
    names = previous_run_files(out_dir)
    for name in names:
        os.remove(os.path.join(out_dir, name))
    return names


# ----------------------------------------------------------------------------- checkpoints and checksums


class _HashingWriter:
    """A file wrapper that hashes what passes through it: the checksum costs no second read."""

    def __init__(self, f):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def checksum_path(path: str) -> str:
    return f"{path}.sha256"


def _fsync_folder(path: str) -> None:
    with contextlib.suppress(OSError):  # make a rename durable (POSIX)
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _temporary_file(tmp: str) -> Iterator[BinaryIO]:
    """Open tmp for writing and fsync it on success; on any error remove it and re-raise."""
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_atomically(path: str, data: bytes) -> None:
    """Write path.<pid>.tmp, fsync, rename over path: a crash leaves the old file or the new one."""
    tmp = f"{path}.{os.getpid()}.tmp"  # one per process: two writers never share a temporary file
    with _temporary_file(tmp) as f:
        f.write(data)
    os.replace(tmp, path)
    _fsync_folder(path)


def recorded_checksums(path: str) -> list[str]:
    """The SHA-256 digests listed in path.sha256 (sha256sum's format); [] when there is none."""
    try:
        with open(checksum_path(path), errors="replace") as f:
            return [line.split()[0] for line in f if line.strip()]
    except FileNotFoundError:
        return []
    except OSError as e:  # a folder, or unreadable
        raise ConfigError(f"cannot read the checksum file {checksum_path(path)} ({e.strerror or e}); restore it, "
                          "or start a new run with another --out_dir") from None


def _write_checksums(path: str, digests: list[str]) -> None:
    lines = "".join(f"{d}  {os.path.basename(path)}\n" for d in dict.fromkeys(digests))
    write_atomically(checksum_path(path), lines.encode())


def save_checkpoint(path: str, state: dict) -> None:
    """Write `state` to `path` with its SHA-256 in path.sha256, so that a crash at any moment leaves a
    checkpoint that matches its checksum (and at most a stale .tmp): the new digest joins the checksum
    file before the rename (either file under `path` then verifies) and the old one leaves after it."""
    tmp = f"{path}.tmp"
    with _temporary_file(tmp) as f:
        writer = _HashingWriter(f)
        torch.save(state, writer)
    digest = writer.sha256.hexdigest()
    try:
        _write_checksums(path, [digest, *recorded_checksums(path)])
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_folder(path)
    _write_checksums(path, [digest])


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint, then its checksum file (a kill between leaves only a stray .sha256)."""
    for name in (path, checksum_path(path)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)


def save_latest_checkpoint(out_dir: str, state: dict) -> None:
    """Save ckpt.pt; a ckpt_last.pt, now older, goes after it (resume takes ckpt_last.pt while it exists)."""
    save_checkpoint(os.path.join(out_dir, CHECKPOINT_NAME), state)
    remove_checkpoint(os.path.join(out_dir, LAST_CHECKPOINT_NAME))


def save_stop_checkpoint(out_dir: str, state: dict, keep_best: bool) -> str:
    """Save a stopped run's last iteration; returns the path. With keep_best (always_save_checkpoint=False:
    ckpt.pt holds the best evaluation) it goes to ckpt_last.pt, so the best is never replaced by it."""
    if not keep_best:
        save_latest_checkpoint(out_dir, state)
        return os.path.join(out_dir, CHECKPOINT_NAME)
    path = os.path.join(out_dir, LAST_CHECKPOINT_NAME)
    save_checkpoint(path, state)
    return path


def _file_sha256(f) -> str:
    sha256 = hashlib.sha256()
    while chunk := f.read(1 << 24):
        sha256.update(chunk)
    return sha256.hexdigest()


def load_checkpoint(path: str, device: str) -> dict:
    """A checkpoint whose bytes match its recorded SHA-256, then read with weights_only (no code runs)."""
    if not os.path.isfile(path):
        raise ConfigError(f"there is no checkpoint at {path}; train with init_from='scratch' first or fix --out_dir")
    try:
        digest, recorded, state = _verified_read(path, device)
    except OSError as e:
        raise ConfigError(f"cannot read checkpoint {path} ({e.strerror or e}); restore it, or start a new run "
                          "with another --out_dir") from None
    if state is not None:
        return state
    folder, name = os.path.split(path)
    if not recorded:
        what = "an empty checksum file" if os.path.exists(checksum_path(path)) else "no checksum file"
        raise ConfigError(f"checkpoint {path} has {what} {checksum_path(path)}, so its integrity cannot "
                          f"be verified. If you trust it, record its checksum with: cd {folder or '.'} && "
                          f"sha256sum {name} > {name}.sha256")
    raise ConfigError(f"checkpoint {path} does not match its checksum (SHA-256 {digest[:16]}..., recorded "
                      f"{recorded[0][:16]}... in {checksum_path(path)}): it was changed or corrupted after it was "
                      "written. Nothing was changed; restore it from a copy or start a new run with another --out_dir")


def _verified_read(path: str, device: str) -> tuple[str, list[str], dict | None]:
    """(the file's SHA-256, the recorded ones, the checkpoint if they match else None)."""
    for _ in range(3):  # a save that lands between reading the file and its checksum: read both again
        with open(path, "rb") as f:
            digest, inode = _file_sha256(f), os.fstat(f.fileno()).st_ino
            recorded = recorded_checksums(path)
            if digest in recorded:
                f.seek(0)
                return digest, recorded, _read_checkpoint(path, f, device)
        if os.stat(path).st_ino == inode:
            break
    return digest, recorded, None


def _read_checkpoint(path: str, f, device: str) -> dict:
    try:
        state = torch.load(f, map_location=device, weights_only=True)
    except Exception as e:  # a truncated zip, a text file, a pickle of other objects, ...
        why = ("weights-only loading refused its contents" if isinstance(e, pickle.UnpicklingError)  # long, off-topic
               else f"{type(e).__name__}: {' '.join(str(e).split())[:160]}")
        raise ConfigError(f"checkpoint {path} cannot be read ({why}); it may be truncated, or not a nanoNorm "
                          "checkpoint. Nothing was changed; restore it or start a new run with another --out_dir"
                          ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path} is not a nanoNorm checkpoint (no '{CHECKPOINT_FORMAT}' marker); nothing was changed")
    return state


def foreign_checkpoint(out_dir: str, error: Exception) -> ConfigError:
    """The error for a checkpoint whose checksum holds but whose contents this code cannot use."""
    what = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return ConfigError(f"the checkpoint in {out_dir} does not fit this version of nanoNorm ({type(error).__name__}: "
                       f"{what}): it was written by another version or changed after it was saved; use the version "
                       "that wrote it, or start a new run (--overwrite=True, or another --out_dir)")


# ----------------------------------------------------------------------------- metrics


def strict_json(value):
    """`value` with every non-finite float replaced by None: JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class MetricsLog:
    """metrics.jsonl: one JSON object per line, non-finite numbers as null. A fresh run starts it anew,
    a resumed run moves the lines past its checkpoint (and a line cut short by a kill) to metrics.jsonl.dropped,
    and drops the evaluation at its checkpoint's iteration if it evaluates there again (`reevaluates`).
    `lines` counts the lines written so far; a checkpoint records it, and a resumed run (`logged_lines`, that
    record) refuses a log that has lost some of them since, unless it is empty (the user chose to go on
    without the history)."""

    def __init__(self, out_dir: str, enabled: bool, resume_iter: int | None = None, reevaluates: bool = True,
                 logged_lines: int | None = None):
        self.path, self.enabled = os.path.join(out_dir, METRICS_NAME), enabled
        self.checkpoint_path = os.path.join(out_dir, CHECKPOINT_NAME)
        self.lines, self.moved = 0, None  # moved: what a resumed run moved aside, in words
        self.mirror: Callable[[dict], None] | None = None  # also gets every line written (WandbRun)
        if enabled and resume_iter and not os.path.lexists(self.path):
            raise ConfigError(f"{self.path} is missing, so the resumed run's log would start at iter {resume_iter} "
                              f"without its history; restore it, or create an empty one (touch {self.path}) to go "
                              "on without it")
        if not enabled or not os.path.exists(self.path):
            return
        if resume_iter is None:
            os.remove(self.path)
            return
        try:
            with open(self.path, "rb") as f:
                lines = f.readlines()
            places = [self._place(line) for line in lines]
            # the lines the checkpoint's save came after: before its iteration, and that iteration's train line
            # (its evaluation is logged after the save)
            history = sum(p is not None and (p[0] < resume_iter or p == (resume_iter, "train")) for p in places)
            if lines and logged_lines is not None and history < logged_lines:
                raise ConfigError(f"{self.path} holds {history} lines up to iter {resume_iter}, but it held "
                                  f"{logged_lines} when the checkpoint was saved: it was cut short or edited since. "
                                  "Restore it, or empty it (: > FILE) to go on without its history")
            kept_there = ("train",) if reevaluates else ("train", "eval")  # the resumed run logs the rest again
            kept = [line for line, p in zip(lines, places, strict=True)
                    if p is not None and (p[0] < resume_iter or p[0] == resume_iter and p[1] in kept_there)]
            later = [line.rstrip(b"\n") + b"\n" for line, p in zip(lines, places, strict=True)
                     if p is None or p[0] > resume_iter]
            if later:  # e.g. evaluations after the best one, which ckpt.pt holds (always_save_checkpoint=False)
                with open(self.path + ".dropped", "ab") as f:
                    f.writelines(later)
                iters = [p[0] for p in places if p is not None and p[0] > resume_iter]
                span = f" (iters {min(iters)}-{max(iters)})" if iters else ""
                self.moved = (f"{METRICS_NAME}: moved {len(later)} lines past iter {resume_iter}{span} to "
                              f"{self.path}.dropped: this run goes on from the checkpoint at iter {resume_iter}")
            with open(self.path + ".tmp", "wb") as f:
                f.writelines(kept)
            os.replace(self.path + ".tmp", self.path)
            self.lines = len(kept)
        except OSError as e:  # a folder, or unreadable
            raise ConfigError(f"cannot rewrite {self.path} for the resumed run ({e.strerror or e}); move it "
                              "aside or fix its permissions") from None

    @staticmethod
    def _place(line: bytes) -> tuple[int, object] | None:
        """(iter, kind) of one line; None for a line that is not a JSON object with an integer iter (cut short
        by a kill mid-write, or corrupted): a resumed run drops it. A line without iter counts as iter 0."""
        try:
            record = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            return None
        it = record.get("iter", 0) if isinstance(record, dict) else None
        if not isinstance(it, int) or isinstance(it, bool):
            return None
        return it, record.get("kind")

    def write(self, **record) -> None:
        if not self.enabled:
            return
        record = strict_json(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        self.lines += 1
        if self.mirror is not None:
            self.mirror(record)


# ----------------------------------------------------------------------------- the code and wandb


def code_version(where: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) -> str | None:
    """The commit of the checkout at `where` (default: this code's), with "+dirty" when tracked files differ from
    it: run.json and wandb record it so that a result can be traced to the code that made it. None outside a git
    checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", where, *args], capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


class WandbRun:
    """The train and eval lines of metrics.jsonl (the same dicts), logged to a wandb run too: a live view of a run
    (wandb_project; rank 0 only). Its files go to out_dir/wandb; WANDB_MODE=offline writes them without a network
    (`wandb sync` uploads them later). The wandb config is the run's settings and its commit; a resumed run goes on
    in the wandb run its first start opened (the id in out_dir/wandb/latest-run). wandb is imported only here."""

    def __init__(self, out_dir: str, project: str, group: str, config: dict, resumed: bool):
        import wandb

        latest = os.path.join(out_dir, "wandb", "latest-run")
        run_id = os.readlink(latest).rsplit("-", 1)[-1] if resumed and os.path.islink(latest) else None
        self.run = wandb.init(project=project, group=group or None, name=os.path.basename(os.path.normpath(out_dir)),
                              dir=out_dir, id=run_id, resume="allow" if run_id else None,
                              config=strict_json({**config, "commit": code_version()}))

    def __call__(self, record: dict) -> None:
        if record.get("kind") in ("train", "eval"):
            self.run.log(record)

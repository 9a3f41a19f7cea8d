"""
The files of a run in its out_dir, and the rules that keep them from lying:

    .lock             held (flock) by the one run writing this folder; the kernel releases it however the run ends
    ckpt.pt           the last checkpoint (always_save_checkpoint=False: the best evaluation's), written atomically
    ckpt.pt.sha256    its SHA-256 (`sha256sum -c ckpt.pt.sha256` checks it), verified on every load
    ckpt_last.pt      always_save_checkpoint=False only: a stop signal's save, kept while it is newer than ckpt.pt
    ckpt_<iter>.pt    kept checkpoints (keep_every), each with its own .sha256
    metrics.jsonl     one strict JSON object per line; a non-finite number is written as null
    metrics.jsonl.dropped, dropped_after_iter_<N>/
                      what a resume that went back to iteration N moved aside: later log lines, later kept checkpoints

A run deletes only these names (exact names, RUN_FILE and DROPPED_FOLDER, not patterns), and a new run names all
it would delete before it deletes any. Before every write the run checks that out_dir's .lock is still the one it
holds (check_out_dir_is_ours): a folder deleted or replaced under it is never written into. A write that fails
(a full disk) is RunFileUnwritable, which names the file, the checkpoint kept, and how to go on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import pickle
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from typing import BinaryIO

import torch

from nanonorm.train_config import ConfigError

CHECKPOINT_FORMAT = "nanonorm-checkpoint-v1"
LOCK_NAME, METRICS_NAME, CHECKPOINT_NAME, LAST_CHECKPOINT_NAME = ".lock", "metrics.jsonl", "ckpt.pt", "ckpt_last.pt"
# every name a run writes in out_dir (besides .lock): its checkpoints and their checksums, their temporary files
# (save_checkpoint's <ckpt>.tmp, write_atomically's <ckpt>.sha256.<pid>.tmp), metrics.jsonl and what a resume
# rewrites or moves aside; a resume that goes back moves later kept checkpoints to a DROPPED_FOLDER
_ITER = r"(?:0|[1-9][0-9]*)"
_CHECKPOINT = rf"ckpt(?:_last|_{_ITER})?\.pt"
KEPT_CHECKPOINT = re.compile(rf"ckpt_({_ITER})\.pt")
RUN_FILE = re.compile(rf"{_CHECKPOINT}(?:\.sha256)?|{_CHECKPOINT}\.tmp|{_CHECKPOINT}\.sha256\.[0-9]+\.tmp"
                      r"|metrics\.jsonl(?:\.dropped|\.tmp)?")
DROPPED_FOLDER = re.compile(rf"dropped_after_iter_{_ITER}(?:\.[1-9][0-9]*)?")
DROPPED_FILE = re.compile(rf"ckpt_{_ITER}\.pt(?:\.sha256(?:\.[0-9]+\.tmp)?)?")  # what a DROPPED_FOLDER holds


# ----------------------------------------------------------------------------- the out_dir lock


class OutDirInUse(ConfigError):
    """Another process holds the out_dir's lock."""


class OutDirReplaced(RuntimeError):
    """The out_dir whose lock this process holds was deleted or replaced (its .lock is gone or another file):
    writing on would put this run's files into a folder that is no longer its own, or another run's."""


HELD_LOCKS: dict[str, tuple[int, int]] = {}  # out_dir (absolute) -> (device, inode) of the .lock this process holds


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_out_dir_is_ours(folder: str) -> None:
    """Raise OutDirReplaced if folder's lock, held by this process, is no longer the folder's .lock. Called before
    every write of a run: the flock stays on the deleted file's inode, so it cannot keep a new folder's runs out."""
    folder = os.path.abspath(folder)
    held = HELD_LOCKS.get(folder)
    if held is not None and _identity(os.path.join(folder, LOCK_NAME)) != held:
        raise OutDirReplaced(f"{folder} was deleted or replaced while this run was writing it (its {LOCK_NAME} is "
                             "not the one this run holds): stopped without writing anything more there; what this run "
                             "wrote before went with the old folder (deleted, or moved away)")


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
        st = os.fstat(self.fd)
        self.folder, self.identity = os.path.abspath(out_dir), (st.st_dev, st.st_ino)
        HELD_LOCKS[self.folder] = self.identity

    def is_current(self) -> bool:
        """Whether out_dir's .lock is still the file this lock holds (the folder was not deleted or replaced)."""
        return _identity(self.path) == self.identity

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None
            if HELD_LOCKS.get(self.folder) == self.identity:
                del HELD_LOCKS[self.folder]

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
    """What an earlier run left in out_dir: the names a run writes (RUN_FILE: checkpoints, checksums, metrics,
    temporary files) and its DROPPED_FOLDERs, sorted. A name a run never writes (metrics.jsonl.bak, a copy named
    ckpt_best.pt) is the user's, and not listed."""
    try:
        names = os.listdir(out_dir)
    except OSError:  # no folder yet
        return []
    return sorted(n for n in names if RUN_FILE.fullmatch(n) or DROPPED_FOLDER.fullmatch(n))


def foreign_files(out_dir: str, names: list[str]) -> tuple[list[str], list[str]]:
    """Among an earlier run's names, what a new run cannot delete as a run's files: (folders named like a run's
    file, what a DROPPED_FOLDER holds that a run does not write there, or a file in its place: paths in out_dir)."""
    folders, foreign = [], []
    for name in names:
        path = os.path.join(out_dir, name)
        if DROPPED_FOLDER.fullmatch(name):
            inside = os.listdir(path) if os.path.isdir(path) else [""]
            foreign += [os.path.join(name, n) for n in inside
                        if not DROPPED_FILE.fullmatch(n) or not os.path.isfile(os.path.join(path, n))]
        elif os.path.isdir(path):
            folders.append(name)
    return folders, sorted(foreign)


def remove_previous_run(out_dir: str) -> list[str]:
    """Delete what an earlier run left (previous_run_files: checkpoints, checksums, metrics, the checkpoints a resume
    moved aside), so a new run never mixes with it. Returns the names removed."""
    check_out_dir_is_ours(out_dir)
    names = previous_run_files(out_dir)
    for name in names:
        path = os.path.join(out_dir, name)
        if DROPPED_FOLDER.fullmatch(name):  # only the files a run put there (foreign_files refused the others)
            for inside in os.listdir(path):
                if DROPPED_FILE.fullmatch(inside):
                    os.remove(os.path.join(path, inside))
            os.rmdir(path)
        else:
            os.remove(path)
    return names


def move_dropped_checkpoints(out_dir: str, iteration: int) -> str | None:
    """A resume from `iteration`: move the kept checkpoints past it (ckpt_<N>.pt, N > iteration, with their
    checksums: the branch this resume abandons) into a new folder dropped_after_iter_<iteration> (.2, .3, ... when
    that name is taken), so that none is replaced by, or mixed with, the branch that goes on. Returns the folder,
    or None when there was nothing to move."""
    later = sorted((int(m.group(1)), m.group(0)) for m in map(KEPT_CHECKPOINT.fullmatch, os.listdir(out_dir))
                   if m and int(m.group(1)) > iteration)
    if not later:
        return None
    check_out_dir_is_ours(out_dir)
    base = os.path.join(out_dir, f"dropped_after_iter_{iteration}")
    folder, k = base, 1
    while os.path.lexists(folder):
        k += 1
        folder = f"{base}.{k}"
    os.mkdir(folder)
    for _, name in later:  # checksum copied, checkpoint moved, checksum removed: a kill leaves each verifiable
        path, checksum = os.path.join(out_dir, name), checksum_path(os.path.join(out_dir, name))
        if os.path.isfile(checksum):
            with open(checksum, "rb") as f:
                write_atomically(checksum_path(os.path.join(folder, name)), f.read())
        os.replace(path, os.path.join(folder, name))
        with contextlib.suppress(FileNotFoundError):
            os.remove(checksum)
    _fsync_folder(os.path.join(folder, name))  # the names that arrived in folder
    _fsync_folder(folder)  # and those that left out_dir
    return folder


# ----------------------------------------------------------------------------- checkpoints and checksums


class RunFileUnwritable(OSError):
    """A run's file could not be written (a full disk, a quota, an I/O error): one line names it, the checkpoint
    that is kept and how to go on; train.py exits with EXIT_NO_SPACE."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def last_checkpoint(out_dir: str) -> str | None:
    """The checkpoint a resume would start from (resume.checkpoint_to_load), if there is one."""
    return next((path for name in (LAST_CHECKPOINT_NAME, CHECKPOINT_NAME)
                 if os.path.isfile(path := os.path.join(out_dir, name))), None)


def unwritable(path: str, error: OSError) -> RunFileUnwritable:
    """The error for a run's file that could not be written: which, why, what is kept, and how to go on."""
    full = error.errno in NO_SPACE
    what = f"no space left on {path}" if full else f"cannot write {path} ({error.strerror or error})"
    fix = "free space on its disk" if full else "fix the cause"
    kept = last_checkpoint(os.path.dirname(path) or ".")
    go_on = (f"the last complete checkpoint, {kept}, is kept: {fix}, then continue with --init_from=resume" if kept
             else f"no checkpoint had been written: {fix}, then start the run again with --overwrite=True")
    found = RunFileUnwritable(f"{what}; {go_on}")
    found.errno = error.errno
    return found


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """Any OSError while path is written, as RunFileUnwritable."""
    try:
        yield
    except RunFileUnwritable:
        raise
    except OSError as e:
        raise unwritable(path, e) from None


class _HashingWriter:
    """A file wrapper that hashes what passes through it: the checksum costs no second read. A write's error is
    kept: torch's zip writer reports it as its own ("unexpected pos ...")."""

    def __init__(self, f):
        self.f, self.sha256, self.error = f, hashlib.sha256(), None

    def write(self, data) -> int:
        self.sha256.update(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

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
    file before the rename (either file under `path` then verifies) and the old one leaves after it. A write that
    fails (a full disk) leaves the previous checkpoint and no temporary file, and is raised as RunFileUnwritable."""
    check_out_dir_is_ours(os.path.dirname(path) or ".")
    with _writing(path):
        _save_verifiable(path, state)


def _save_verifiable(path: str, state: dict) -> None:
    tmp = f"{path}.tmp"
    with _temporary_file(tmp) as f:
        writer = _HashingWriter(f)
        try:
            torch.save(state, writer)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None
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
    check_out_dir_is_ours(os.path.dirname(path) or ".")
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
    """torch.load onto `device`. An error is the file's only if the file does not read on the CPU either: a device
    that cannot take it (out of its memory) or a machine out of memory is named as such, not as a damaged file."""
    location = "cpu" if torch.device(device).type == "cpu" else device  # torch.load maps "cpu" only, not "cpu:0"
    try:
        state = torch.load(f, map_location=location, weights_only=True)
    except Exception as e:  # a truncated zip, a text file, a pickle of other objects, ...
        why = ("weights-only loading refused its contents" if isinstance(e, pickle.UnpicklingError)  # long, off-topic
               else f"{type(e).__name__}: {' '.join(str(e).split())[:160]}")
        if isinstance(e, MemoryError) or "alloc" in str(e).lower() and location == "cpu":
            raise ConfigError(f"there is not enough memory to read checkpoint {path} ({why}); the file is not at "
                              "fault and nothing was changed: free memory and run again") from None
        if location != "cpu" and _reads_on_the_cpu(f):
            raise ConfigError(f"checkpoint {path} matches its checksum and reads on the CPU, but cannot be loaded "
                              f"onto {device} ({why}); the file is not at fault and nothing was changed: free that "
                              "device's memory, or use another --device") from None
        raise ConfigError(f"checkpoint {path} cannot be read ({why}); it may be truncated, or not a nanoNorm "
                          "checkpoint. Nothing was changed; restore it or start a new run with another --out_dir"
                          ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path} is not a nanoNorm checkpoint (no '{CHECKPOINT_FORMAT}' marker); nothing was changed")
    return state


def _reads_on_the_cpu(f) -> bool:
    f.seek(0)
    try:
        torch.load(f, map_location="cpu", weights_only=True)
    except Exception:
        return False
    return True


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
        if enabled:
            check_out_dir_is_ours(out_dir)
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
            if e.errno in NO_SPACE:
                raise unwritable(self.path, e) from None
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
        check_out_dir_is_ours(os.path.dirname(self.path))
        with _writing(self.path), open(self.path, "a") as f:
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

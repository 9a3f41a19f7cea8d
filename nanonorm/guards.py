"""
What a run guarantees when something goes wrong, on one process or many: every rank reaches the same
verdict and stops at the same iteration with the same exit code, and no checkpoint is written from
non-finite state.

Exit codes: 0 done, 1 crash (an uncaught error, or a rank that waited dist_timeout seconds for the
others: LostRanks), 2 bad config or input (ConfigError), 3 diverged: a non-finite loss or parameter;
metrics.jsonl then ends with {"kind": "status", "status": "diverged", "iter": N, ...} and the last
checkpoint, written from finite state only, is kept. Every rank reaches that verdict from all-reduced
values, so all stop together (torchrun itself then exits 1 and names exit code 3 as the root cause).
The step loop has no extra host sync: the first non-finite iteration is kept on the device and read at
log and eval iterations (check_in).

With skip_nonfinite=N (this project's option; neither Bir et al.'s paper nor the latest version of their
released code skips) a batch whose loss or gradient is not finite is skipped instead (no update; a finite
loss can still back-propagate an overflow, so the gradient norm is checked too; one host sync per step),
up to N times before the run counts as diverged; non-finite parameters still stop it at once, and so does
a non-finite eval loss at the end of the run or after an interval in which every step was skipped
(eval_divergence). No checkpoint is written from a state whose eval loss is not finite.

Exit code 4: stopped by SIGTERM, SIGINT or SIGHUP (StopSignals), the last completed iteration saved and
{"kind": "status", "status": "stopped", ...} logged; one process checks after every iteration, several
agree at the next log line (in the all-reduce they do there anyway). The last checkpoint is kept instead
when that state may be poisoned (batches skipped as non-finite since the last evaluation); a stop during
the setup ends the run before its first iteration, with nothing written. A second SIGINT stops at once:
exit code 130; during a checkpoint save it waits for the save to complete (a save is never cut half-way), and
during the stop's own save the run ends with exit code 4 as planned.

Exit code 5: out_dir was deleted or replaced while the run wrote it (run_files.check_out_dir_is_ours); it stops
at its next write, writing nothing more. Exit code 6: a run's file could not be written (a full disk:
run_files.RunFileUnwritable); one line names it, the checkpoint kept and how to go on. An update whose step size
float32 cannot hold (optimizer_step) is a divergence, exit 3. A closed stdout (`train.py | head`) stops the
printing, not the run (output_survives_its_reader).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig
from nanonorm.diagnostics import block_activation_rms
from nanonorm.run_files import MetricsLog, OutDirLock, OutDirReplaced, RunFileUnwritable, save_stop_checkpoint
from nanonorm.train_config import ConfigError, TrainConfig, resolve_device

T = TypeVar("T")
EXIT_CONFIG, EXIT_DIVERGED, EXIT_STOPPED, EXIT_OUT_DIR_GONE, EXIT_NO_SPACE = 2, 3, 4, 5, 6
EXIT_INTERRUPTED = 130  # a second SIGINT: the shell's code for "ended by SIGINT"
NEVER = torch.iinfo(torch.int64).max  # "no non-finite loss yet"


# ----------------------------------------------------------------------------- exit codes


def exit_code(run: Callable[[], int]) -> int:
    """run()'s exit code; for an error that ends it, one line on stderr and its exit code: ConfigError 2,
    OutDirReplaced 5, RunFileUnwritable 6, a second SIGINT 130, LostRanks 1. The process group, if any, is closed
    either way; a closed stdout or stderr ends neither the run nor this (output_survives_its_reader)."""
    with output_survives_its_reader():
        try:
            return run()
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_CONFIG
        except KeyboardInterrupt as e:  # a second SIGINT, or one before the run's handlers were installed
            when = e.args[0] if e.args else "without a checkpoint of the current iteration"
            print(f"interrupted by SIGINT: stopped at once, {when}", file=sys.stderr)
            return EXIT_INTERRUPTED
        except (LostRanks, OutDirReplaced, RunFileUnwritable) as e:
            print(f"error: {e}", file=sys.stderr)
            return {LostRanks: 1, OutDirReplaced: EXIT_OUT_DIR_GONE}.get(type(e), EXIT_NO_SPACE)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class _ReaderGone:
    """sys.stdout or sys.stderr, whose reader may go (`train.py | head`, a closed terminal) or whose file may not
    take more (a full disk): the first write that fails points the stream's descriptor at /dev/null, so that nothing
    after it fails, the interpreter's last flush included, and says so once on the other stream."""

    def __init__(self, stream, other: Callable[[], object]):
        self._stream, self._other, self.gone = stream, other, False

    def write(self, text: str) -> int:
        if not self.gone:
            with self._reader_may_be_gone():
                return self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            with self._reader_may_be_gone():
                self._stream.flush()

    @contextlib.contextmanager
    def _reader_may_be_gone(self) -> Iterator[None]:
        try:
            yield
        except OSError as e:  # EPIPE: the reader closed its end; EIO: the terminal has gone; ENOSPC: a full disk
            self.gone = True
            with contextlib.suppress(OSError, ValueError):  # a stream without a descriptor (a test's capture)
                os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
            name = getattr(self._stream, "name", "output")
            print(f"cannot write to {name} any more ({e.strerror or e}): the run goes on without printing there; "
                  "metrics.jsonl has its log", file=self._other())

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def output_survives_its_reader() -> Iterator[None]:
    """A reader that closes stdout or stderr early stops the printing there, not the run: it trains on, saves and
    logs as usual, without a BrokenPipeError traceback (sweep.py and sample.py, which only print, end instead)."""
    stdout, stderr = sys.stdout, sys.stderr
    if stdout is not None:  # None: started with the descriptor closed (`>&-`), where print writes nothing
        sys.stdout = _ReaderGone(stdout, lambda: sys.stderr)
    if stderr is not None:
        sys.stderr = _ReaderGone(stderr, lambda: sys.stdout)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        sys.stdout, sys.stderr = stdout, stderr


# ----------------------------------------------------------------------------- processes


@dataclass
class Dist:
    """This process's place among the ranks (rank 0 of 1 without torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_distributed(cfg: TrainConfig) -> tuple[Dist, str]:
    """Start the process group under torchrun and pick this rank's device."""
    device = resolve_device(cfg.device)
    if "RANK" not in os.environ:
        return Dist(), device
    ddp = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    backend = "nccl" if device.startswith("cuda") and dist.is_nccl_available() else "gloo"
    if device.startswith("cuda"):
        device = f"cuda:{ddp.local_rank}"
        torch.cuda.set_device(device)
    # device_id binds NCCL's communicator to this rank's GPU now, not at the first collective
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=cfg.dist_timeout),
                            device_id=torch.device(device) if backend == "nccl" else None)
    return ddp, device


def all_ranks(t: torch.Tensor, ddp: Dist, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce in place (a no-op on one process), so every rank acts on the same value."""
    if ddp.world_size > 1:
        dist.all_reduce(t, op=op)
    return t




def agreed(action: Callable[[], T], device: str, what: str) -> T:
    """action() on every rank (often rank 0's alone does anything); a ConfigError on any rank stops them all
    with exit 2, so that none is left waiting in a collective for a rank that has gone."""
    result, error = None, None
    try:
        result = action()
    except ConfigError as e:
        error = e
    ok = torch.tensor(float(error is None), device=device)
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise error or ConfigError(f"rank 0 could not {what} (see its message)")
    return result


@contextlib.contextmanager
def claim_out_dir(out_dir: str, ddp: Dist, device: str) -> Iterator[None]:
    """Rank 0 holds out_dir's lock for the whole run; every rank learns whether it got it, so all stop together."""
    created = not os.path.exists(out_dir)
    lock = agreed(lambda: OutDirLock(out_dir) if ddp.master else None, device, f"claim out_dir {out_dir!r}")
    try:
        yield
    finally:
        if lock is not None:  # a run that wrote nothing leaves no folder it created (none that replaced it)
            if created and lock.is_current() and os.listdir(out_dir) == [os.path.basename(lock.path)]:
                os.remove(lock.path)
                with contextlib.suppress(OSError):
                    os.rmdir(out_dir)
            lock.release()


class LostRanks(RuntimeError):
    """A collective failed: another rank stalled past dist_timeout, or ended. exit_code prints one line, exit 1."""


# how gloo reports a rank that stalled past dist_timeout ("Timed out waiting ...", or "Application timeout
# caused pair closure" from an async all-reduce's wait) and one that ended ("Connection closed/reset by peer")
STALLED_SIGNS, ENDED_SIGNS = ("timed out", "timeout caused pair closure"), ("closed by peer", "reset by peer")


def lost_ranks(error: RuntimeError, cfg: TrainConfig, ddp: Dist, stop: StopSignals) -> LostRanks | None:
    """What a failed collective means for the user, or None for an error of another kind (NCCL's watchdog
    ends the process itself, with its own message)."""
    what = " ".join(str(error).split())[:200]
    if any(sign in what.lower() for sign in STALLED_SIGNS):
        return LostRanks(f"rank {ddp.rank} waited more than dist_timeout={cfg.dist_timeout:g}s for the other ranks: "
                         "one of them stalled (hung I/O, a stuck device) or died. The last checkpoint is kept; fix "
                         "the cause and continue with --init_from=resume, or raise --dist_timeout if a step can "
                         f"legitimately take that long ({what})")
    if any(sign in what.lower() for sign in ENDED_SIGNS):
        return LostRanks(f"rank {ddp.rank} lost its connection to another rank, which ended (killed, out of memory, "
                         "or an error: see that rank's output). The last checkpoint is kept; continue with "
                         f"--init_from=resume ({what})")
    if stop.received:  # torchrun sends SIGTERM to the others when a rank ends: they cannot reach a common stop
        return LostRanks(f"rank {ddp.rank} got {stop.received}, but another rank had ended already ({what}); "
                         "the last checkpoint is kept")
    return None


@contextlib.contextmanager
def lost_ranks_named(cfg: TrainConfig, ddp: Dist, stop: StopSignals) -> Iterator[None]:
    """A collective that failed because another rank stalled or ended is raised as LostRanks, which says so."""
    try:
        yield
    except RuntimeError as e:
        lost = lost_ranks(e, cfg, ddp, stop) if ddp.world_size > 1 else None
        if lost is None:
            raise
        raise lost from None


# ----------------------------------------------------------------------------- stop signals


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
    """SIGTERM (sent before preemption by SLURM and Kubernetes, and forwarded by torchrun), SIGINT and SIGHUP (a
    closed terminal, to its whole process group) ask the loop to stop after the current iteration with a checkpoint
    of it; a second SIGINT stops at once (KeyboardInterrupt). A signal the process was started ignoring (nohup, a
    background job of a script) stays ignored. The previous handlers come back when the run ends."""

    def __init__(self):
        self.received: str | None = None
        self.saving = False  # a checkpoint is being written: a second SIGINT waits for it
        self.deferred = False  # a second SIGINT came during a save
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python handles signals only there
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS
                              if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            if self.saving:  # a KeyboardInterrupt inside torch.save would leave neither file complete
                self.deferred = True
                return
            raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name

    @contextlib.contextmanager
    def saving_first(self) -> Iterator[None]:
        """A second SIGINT during the block (a checkpoint save) stops the run once the block has completed."""
        outer, self.saving = self.saving, True
        try:
            yield
        finally:
            self.saving = outer
        if self.deferred and not outer:
            raise KeyboardInterrupt("after completing the checkpoint save that was in progress")


def stopped_during_setup(stop: StopSignals, ddp: Dist, device: str) -> bool:
    """Whether any rank was asked to stop during the setup (a long one: data, model, compile); rank 0 then says
    that the run ends before its first iteration, with nothing written."""
    if not all_ranks(torch.tensor(float(stop.received is not None), device=device), ddp).item():
        return False
    if ddp.master:
        print(f"{stop.received or 'a stop signal on another rank'}: stopped during setup, before the first "
              "iteration; nothing was changed", file=sys.stderr)
    return True


def stop_with_checkpoint(log: MetricsLog, ddp: Dist, stop: StopSignals, iteration: int, state: dict | None,
                         cfg: TrainConfig, unsaved: str | None = None) -> int:
    """Save the last completed iteration (state; None, and `unsaved` saying why, when it must not be saved) and
    log the stop. Every rank calls this at the same iteration; rank 0 writes. The run is ending: a second SIGINT
    from here on is let through neither into the save nor past it (the exit code says the iteration was saved)."""
    stop.saving = True
    if ddp.master:
        if state is not None:
            path = save_stop_checkpoint(cfg.out_dir, state, keep_best=not cfg.always_save_checkpoint)
        saved = f"saved iter {iteration} to {path}" if state else f"{unsaved}, so the last checkpoint is kept"
        print(f"{stop.received or 'a stop signal on another rank'}: stopped after iter {iteration}; {saved}. "
              "Continue with --init_from=resume", file=sys.stderr)
        log.write(kind="status", status="stopped", iter=iteration, signal=stop.received, saved=state is not None)
    if ddp.world_size > 1:  # torchrun stops every rank once one exits: let rank 0 write first
        dist.barrier()
    return EXIT_STOPPED


# ----------------------------------------------------------------------------- divergence


def nonfinite_state(model: GPT, optimizer) -> list[str]:
    """Names of parameters (and optimizer states) holding a NaN or inf; [] when all is finite."""
    tensors = dict(model.named_parameters())
    names = {p: n for n, p in tensors.items()}
    for p, state in optimizer.state.items():
        tensors.update({f"{names.get(p, '?')} ({k})": t for k, t in state.items()
                        if torch.is_tensor(t) and t.is_floating_point()})
    device = next(model.parameters()).device
    finite = torch.stack([torch.isfinite(t).all().to(device) for t in tensors.values()]).tolist()
    return [name for name, ok in zip(tensors, finite, strict=True) if not ok]


def batch_is_finite(loss_sum: torch.Tensor, grad_norm: torch.Tensor, scaler) -> torch.Tensor:
    """1.0 when the batch's loss and gradients are finite, else 0.0. A finite loss can still back-propagate
    an overflow; its update would put inf or NaN into the weights. (fp16's loss scaler skips such
    steps itself and lowers its scale, so there only the loss counts.)"""
    finite = loss_sum.isfinite()
    if not scaler.is_enabled():
        finite = finite & grad_norm.isfinite()
    return finite.float()


def check_in(first_bad: torch.Tensor, stop: StopSignals, ddp: Dist) -> tuple[int | None, bool]:
    """The earliest iteration, over all ranks, whose training loss was not finite, and whether any rank was
    asked to stop: one all-reduce and one host sync, so that every rank acts on the same answer."""
    state = torch.stack([first_bad, torch.tensor(-int(stop.received is not None), device=first_bad.device)])
    bad, stop_flag = all_ranks(state, ddp, dist.ReduceOp.MIN).tolist()
    return (None if bad == NEVER else bad), stop_flag < 0


def eval_divergence(cfg: TrainConfig, finite: bool, at_end: bool, steps: int, skips: int) -> str | None:
    """Why a non-finite eval loss ends the run, or None (a finite loss, or skip_nonfinite may still recover).
    `steps` iterations ran since the previous evaluation and `skips` of them were skipped."""
    if finite:
        return None
    if not cfg.skip_nonfinite:
        return "non-finite eval loss or state"
    if at_end:
        return "non-finite eval loss at the end of the run"
    if steps and skips == steps:  # the weights cannot change any more
        return f"non-finite eval loss, and all {steps} steps since the last evaluation skipped"
    return None


def diverged_at_eval(cfg: TrainConfig, finite: bool, at_end: bool, steps: int, skips: int, model: GPT, optimizer,
                     ddp: Dist, device: str) -> str | None:
    """Why the run ends as diverged at this evaluation (a non-finite loss, or weights or optimizer state), agreed by
    every rank; None if it goes on."""
    reason = eval_divergence(cfg, finite, at_end, steps, skips)
    bad = reason is not None or bool(nonfinite_state(model, optimizer))
    if all_ranks(torch.tensor(float(bad), device=device), ddp).item():
        return reason or "non-finite eval loss or state"
    return None


def report_divergence(log: MetricsLog, ddp: Dist, iteration: int, reason: str, model: GPT, optimizer,
                      inputs: torch.Tensor) -> int:
    """Say where the run blew up: the non-finite parameters, or, while they are all still finite, the
    first block whose output is non-finite on `inputs`. Every rank calls this, rank 0 reports."""
    if ddp.master:
        bad = nonfinite_state(model, optimizer)
        if bad:  # one non-finite loss reaches every weight through the backward and the step
            more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
            block, where = None, f"; non-finite: {', '.join(bad[:4])}{more}"
        else:
            rms = block_activation_rms(model, inputs)  # in eval mode
            block = next((i for i, r in enumerate(rms) if not math.isfinite(r)), None)
            where = f"; activations first non-finite after block {block}" if block is not None else ""
        kept = ("the last checkpoint, written from finite state, is kept" if os.path.exists(log.checkpoint_path)
                else "no checkpoint had been written")
        print(f"diverged at iter {iteration}: {reason}{where}. Stopped; {kept}", file=sys.stderr)
        log.write(kind="status", status="diverged", iter=iteration, reason=reason, block=block,
                  nonfinite=bad[:8], n_nonfinite=len(bad))
    if ddp.world_size > 1:  # torchrun stops every rank once one exits: let rank 0 write first
        dist.barrier()
    return EXIT_DIVERGED


def optimizer_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """scaler.step(optimizer); False if the update's step size is more than float32 holds (a learning rate that
    float32 holds, divided by Adam's bias correction or times Muon's scale): an update that large is infinite,
    a divergence caused by the rate, which the caller reports."""
    try:
        scaler.step(optimizer)
    except RuntimeError as e:  # c10's words for a Python number that does not fit the tensor's dtype
        if "without overflow" not in str(e):
            raise
        return False
    return True


# ----------------------------------------------------------------------------- memory


MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}  # user settings reuse_freed_memory keeps


def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep freed CPU memory for reuse; True if it now does.

    By default glibc gives each block above a self-adjusting threshold (128 KiB, rising up to 32 MiB)
    its own mmap, unmaps it when freed and trims the heap's free top, so the activation and gradient
    tensors a CPU step allocates afresh are page-faulted in again every step (at the CPU bench shape
    2,100 to 13,200 faults and 2 to 26 ms of kernel time per step; see docs/speed.md). Fixing both
    thresholds keeps blocks up to 32 MiB (glibc's maximum) on the heap and the heap from shrinking, so
    freed memory is reused; the price is that the process keeps its peak heap size. No effect on GPU
    memory (torch caches that itself), outside Linux with glibc, or where MALLOC_MMAP_THRESHOLD_ or
    MALLOC_TRIM_THRESHOLD_ is set (the user's choice stands).
    """
    if not sys.platform.startswith("linux") or MALLOC_SETTINGS & os.environ.keys():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


@contextlib.contextmanager
def out_of_memory_named(config: GPTConfig, device: str) -> Iterator[None]:
    """A model too large for the device: a ConfigError that says so (torch.OutOfMemoryError on a GPU, an
    allocator's RuntimeError on the CPU), not a traceback."""
    try:
        yield
    except RuntimeError as e:
        if "out of memory" not in str(e) and "allocate" not in str(e):
            raise
        raise ConfigError(f"the model (n_layer={config.n_layer}, n_embd={config.n_embd}, vocab_size="
                          f"{config.vocab_size}) does not fit in {device}'s memory; make it smaller") from None


# torch 2.13 renamed DDP's broadcast_buffers (deprecated since) to forward_sync_buffers; older torch has only the first
NO_BUFFER_SYNC = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
    else "broadcast_buffers"

"""
Train a nanoNorm GPT: one loop for one CPU, one GPU, or many GPUs and nodes.

    python train.py configs/quickstart.py                       # CPU or one GPU
    python train.py configs/quickstart.py --n_layer=2 --compile=True
    torchrun --standalone --nproc_per_node=8 train.py configs/geonorm_125m.py
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 \\
        --nproc_per_node=8 train.py configs/geonorm_125m.py     # then node_rank=1 on the other

A config file is Python assignments (`n_layer = 6`); `--key=value` overrides it. Every key is
a field of `train_config.TrainConfig` or of `model.GPTConfig`; anything else stops with a message.

Reproducibility: micro-batch k of iteration i (k counts over all ranks) sees data and dropout
masks that depend only on (seed, i, k): its window is drawn from that seed and the global RNG is
re-seeded from it before its forward. A checkpoint holds the model, the optimizer state (every
optimizer here keeps its full state on rank 0), the GradScaler and the iteration, so a run
killed at any moment and resumed with --init_from=resume continues bitwise as if never stopped.
Resuming with another number of processes also sees the same batches and masks; only float
summation order changes (gradients summed by all-reduce instead of accumulated locally, and the
logged loss likewise), so losses then agree to rounding (~1e-6 relative), not bitwise. On
resume the config's hyperparameters (learning rate, weight decay, ...) apply; the architecture
is the checkpoint's and may not be changed, except dropout.

Exit codes: 0 done, 1 crash (an uncaught error, or a rank that waited dist_timeout seconds for the
others), 2 bad config or input, 3 diverged: a non-finite loss or parameter; metrics.jsonl then ends
with {"kind": "status", "status": "diverged", "iter": N, ...} and the last checkpoint, written from
finite state only, is kept. Every rank reaches that verdict from all-reduced values, so all stop
together (torchrun itself then exits 1 and names exit code 3 as the root cause). The step loop has no
extra host sync: the first non-finite iteration is kept on the device and read at log and eval iterations.
With skip_nonfinite=N (this project's option; neither Bir et al.'s paper nor the latest version of their
released code skips) a batch whose loss or gradient is not finite is skipped instead (no update; a
finite loss can still back-propagate an overflow, so the gradient norm is checked too; one host sync per
step), up to N times before the run counts as diverged; non-finite parameters still stop it at once, and
so does a non-finite eval loss at the end of the run or after an interval in which every step was skipped.
No checkpoint is written from a state whose eval loss is not finite.
Exit code 4: stopped by SIGTERM or SIGINT, the last completed iteration saved and {"kind": "status",
"status": "stopped", ...} logged; one process checks after every iteration, several agree at the next
log line (in the all-reduce they do there anyway). The last checkpoint is kept instead when that state
may be poisoned (batches skipped as non-finite since the last evaluation); a stop during the setup ends
the run before its first iteration, with nothing written. A second SIGINT stops at once: exit code 130.

Diagnostics on request, written to the eval lines: log_grad_stats and log_geonorm_angles (see
diagnostics.py). Each costs one extra forward (and backward) per evaluation.
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
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from diagnostics import (
    block_activation_rms,
    device_peak_flops,
    geonorm_angles,
    gradient_statistics,
    residual_stream_metrics,
)
from model import GPT, GPTConfig
from run_files import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    LAST_CHECKPOINT_NAME,
    METRICS_NAME,
    MetricsLog,
    OutDirLock,
    foreign_checkpoint,
    load_checkpoint,
    previous_run_files,
    remove_previous_run,
    save_checkpoint,
    save_latest_checkpoint,
    save_stop_checkpoint,
)
from train_config import (
    MODEL_KEYS,
    TRAIN_KEYS,
    ConfigError,
    TrainConfig,
    accumulation_per_rank,
    load_config,
    resolve_device,
)

T = TypeVar("T")
EXIT_CONFIG, EXIT_DIVERGED, EXIT_STOPPED = 2, 3, 4
EXIT_INTERRUPTED = 130  # a second SIGINT: the shell's code for "ended by SIGINT"
TRAIN_STREAM, VAL_STREAM, DROPOUT_STREAM = 0, 1, 2  # first part of every stream_seed
NEVER = torch.iinfo(torch.int64).max  # "no non-finite loss yet"
SAMPLE_CHUNK = 64  # tokens of the final sample drawn between checks for a stop signal


# ----------------------------------------------------------------------------- system


@dataclass
class Dist:
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
    backend = cfg.backend if cfg.backend != "auto" else "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl" and not (device.startswith("cuda") and dist.is_nccl_available()):
        raise ConfigError(f"backend='nccl' needs CUDA devices and a torch built with NCCL; this run is on {device}: "
                          "use --backend=gloo or --backend=auto")
    if device.startswith("cuda"):
        device = f"cuda:{ddp.local_rank}"
        torch.cuda.set_device(device)
    # device_id binds NCCL's communicator to this rank's GPU now, not at the first collective
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=cfg.dist_timeout),
                            device_id=torch.device(device) if backend == "nccl" else None)
    return ddp, device


class LostRanks(RuntimeError):
    """A collective failed: another rank stalled past dist_timeout, or ended. main() prints one line, exit 1."""


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
def claim_out_dir(out_dir: str, ddp: Dist, device: str):
    """Rank 0 holds out_dir's lock for the whole run; every rank learns whether it got it, so all stop together."""
    created = not os.path.exists(out_dir)
    lock = agreed(lambda: OutDirLock(out_dir) if ddp.master else None, device, f"claim out_dir {out_dir!r}")
    try:
        yield
    finally:
        if lock is not None:
            if created and os.listdir(out_dir) == [os.path.basename(lock.path)]:  # a run that wrote nothing
                os.remove(lock.path)
                with contextlib.suppress(OSError):
                    os.rmdir(out_dir)
            lock.release()


class StopSignals:
    """SIGTERM (sent before preemption by SLURM and Kubernetes, and forwarded by torchrun) and SIGINT ask
    the loop to stop after the current iteration with a checkpoint of it; a second SIGINT stops at once
    (KeyboardInterrupt). The previous handlers come back when the run ends."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python handles signals only there
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name


def all_ranks(t: torch.Tensor, ddp: Dist, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce in place (a no-op on one process), so every rank acts on the same value."""
    if ddp.world_size > 1:
        dist.all_reduce(t, op=op)
    return t


MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}  # user settings reuse_freed_memory keeps


def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep freed CPU memory for reuse; True if it now does.

    By default glibc gives each block above a self-adjusting threshold (128 KiB, rising up to 32 MiB)
    its own mmap, unmaps it when freed and trims the heap's free top, so the activation and gradient
    tensors a CPU step allocates afresh are page-faulted in again every step (at the CPU bench shape
    2,100 to 13,200 faults and 2 to 26 ms of kernel time per step; see BENCHMARKS.md). Fixing both
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


def autocast_dtype(cfg: TrainConfig, device: str) -> torch.dtype:
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def stream_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (numpy's SeedSequence hashing)."""
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


# ----------------------------------------------------------------------------- data


class TextData:
    """Random windows of a tokenized dataset; window k of iteration i is a pure function of
    (seed, split, i, k), never of which rank draws it."""

    SPLITS = {"train": TRAIN_STREAM, "val": VAL_STREAM}

    def __init__(self, cfg: TrainConfig, block_size: int, device: str, master: bool):
        self.path = path = os.path.join(cfg.data_dir, cfg.dataset)
        if cfg.dataset in prepare_data.EMBEDDED_DATASETS:  # made on first use by rank 0, while the others wait
            missing = not os.path.exists(os.path.join(path, "meta.json"))
            agreed(lambda: prepare_embedded(cfg.dataset, cfg.data_dir) if master and missing else None, device,
                   f"prepare {cfg.dataset}")
        try:
            self.meta = prepare_data.load_meta(path)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(str(e)) from None
        for split in self.SPLITS:  # load_meta checked that the files have these lengths; mmap refuses empty ones
            if self.meta[f"{split}_tokens"] <= block_size + 1:
                raise ConfigError(f"block_size={block_size} is too large for {path}/{split}.bin "
                                  f"({self.meta[f'{split}_tokens']} tokens); use a smaller --block_size")
        self.arrays = {s: np.memmap(os.path.join(path, f"{s}.bin"), dtype=self.meta["dtype"], mode="r")
                       for s in self.SPLITS}
        self.block_size, self.batch_size, self.seed, self.device = block_size, cfg.batch_size, cfg.seed, device
        check_token_ids(self.meta, self.arrays, path)
        self.to_compact = None
        if cfg.compact_vocab:  # model id k stands for dataset id token_ids[k]; one pass over the data
            used = np.unique(np.concatenate([np.unique(data) for data in self.arrays.values()]))
            self.meta = {**self.meta, "token_ids": used.tolist()}
            self.to_compact = np.zeros(self.meta["vocab_size"], dtype=np.int64)
            self.to_compact[used] = np.arange(len(used))

    @property
    def vocab_size(self) -> int:
        return len(self.meta["token_ids"]) if self.to_compact is not None else self.meta["vocab_size"]

    def batch(self, split: str, iteration: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.arrays[split]
        rng = np.random.default_rng(stream_seed(self.seed, self.SPLITS[split], iteration, index))
        starts = rng.integers(0, len(data) - self.block_size - 1, size=self.batch_size)
        window = np.stack([data[s: s + self.block_size + 1] for s in starts]).astype(np.int64)
        if self.to_compact is not None:
            window = self.to_compact[window]
        xy = torch.from_numpy(window)
        if self.device.startswith("cuda"):
            xy = xy.pin_memory().to(self.device, non_blocking=True)
        else:
            xy = xy.to(self.device)
        return xy[:, :-1], xy[:, 1:]


def prepare_embedded(dataset: str, data_dir: str) -> None:
    """The embedded corpus is small and needs no network: make it now."""
    path = os.path.join(data_dir, dataset)
    print(f"preparing the embedded dataset {dataset} in {path} ...")
    tokenizer = "char" if dataset.endswith("_char") else "gpt2"
    try:
        prepare_data.prepare("shakespeare", tokenizer=tokenizer, data_dir=data_dir)
    except FileExistsError:  # a run started alongside made it meanwhile, or a file stands on the way
        if not os.path.isdir(path):
            raise ConfigError(f"cannot prepare {dataset} in {path}: {data_dir} or a folder above it is a file; "
                              "give a --data_dir that is a folder") from None
    except OSError as e:
        raise ConfigError(f"cannot prepare {dataset} in {path} ({e.strerror or e}); give a writable --data_dir "
                          "(the embedded dataset is prepared there on first use)") from None


def check_token_ids(meta: dict, arrays: dict[str, np.ndarray], path: str) -> None:
    """meta.json's vocab_size is its tokenizer's and every id in the data lies below it; else training would
    crash on an IndexError, or train to the end and fail at sampling."""
    rebuild = prepare_data.prepare_command(os.path.basename(path), os.path.dirname(path), force=True)
    try:
        prepare_data.tokenizer_from_meta(meta)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"{path}/meta.json does not fit its tokenizer: {e}. Rebuild it with:\n  {rebuild}") from None
    for split, data in arrays.items():
        top = int(data.max())  # one pass over the memmapped file
        if top >= meta["vocab_size"]:
            raise ConfigError(f"{path}/{split}.bin holds token id {top}, outside meta.json's vocabulary of "
                              f"{meta['vocab_size']}. Rebuild it with:\n  {rebuild}")


class LanguageModelTask:
    """Next-token prediction on a prepared dataset."""

    def __init__(self, cfg: TrainConfig, model_args: dict, device: str, master: bool):
        block_size = model_args.get("block_size", MODEL_KEYS["block_size"].default)
        self.data = TextData(cfg, block_size, device, master)
        vocab = self.data.vocab_size
        # pad big vocabularies to a multiple of 64 for fast matmuls (GPT-2: 50257 -> 50304)
        self.model_defaults = {"vocab_size": 64 * math.ceil(vocab / 64) if vocab > 1024 else vocab}
        self.tokens_per_batch = cfg.batch_size * block_size
        self.eval_iters = cfg.eval_iters

    def train_batch(self, iteration: int, index: int):
        return self.data.batch("train", iteration, index)

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return model(x, y)[1]

    def eval_batches(self, split: str, ddp: Dist):
        # the same windows at every evaluation (iteration -1), shared out among the ranks
        return (self.data.batch(split, -1, k) for k in range(ddp.rank, self.eval_iters, ddp.world_size))

    def eval_splits(self) -> tuple[str, ...]:
        return ("train", "val")


def check_batch_fits(cfg: TrainConfig, model_args: dict, device: str) -> None:
    """Refuse a batch_size that cannot fit before anything is allocated (else an allocator error, or the kernel's
    OOM kill). A lower bound: one micro-batch's input to the first block in 2-byte floats, and the ICL task's
    fixed eval sets in float32."""
    from icl_task import token_dim

    seq = 2 * cfg.icl_pairs if cfg.task == "icl" else model_args.get("block_size", MODEL_KEYS["block_size"].default)
    need = cfg.batch_size * seq * model_args.get("n_embd", MODEL_KEYS["n_embd"].default) * 2
    if cfg.task == "icl":
        need += 2 * cfg.icl_eval_batches * cfg.batch_size * seq * token_dim(cfg.icl_dim, cfg.icl_bias_feature) * 4
    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(device).total_memory
    elif device == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        return
    if need > total:
        raise ConfigError(f"batch_size={cfg.batch_size} needs at least {need / 2**30:,.0f} GiB, more than {device}'s "
                          f"{total / 2**30:,.0f} GiB of memory; lower --batch_size (and raise "
                          "--gradient_accumulation_steps to keep the tokens per iteration)")


def make_task(cfg: TrainConfig, model_args: dict, device: str, master: bool):
    if cfg.task == "icl":
        from icl_task import LeastSquaresTask

        return LeastSquaresTask(cfg, model_args, device)
    return LanguageModelTask(cfg, model_args, device, master)


def model_inputs(batch) -> torch.Tensor:
    return batch[0] if isinstance(batch, tuple) else batch.tokens


def val_inputs(task) -> torch.Tensor:
    """The inputs of the first val batch: the fixed batch of the per-block diagnostics."""
    return model_inputs(next(iter(task.eval_batches("val", Dist()))))


# ----------------------------------------------------------------------------- resume and state


def resume_model_args(cfg: TrainConfig, model_args: dict, task, checkpoint: dict) -> dict:
    """The checkpoint's architecture, after checking that this run's settings fit it."""
    saved, old = checkpoint["model_args"], checkpoint["config"]
    if old["optimizer"] != cfg.optimizer and not cfg.eval_only:
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


# ----------------------------------------------------------------------------- schedule and logging


def lr_multiplier(cfg: TrainConfig, it: int) -> float:
    """Linear warmup, then down to min_lr/learning_rate at lr_decay_iters, and flat after it.

    cosine: nanoGPT's cosine decay over [warmup_iters, lr_decay_iters].
    wsd: warmup, stable, decay (Bir et al.'s schedule: 2% warmup, constant, linear decay over the
    last 10%): flat until lr_decay_iters - cooldown_iters, then linear to the floor.
    """
    if not cfg.decay_lr:
        return 1.0
    if it < cfg.warmup_iters:
        return (it + 1) / (cfg.warmup_iters + 1)
    floor = cfg.min_lr / cfg.learning_rate
    if it >= cfg.lr_decay_iters:
        return floor
    if cfg.lr_schedule == "wsd":
        start = max(cfg.warmup_iters, cfg.lr_decay_iters - cfg.cooldown_iters)
        progress = max(0, it - start) / max(1, cfg.lr_decay_iters - start)
        return 1.0 - progress * (1.0 - floor)
    progress = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)



# ----------------------------------------------------------------------------- training


def build(cfg: TrainConfig, model_args: dict, task, device: str, checkpoint: dict | None):
    import optim

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
    if cfg.log_geonorm_angles and gptconf.scheme.combine != "geodesic":
        raise ConfigError(f"log_geonorm_angles needs GeoNorm's geodesic step (norm_scheme='geonorm' or "
                          f"combine='geodesic'); this model combines by {gptconf.scheme.combine!r}")
    torch.manual_seed(cfg.seed)  # the same init on every rank
    try:
        model = GPT(gptconf).to(device)
    except RuntimeError as e:  # torch.OutOfMemoryError on a GPU, an allocator's RuntimeError on the CPU
        if "out of memory" not in str(e) and "allocate" not in str(e):
            raise
        raise ConfigError(f"the model (n_layer={gptconf.n_layer}, n_embd={gptconf.n_embd}, vocab_size="
                          f"{gptconf.vocab_size}) does not fit in {device}'s memory; make it smaller") from None
    if checkpoint is not None:
        try:
            model.load_state_dict(checkpoint["model"])
        except RuntimeError as e:  # missing, extra or misshapen weights
            raise foreign_checkpoint(cfg.out_dir, e) from None
    try:
        optimizer = optim.build_optimizer(
            model, cfg.optimizer, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
            betas=(cfg.beta1, cfg.beta2), device_type=device.split(":")[0], momentum=cfg.momentum,
            nesterov=cfg.nesterov, matrix_lr=cfg.matrix_lr, matrix_momentum=cfg.matrix_momentum,
            matrix_weight_decay=cfg.matrix_weight_decay, matrix_nesterov=cfg.matrix_nesterov,
            gradient_scale=cfg.gradient_scale, dual_init=cfg.dual_init, direction_dtype=cfg.direction_dtype,
            dual_steps=cfg.dual_steps, dual_lr=cfg.dual_lr, dual_reset=cfg.dual_reset,
            msign_steps=cfg.msign_steps, ns_steps=cfg.ns_steps, adjust_lr=cfg.adjust_lr)
    except ValueError as e:  # an option the optimizer refuses (e.g. decay on Manifold Muon's matrices)
        raise ConfigError(f"optimizer {cfg.optimizer}: {e}") from None
    if checkpoint is not None and not cfg.eval_only:  # evaluation needs no optimizer state
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        try:
            optimizer.load_state_dict(checkpoint["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:  # groups or state that do not match the parameters
            raise foreign_checkpoint(cfg.out_dir, e) from None
        for group, fresh in zip(optimizer.param_groups, settings, strict=True):
            group.update(fresh)  # the config's hyperparameters win over the checkpoint's
    return gptconf, model, optimizer


# torch 2.13 renamed DDP's broadcast_buffers (deprecated since) to forward_sync_buffers; older torch has only the first
NO_BUFFER_SYNC = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
    else "broadcast_buffers"


def wrap_model(model: GPT, ddp: Dist, device_type: str, compiled: bool) -> torch.nn.Module:
    """DDP first, then torch.compile: compiling the DDP module lets dynamo split the graph at DDP's gradient
    buckets, so each bucket's all-reduce overlaps the rest of the backward (compiled first, every gradient
    leaves one graph at its end and the all-reduce waits for all of them)."""
    if ddp.world_size > 1:
        # every buffer is a constant set at construction (RoPE tables, fixed gains): nothing to sync in a forward,
        # and a sync there would hang an evaluation in which some ranks get no batch. Gradients as views of the
        # buckets: no copy in or out of them.
        model = DDP(model, device_ids=[ddp.local_rank] if device_type == "cuda" else None, gradient_as_bucket_view=True,
                    **{NO_BUFFER_SYNC: False})
    return torch.compile(model) if compiled else model


def forward_backward(model, task, ddp: Dist, accum: int, it: int, scaler, autocast, seed: int) -> torch.Tensor:
    """Accumulate the gradients of iteration `it` over this rank's micro-batches; returns its mean loss.
    Global micro-batch k sees the data and dropout masks of (seed, it, k), whatever the world size."""
    loss_sum = None
    for micro in range(accum):
        k = ddp.rank * accum + micro
        torch.manual_seed(stream_seed(seed, DROPOUT_STREAM, it, k))
        batch = task.train_batch(it, k)
        sync = micro == accum - 1 or ddp.world_size == 1
        with (nullcontext() if sync else model.no_sync()), autocast:
            loss = task.loss(model, batch) / accum
        scaler.scale(loss).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    return loss_sum


@torch.no_grad()
def evaluate(model, raw_model: GPT, task, ddp: Dist, autocast) -> dict:
    """Mean loss per split, averaged over all ranks' batches; plus the task's extra metrics."""
    model.eval()
    out = {}
    for split in task.eval_splits():
        total = torch.zeros(2, device=next(model.parameters()).device)
        for batch in task.eval_batches(split, ddp):
            with autocast:
                total += torch.stack([task.loss(model, batch).float(), torch.ones((), device=total.device)])
        all_ranks(total, ddp)
        out[f"{split}_loss"] = (total[0] / total[1]).item()
    if hasattr(task, "extra_metrics"):
        out.update(task.extra_metrics(model, autocast))
    out.update(residual_stream_metrics(raw_model, val_inputs(task)))
    model.train()
    return out


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


def train(argv: list[str]) -> int:
    cfg, model_args = load_config(argv)
    checkpoint_to_load(cfg)  # before out_dir is claimed: a mistyped out_dir is not created
    reuse_freed_memory()
    ddp, device = setup_distributed(cfg)
    stop = StopSignals()
    try:
        with claim_out_dir(cfg.out_dir, ddp, device), stop:
            return run(cfg, model_args, ddp, device, stop)
    except RuntimeError as e:
        lost = lost_ranks(e, cfg, ddp, stop) if ddp.world_size > 1 else None
        if lost is None:
            raise
        raise lost from None


def checkpoint_to_load(cfg: TrainConfig) -> str | None:
    """The checkpoint a resumed or eval-only run starts from (the stop save when it is the newer, see
    save_stop_checkpoint); None for a new run. Checked before out_dir is claimed, so a mistyped out_dir
    is not created."""
    if cfg.init_from != "resume" and not cfg.eval_only:
        return None
    last = os.path.join(cfg.out_dir, LAST_CHECKPOINT_NAME)
    if cfg.init_from == "resume" and not cfg.eval_only and os.path.isfile(last):
        return last
    ckpt_path = os.path.join(cfg.out_dir, CHECKPOINT_NAME)
    if not os.path.exists(ckpt_path):
        needs = "eval_only evaluates out_dir's checkpoint" if cfg.eval_only else "init_from='resume'"
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
    found = previous_run_files(cfg.out_dir)
    earlier = [name for name in found if name.endswith(".pt") or name == METRICS_NAME]
    if earlier and not cfg.overwrite:
        raise ConfigError(f"an earlier run already exists in {cfg.out_dir} ({', '.join(earlier)}); continue "
                          "it with --init_from=resume, choose another --out_dir, or pass --overwrite=True to delete "
                          "its checkpoints and metrics and start anew")
    folders = [name for name in found if os.path.isdir(os.path.join(cfg.out_dir, name))]
    if folders:  # a new run deletes the earlier run's files, not folders: refuse now, not after the setup
        raise ConfigError(f"{', '.join(folders)} in {cfg.out_dir} is a folder, not a run's file, and a new run "
                          "deletes files only; move it away or choose another --out_dir")
    return None


# what a resumed run reads, and its type (an evaluation reads all but the optimizer state)
CHECKPOINT_FIELDS = {"model": dict, "optimizer": dict, "model_args": dict, "config": dict, "iter_num": int,
                     "best_val_loss": float}


def checked_contents(checkpoint: dict, cfg: TrainConfig) -> dict:
    """The checkpoint, if it holds every field this resumed or eval-only run reads (checked before anything is
    built)."""
    needed = {k: kind for k, kind in CHECKPOINT_FIELDS.items() if k != "optimizer" or not cfg.eval_only}
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


def run(cfg: TrainConfig, model_args: dict, ddp: Dist, device: str, stop: StopSignals) -> int:
    accum = accumulation_per_rank(cfg, ddp.world_size)
    checkpoint = starting_point(cfg, device)
    cfg, task_args = resumed_settings(cfg, model_args, checkpoint)
    check_batch_fits(cfg, task_args, device)
    task = make_task(cfg, task_args, device, ddp.master)
    if checkpoint is not None:
        check_same_data(cfg, checkpoint, task)
    gptconf, model, optimizer = build(cfg, model_args, task, device, checkpoint)
    if all_ranks(torch.tensor(float(stop.received is not None), device=device), ddp).item():  # a long setup
        if ddp.master:
            print(f"{stop.received or 'a stop signal on another rank'}: stopped during setup, before the first "
                  "iteration; nothing was changed", file=sys.stderr)
        return EXIT_STOPPED
    raw_model = model
    dtype = autocast_dtype(cfg, device)
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)
    if device_type == "cuda":  # float32 matmuls on TF32 tensor cores, or in full float32 (tf32=False)
        torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    if checkpoint is not None and checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])
    compiled = cfg.compile if cfg.compile is not None else device_type == "cuda"
    model = wrap_model(model, ddp, device_type, compiled)

    start_iter = iter_num = checkpoint["iter_num"] if checkpoint else 0
    # a stop save at an evaluation iteration precedes its evaluation: the resumed run evaluates and saves it
    start_evaluated = checkpoint is None or checkpoint.get("evaluated", True)
    skipped = checkpoint.get("skipped_steps", 0) if checkpoint else 0  # batches whose update was dropped
    best_val = checkpoint["best_val_loss"] if checkpoint else float("inf")
    wandb_run = None
    if cfg.wandb_log and ddp.master:
        import wandb

        wandb_run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=asdict(cfg))
    if ddp.master and checkpoint is None:  # everything is ready: the earlier run's files go now, not before
        removed = remove_previous_run(cfg.out_dir)
        if removed:
            print(f"overwrite: deleted the earlier run's {', '.join(removed)} from {cfg.out_dir}")
    log = agreed(lambda: MetricsLog(cfg.out_dir, ddp.master and not cfg.eval_only, iter_num if checkpoint else None,
                                    wandb_run, reevaluates=evaluates_at(cfg, iter_num),  # its line is written again
                                    logged_lines=checkpoint.get("metrics_lines") if checkpoint else None),
                 device, f"continue {METRICS_NAME}")
    tokens_per_iter = task.tokens_per_batch * cfg.gradient_accumulation_steps
    flops_per_iter = raw_model.flops_per_token(task.tokens_per_batch // cfg.batch_size) * tokens_per_iter
    peak = device_peak_flops(device, dtype) * ddp.world_size
    if ddp.master:
        has_norm = any("norm" in n and not isinstance(m, torch.nn.Identity) for n, m in raw_model.named_modules())
        norms = f" / {gptconf.norm}" if has_norm else ", no norms"
        print(f"{gptconf.norm_scheme}{norms}: {raw_model.get_num_params() / 1e6:.2f}M parameters, "
              f"{ddp.world_size} process(es) on {device}, {dtype}, {tokens_per_iter:,} tokens per iteration")
        if checkpoint:
            changed = [f"{k} {v!r} -> {getattr(cfg, k)!r}" for k, v in checkpoint["config"].items()
                       if k in TRAIN_KEYS and k not in ("init_from", "overwrite") and getattr(cfg, k) != v]
            print(f"{'evaluating' if cfg.eval_only else 'resuming'} at iter {iter_num} "
                  f"(saved by {checkpoint['world_size']} process(es))"
                  + (f"; changed: {', '.join(changed)}" if changed else ""))
            if log.moved:
                print(log.moved)

    def checkpoint_state(evaluated: bool = True) -> dict:
        """evaluated: saved after the evaluation at iter_num (a stop save may come before it)."""
        return {"format": CHECKPOINT_FORMAT, "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "iter_num": iter_num, "best_val_loss": best_val,
                "model_args": asdict(gptconf), "config": asdict(cfg), "world_size": ddp.world_size,
                "skipped_steps": skipped, "evaluated": evaluated, "metrics_lines": log.lines,
                **({"data_meta": task.data.meta} if cfg.task == "lm" else {})}

    # the first iteration with a non-finite training loss, kept on the device: no sync per step
    first_bad = torch.full((), NEVER, dtype=torch.int64, device=device)
    t_last, iters_since_log = time.perf_counter(), 0
    eval_iter, eval_skipped, eval_finite = iter_num, skipped, True  # the last evaluation's, for the next one
    while True:
        if evaluates_at(cfg, iter_num):
            metrics = evaluate(model, raw_model, task, ddp, autocast)
            # never save a checkpoint from non-finite state; the losses are all-reduced, so all ranks agree
            finite = all(math.isfinite(metrics[f"{split}_loss"]) for split in task.eval_splits())
            reason = eval_divergence(cfg, finite, iter_num >= cfg.max_iters or cfg.eval_only,
                                     iter_num - eval_iter, skipped - eval_skipped)
            eval_iter, eval_skipped, eval_finite = iter_num, skipped, finite
            if all_ranks(torch.tensor(float(reason is not None or bool(nonfinite_state(raw_model, optimizer))),
                                      device=device), ddp).item():
                return report_divergence(log, ddp, iter_num, reason or "non-finite eval loss or state", raw_model,
                                         optimizer, val_inputs(task))
            if cfg.log_geonorm_angles:
                metrics.update(geonorm_angles(raw_model, val_inputs(task)))
            if cfg.log_grad_stats:  # the gradients this iteration's step will apply (same batches and masks)
                forward_backward(model, task, ddp, accum, iter_num, scaler, autocast, cfg.seed)
                if ddp.master:
                    metrics.update(gradient_statistics(raw_model, scaler.get_scale() if scaler.is_enabled() else 1.0))
                optimizer.zero_grad(set_to_none=True)
            if ddp.master:
                print(f"iter {iter_num}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                       if isinstance(v, float)))
                improved = metrics["val_loss"] < best_val
                best_val = min(best_val, metrics["val_loss"])
                if (iter_num > start_iter or not start_evaluated) and not cfg.eval_only and finite:
                    save_evaluated(cfg, iter_num, checkpoint_state, cfg.always_save_checkpoint or improved)
                log.write(kind="eval", iter=iter_num, **metrics)  # after the save: a logged eval has its checkpoint
            t_last = time.perf_counter()  # evaluation time is not training time
        if iter_num >= cfg.max_iters or cfg.eval_only:
            break

        mult = lr_multiplier(cfg, iter_num)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * mult
        loss_sum = forward_backward(model, task, ddp, accum, iter_num, scaler, autocast, cfg.seed)
        grad_norm = None
        if cfg.grad_clip > 0 or cfg.skip_nonfinite:  # one norm serves the skip check and the clipping
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        if cfg.skip_nonfinite and not all_ranks(batch_is_finite(loss_sum, grad_norm, scaler), ddp,
                                                dist.ReduceOp.MIN).item():
            optimizer.zero_grad(set_to_none=True)  # drop this batch's update; a sync per step
            if scaler.is_enabled():
                scaler.update()  # closes the unscale_ above (and lowers the fp16 loss scale)
            skipped += 1
            if skipped > cfg.skip_nonfinite:
                return report_divergence(log, ddp, iter_num + 1, f"more than {cfg.skip_nonfinite} non-finite losses "
                                         "skipped", raw_model, optimizer, model_inputs(task.train_batch(iter_num, 0)))
        else:
            first_bad = torch.where(loss_sum.isfinite(), first_bad, first_bad.clamp(max=iter_num))
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.grad_clip, grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            raw_model.apply_parameter_constraints()
        iter_num += 1
        iters_since_log += 1
        if iter_num == start_iter + 1:  # the first step compiles and warms up: keep it out of ms/iter and MFU
            t_last, iters_since_log = time.perf_counter(), 0

        log_now = iter_num % cfg.log_interval == 0
        # before any log or save; one process also checks for a stop signal after every step (no sync needed),
        # several at these points only, where they sync anyway
        stop_now = False
        if (log_now or iter_num % cfg.eval_interval == 0 or iter_num >= cfg.max_iters
                or (ddp.world_size == 1 and stop.received)):
            bad_iter, stop_now = check_in(first_bad, stop, ddp)  # the same on every rank, so all stop together
            if bad_iter is not None:
                return report_divergence(log, ddp, bad_iter + 1, "non-finite training loss", raw_model, optimizer,
                                         model_inputs(task.train_batch(bad_iter, 0)))
        if log_now:
            lossf = (all_ranks(loss_sum, ddp) / ddp.world_size).item()  # the global batch's loss
            speed = {}
            if iters_since_log:  # none yet right after the first step, which is not timed
                dt = (time.perf_counter() - t_last) / iters_since_log
                speed = {"ms_per_iter": dt * 1000, "tokens_per_s": tokens_per_iter / dt,
                         "mfu": flops_per_iter / dt / peak}
            t_last, iters_since_log = time.perf_counter(), 0
            if ddp.master:
                timing = (f", {speed['ms_per_iter']:.1f} ms/iter, {speed['tokens_per_s']:,.0f} tok/s, "
                          f"mfu {100 * speed['mfu']:.1f}%") if speed else ""
                print(f"iter {iter_num}: loss {lossf:.4f}, lr {optimizer.param_groups[0]['lr']:.3g}{timing}")
                log.write(kind="train", iter=iter_num, loss=lossf, lr=optimizer.param_groups[0]["lr"], **speed,
                          **({"skipped": skipped} if cfg.skip_nonfinite else {}))
        if stop_now:  # after the iteration's train line, so the log has every completed iteration
            # no save from a state that may be poisoned: a non-finite last evaluation or state, or skipped batches
            unsaved = ("its state is not finite" if not eval_finite or nonfinite_state(raw_model, optimizer) else
                       "non-finite batches were skipped since the last evaluation" if skipped > eval_skipped else None)
            state = checkpoint_state(evaluated=False) if unsaved is None else None
            return stop_with_checkpoint(log, ddp, stop, iter_num, state, cfg, unsaved)

    if ddp.master and cfg.sample_tokens > 0 and cfg.task == "lm":
        print_sample(raw_model, task.data.meta, cfg.sample_tokens, device, stop)
    return 0


def evaluates_at(cfg: TrainConfig, iteration: int) -> bool:
    """Whether the loop evaluates at `iteration`: every eval_interval, at the end, and only there when eval_only."""
    return iteration % cfg.eval_interval == 0 or iteration >= cfg.max_iters or cfg.eval_only


def save_evaluated(cfg: TrainConfig, iteration: int, checkpoint_state, latest: bool) -> None:
    """After a finite evaluation: ckpt_<iter>.pt every keep_every iterations (first, so that a kill between
    the two saves loses neither), and ckpt.pt if `latest` (always_save_checkpoint, or a better val loss)."""
    keep = cfg.keep_every and iteration % cfg.keep_every == 0
    state = checkpoint_state() if keep or latest else None
    if keep:
        save_checkpoint(os.path.join(cfg.out_dir, f"ckpt_{iteration}.pt"), state)
    if latest:
        save_latest_checkpoint(cfg.out_dir, state)


def stop_with_checkpoint(log: MetricsLog, ddp: Dist, stop: StopSignals, iteration: int, state: dict | None,
                         cfg: TrainConfig, unsaved: str | None = None) -> int:
    """Save the last completed iteration (state; None, and `unsaved` saying why, when it must not be saved) and
    log the stop. Every rank calls this at the same iteration; rank 0 writes."""
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


def print_sample(model: GPT, meta: dict, n_tokens: int, device: str, stop: StopSignals | None = None) -> None:
    """n_tokens of text after a newline, drawn in chunks: a stop signal ends it early (the training is saved)."""
    tokenizer = prepare_data.tokenizer_from_meta(meta)
    try:
        start = tokenizer.encode("\n")
    except ValueError:  # a vocabulary without a newline: the end-of-text token, or else id 0
        start = [tokenizer.eot_token if tokenizer.eot_token is not None else 0]
    out = torch.tensor([start], device=device)
    generator, end = torch.Generator(device).manual_seed(0), out.shape[1] + n_tokens
    while out.shape[1] < end and not (stop and stop.received):  # the same tokens as one call: one generator
        out = model.generate(out, min(SAMPLE_CHUNK, end - out.shape[1]), temperature=0.8, top_k=200,
                             generator=generator, vocab_limit=tokenizer.vocab_size)
    cut = f" (cut short by {stop.received})" if stop and stop.received else ""
    print("-" * 40 + " sample\n" + tokenizer.decode(out[0].tolist()) + "\n" + "-" * 40 + cut)


def main() -> None:
    try:
        code = train(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        code = EXIT_CONFIG
    except KeyboardInterrupt:  # a second SIGINT, or one before the run's handlers were installed
        print("interrupted by SIGINT: stopped at once, without a checkpoint of the current iteration",
              file=sys.stderr)
        code = EXIT_INTERRUPTED
    except LostRanks as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()

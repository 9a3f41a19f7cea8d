"""
Train a nanoNorm GPT: one loop for one CPU, one GPU, or many GPUs and nodes.

    python train.py configs/quickstart.py                       # CPU or one GPU
    python train.py configs/quickstart.py --n_layer=2 --compile=True
    torchrun --standalone --nproc_per_node=8 train.py configs/geonorm_125m.py
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 \\
        --nproc_per_node=8 train.py configs/geonorm_125m.py     # then node_rank=1 on the other

A config file is Python assignments (`n_layer = 6`); `--key=value` overrides it. Every key is
a field of `TrainConfig` below or of `model.GPTConfig`; anything else stops with a message.

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

Exit codes: 0 done, 1 crash (an uncaught error), 2 bad config or input, 3 diverged: a
non-finite loss or parameter; metrics.jsonl then ends with {"kind": "status", "status":
"diverged", "iter": N, ...} and the last checkpoint, written from finite state only, is kept.
Every rank reaches that verdict from all-reduced values, so all stop together (torchrun itself
then exits 1 and names exit code 3 as the root cause). The step loop has no extra host sync: the
first non-finite iteration is kept on the device and read at log and eval iterations.
With skip_nonfinite=N a batch whose loss or gradient is not finite is skipped instead (no update,
as in Bir et al.'s training loop, which checks the loss; a finite loss can still back-propagate an
overflow, so the gradient norm is checked too; one host sync per step), up to N times before the
run counts as diverged; non-finite parameters still stop it at once.

Diagnostics on request, written to the eval lines: log_grad_stats (per-parameter gradient norms
and the tail of |g|, from the gradients that iteration's step applies) and log_geonorm_angles
(GeoNorm's theta' per layer). Each costs one extra forward (and backward) per evaluation.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import json
import math
import os
import pickle
import sys
import time
import types
import typing
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from model import GPT, GeodesicStep, GPTConfig, block_activation_rms

EXIT_CONFIG, EXIT_DIVERGED = 2, 3
CHECKPOINT_FORMAT = "nanonorm-checkpoint-v1"
TRAIN_STREAM, VAL_STREAM, DROPOUT_STREAM = 0, 1, 2  # first part of every stream_seed
NEVER = torch.iinfo(torch.int64).max  # "no non-finite loss yet"
GRAD_HIST_LOG10_EDGES = list(range(-12, 1))  # |g| histogram: <1e-12, [1e-12, 1e-11), ..., >=1


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    eval_interval: int = 250
    log_interval: int = 10
    eval_iters: int = 20
    eval_only: bool = False
    always_save_checkpoint: bool = True
    init_from: str = "scratch"  # "scratch" or "resume" (from out_dir/ckpt.pt)
    overwrite: bool = False  # let a scratch run replace an existing out_dir/ckpt.pt
    keep_every: int = 0  # also keep ckpt_<iter>.pt every this many iterations (0: only the last)
    sample_tokens: int = 0  # print a sample of this many tokens from the final model
    # logging
    wandb_log: bool = False
    wandb_project: str = "nanonorm"
    wandb_run_name: str = "run"
    # diagnostics written to the eval lines of metrics.jsonl (each costs one extra pass per eval)
    log_grad_stats: bool = False  # per-parameter gradient norms and the tail of |g| (DNT Fig. 1)
    log_geonorm_angles: bool = False  # GeoNorm's applied angle theta' per residual update
    # data
    task: str = "lm"  # "lm" (next-token prediction) or "icl" (Bir et al.'s least-squares task)
    dataset: str = "shakespeare_char"
    compact_vocab: bool = False  # output only the token ids the dataset uses (small corpora: a cheaper head)
    data_dir: str = "data"
    gradient_accumulation_steps: int = 1  # global count, divided among the ranks
    batch_size: int = 12  # per micro-batch
    # optimizer and schedule
    optimizer: str = "adamw"  # see optim.OPTIMIZERS
    learning_rate: float = 6e-4
    max_iters: int = 5000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    momentum: float = 0.9  # sgdw's momentum
    nesterov: bool = False  # sgdw
    matrix_lr: float | None = None  # muon / manifold_muon: lr of the hidden matrices; None: 0.02 / 0.1
    matrix_momentum: float = 0.95
    matrix_weight_decay: float | None = None  # muon / manifold_muon: None = weight_decay (manifold_muon: 0)
    dual_steps: int = 1  # manifold_muon: dual-ascent steps per update
    dual_lr: float = 0.01  # manifold_muon: dual-ascent step size
    dual_reset: bool = False  # manifold_muon: re-initialize the dual every step (not online)
    msign_steps: int = 10  # manifold_muon: iterations of msign (the retraction's accuracy)
    ns_steps: int = 5  # muon: Newton-Schulz steps
    adjust_lr: str = "original"  # muon: update scale, "original" or "match_rms_adamw"
    grad_clip: float = 1.0  # 0 disables
    skip_nonfinite: int = 0  # drop the update of up to this many non-finite batches (loss or gradient); 0: stop
    decay_lr: bool = True
    lr_schedule: str = "cosine"  # after warmup: "cosine" to min_lr (nanoGPT), or "wsd": flat, then linear
    warmup_iters: int = 100
    lr_decay_iters: int = 5000  # the schedule reaches min_lr here
    cooldown_iters: int = 0  # wsd: the linear decay to min_lr takes the last cooldown_iters before lr_decay_iters
    min_lr: float = 6e-5
    # system
    backend: str = "auto"  # "nccl", "gloo", or "auto" (nccl on CUDA, gloo otherwise)
    device: str = "auto"  # "auto" picks cuda, then mps, then cpu
    dtype: str = "auto"  # "float32", "bfloat16", "float16"; auto: bf16 (or fp16) on CUDA, fp32 else
    compile: bool = False
    seed: int = 1337
    # the least-squares task (task="icl"); see icl_task.get_batch
    icl_pairs: int = 64
    icl_dim: int = 5
    icl_noise_std: float = 0.01
    icl_order: str = "random"
    icl_bias_feature: bool = True
    icl_eval_batches: int = 8  # size of the fixed eval set, in batches of batch_size


TRAIN_KEYS = {f.name: f for f in fields(TrainConfig)}
MODEL_KEYS = {f.name: f for f in fields(GPTConfig)}


class ConfigError(ValueError):
    """A config key or value the user has to fix; train.py exits with code 2."""


# ----------------------------------------------------------------------------- configuration


def _expected_types(name: str) -> tuple[type, ...]:
    owner = TrainConfig if name in TRAIN_KEYS else GPTConfig
    hint = typing.get_type_hints(owner)[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    allowed = tuple(type(None) if a is type(None) else a for a in args)
    return allowed + ((int,) if float in allowed else ())


def check_value(name: str, value: object) -> object:
    """Check a value against the key's type; ints are accepted for floats."""
    if name not in TRAIN_KEYS and name not in MODEL_KEYS:
        close = difflib.get_close_matches(name, [*TRAIN_KEYS, *MODEL_KEYS], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown config key '{name}'{hint}")
    allowed = _expected_types(name)
    if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
        names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed[:2])
        raise ConfigError(f"config key '{name}' expects {names}, got {value!r} ({type(value).__name__})")
    return float(value) if float in allowed and isinstance(value, int) and not isinstance(value, bool) else value


def read_config_file(path: str) -> dict:
    """Execute a config file of plain assignments and return its public names."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found (see configs/ for examples)")
    namespace: dict = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), namespace)
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and not isinstance(v, types.ModuleType) and not callable(v)}


def parse_overrides(args: list[str]) -> dict:
    overrides = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"cannot parse argument {arg!r}: use --key=value")
        key, text = arg[2:].split("=", 1)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word is a string: --norm_scheme=geonorm
        overrides[key] = value
    return overrides


def load_config(argv: list[str]) -> tuple[TrainConfig, dict]:
    """argv = [config.py] [--key=value ...] -> (TrainConfig, model keys for GPTConfig)."""
    settings: dict = {}
    if argv and not argv[0].startswith("--"):
        settings.update(read_config_file(argv[0]))
        argv = argv[1:]
    settings.update(parse_overrides(argv))
    settings = {k: check_value(k, v) for k, v in settings.items()}
    train = TrainConfig(**{k: v for k, v in settings.items() if k in TRAIN_KEYS})
    model_args = {k: v for k, v in settings.items() if k in MODEL_KEYS}
    check_train_config(train)
    check_model_args(train, model_args)
    return train, model_args


def check_train_config(cfg: TrainConfig) -> None:
    import optim

    choices = {"init_from": ("scratch", "resume"), "task": ("lm", "icl"),
               "optimizer": optim.OPTIMIZERS, "dtype": ("auto", "float32", "bfloat16", "float16"),
               "backend": ("auto", "nccl", "gloo"), "icl_order": ("random", "xy", "yx"),
               "adjust_lr": ("original", "match_rms_adamw"), "lr_schedule": ("cosine", "wsd")}
    for key, valid in choices.items():
        if getattr(cfg, key) not in valid:
            raise ConfigError(f"{key}={getattr(cfg, key)!r} is not valid; choose one of: {', '.join(valid)}")
    for key in ("eval_interval", "log_interval", "eval_iters", "gradient_accumulation_steps", "batch_size",
                "icl_pairs", "icl_dim", "icl_eval_batches"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be at least 1")
    for key in ("max_iters", "warmup_iters", "lr_decay_iters", "cooldown_iters", "keep_every", "sample_tokens",
                "grad_clip", "min_lr", "weight_decay", "skip_nonfinite"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must not be negative")
    if not cfg.learning_rate > 0:  # the schedule divides by it
        raise ConfigError(f"learning_rate={cfg.learning_rate} must be positive")


def check_model_args(cfg: TrainConfig, model_args: dict) -> None:
    """Model values, checked before any data is read or process started."""
    try:
        config = GPTConfig(**model_args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not 0 <= config.dropout < 1:
        raise ConfigError(f"dropout={config.dropout} must lie in [0, 1)")
    block_size = model_args.get("block_size")
    if cfg.task == "icl" and block_size is not None and block_size < 2 * cfg.icl_pairs:
        raise ConfigError(f"block_size={block_size} is shorter than a least-squares sequence "
                          f"(2 * icl_pairs = {2 * cfg.icl_pairs} tokens); raise --block_size or lower --icl_pairs")


def accumulation_per_rank(cfg: TrainConfig, world_size: int) -> int:
    if cfg.gradient_accumulation_steps % world_size:
        raise ConfigError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be divisible by "
                          f"the number of processes ({world_size}); it is the global count, split among them")
    return cfg.gradient_accumulation_steps // world_size


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
    device = cfg.device
    if device == "auto":
        mps = getattr(torch.backends, "mps", None)
        device = "cuda" if torch.cuda.is_available() else "mps" if mps and mps.is_available() else "cpu"
    if "RANK" not in os.environ:
        return Dist(), device
    ddp = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    backend = cfg.backend if cfg.backend != "auto" else "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        device = f"cuda:{ddp.local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend)
    return ddp, device


def all_ranks(t: torch.Tensor, ddp: Dist, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce in place (a no-op on one process), so every rank acts on the same value."""
    if ddp.world_size > 1:
        dist.all_reduce(t, op=op)
    return t


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
        path = os.path.join(cfg.data_dir, cfg.dataset)
        if not os.path.exists(os.path.join(path, "meta.json")) and cfg.dataset in prepare_data.EMBEDDED_DATASETS:
            if master:  # the embedded corpus is small and needs no network: make it now
                print(f"preparing the embedded dataset {cfg.dataset} in {path} ...")
                tokenizer = "char" if cfg.dataset.endswith("_char") else "gpt2"
                with contextlib.suppress(FileExistsError):  # a run started alongside made it meanwhile
                    prepare_data.prepare("shakespeare", tokenizer=tokenizer, data_dir=cfg.data_dir)
            if dist.is_initialized():
                dist.barrier()
        try:
            self.meta = prepare_data.load_meta(path)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(str(e)) from None
        self.arrays = {s: np.memmap(os.path.join(path, f"{s}.bin"), dtype=self.meta["dtype"], mode="r")
                       for s in self.SPLITS}
        self.block_size, self.batch_size, self.seed, self.device = block_size, cfg.batch_size, cfg.seed, device
        for split, data in self.arrays.items():
            if len(data) <= block_size + 1:
                raise ConfigError(f"block_size={block_size} is too large for {path}/{split}.bin "
                                  f"({len(data)} tokens); use a smaller --block_size")
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


# ----------------------------------------------------------------------------- checkpoints


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


def resume_model_args(cfg: TrainConfig, model_args: dict, task, checkpoint: dict) -> dict:
    """The checkpoint's architecture, after checking that this run's settings fit it."""
    saved, old = checkpoint["model_args"], checkpoint["config"]
    if old["optimizer"] != cfg.optimizer:
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


def device_peak_flops(device: str, dtype: torch.dtype = torch.float32) -> float:
    """Datasheet dense bf16/fp16 peak for known GPUs; on a CPU, the matmul peak in `dtype` measured now.
    Half precision without native CPU support is emulated (seconds per matmul, no real peak): float32 then."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        table = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
                 "4090": 165e12, "3090": 71e12, "V100": 125e12}
        return next((v for k, v in table.items() if k in name), float("nan"))
    if device != "cpu":
        return float("nan")
    if dtype != torch.bfloat16 or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtype = torch.float32
    n = 2048  # large enough to reach the peak (1024^2 reaches about half of it in float32 here)
    a = torch.randn(n, n, dtype=dtype)
    a @ a  # warm-up
    best = float("inf")
    for _ in range(4):  # the fastest of a few repeats: the least disturbed by other processes
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


# ----------------------------------------------------------------------------- diagnostics


@torch.no_grad()
def gradient_statistics(model: GPT, grad_scale: float = 1.0) -> dict:
    """Per-parameter gradient norms and the tail of |g| over all entries (DNT Fig. 1): kurtosis
    (3 for a Gaussian), the 99.9th percentile over the median (inf if most entries are 0), a
    log10-spaced histogram. Needs two float32 copies of the gradients, briefly."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    norms = (torch.stack([t.float().norm() for t in grads.values()]) / grad_scale).tolist()
    g = torch.cat([t.flatten().float() for t in grads.values()]).div_(grad_scale)
    centered = g - g.mean()
    variance = centered.square_().mean()
    kurtosis = centered.square_().mean() / variance.square()  # E[(g - mean)^4] / Var^2
    del centered
    a = g.abs_()
    median, q999 = (a.kthvalue(max(1, math.ceil(q * a.numel()))).values for q in (0.5, 0.999))
    below = [int((a < 10.0**e).sum()) for e in GRAD_HIST_LOG10_EDGES]
    hist = [hi - lo for lo, hi in zip([0, *below], [*below, a.numel()], strict=True)]
    return {"grad_norms": dict(zip(grads, norms, strict=True)), "grad_kurtosis": kurtosis.item(),
            "grad_tail_ratio": (q999 / median).item(), "grad_abs_hist": hist,
            "grad_abs_hist_log10_edges": GRAD_HIST_LOG10_EDGES}


@torch.no_grad()
def geonorm_angles(model: GPT, inputs: torch.Tensor) -> dict[str, list[float]]:
    """GeoNorm's applied angle theta' (GeoNorm eq. 5) of each residual update on one batch, mean
    and max over tokens: geonorm_theta_{attn,mlp}_{mean,max}, one value per layer."""
    stats: dict[str, list] = {f"geonorm_theta_{u}_{s}": [] for u in ("attn", "mlp") for s in ("mean", "max")}

    def hook(name: str):
        def record(step: GeodesicStep, args: tuple, output: torch.Tensor) -> None:
            theta = step.angle(*args)[0].float()
            stats[f"geonorm_theta_{name}_mean"].append(theta.mean())
            stats[f"geonorm_theta_{name}_max"].append(theta.max())
        return record

    hooks = [getattr(block, u).combine.register_forward_hook(hook(u))
             for block in model.blocks for u in ("attn", "mlp")]
    training = model.training
    model.eval()
    try:
        model(inputs)
    finally:
        model.train(training)
        for h in hooks:
            h.remove()
    return {k: torch.stack(v).tolist() for k, v in stats.items()}


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
    if cfg.log_geonorm_angles and gptconf.scheme.combine != "geodesic":
        raise ConfigError(f"log_geonorm_angles needs GeoNorm's geodesic step (norm_scheme='geonorm' or "
                          f"combine='geodesic'); this model combines by {gptconf.scheme.combine!r}")
    torch.manual_seed(cfg.seed)  # the same init on every rank
    model = GPT(gptconf).to(device)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    optimizer = optim.build_optimizer(
        model, cfg.optimizer, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
        betas=(cfg.beta1, cfg.beta2), device_type=device.split(":")[0], momentum=cfg.momentum,
        nesterov=cfg.nesterov, matrix_lr=cfg.matrix_lr, matrix_momentum=cfg.matrix_momentum,
        matrix_weight_decay=cfg.matrix_weight_decay,
        dual_steps=cfg.dual_steps, dual_lr=cfg.dual_lr, dual_reset=cfg.dual_reset,
        msign_steps=cfg.msign_steps, ns_steps=cfg.ns_steps, adjust_lr=cfg.adjust_lr)
    if checkpoint is not None:
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(checkpoint["optimizer"])
        for group, fresh in zip(optimizer.param_groups, settings, strict=True):
            group.update(fresh)  # the config's hyperparameters win over the checkpoint's
    return gptconf, model, optimizer


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
    # residual-stream RMS after each block on one val batch (Bir et al. Fig. 3)
    out["block_rms"] = block_activation_rms(raw_model, val_inputs(task))
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


def first_nonfinite_iter(first_bad: torch.Tensor, ddp: Dist) -> int | None:
    """The earliest iteration, over all ranks, whose training loss was not finite (one host sync)."""
    it = int(all_ranks(first_bad, ddp, dist.ReduceOp.MIN).item())
    return None if it == NEVER else it


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
            training = model.training
            model.eval()
            rms = block_activation_rms(model, inputs)
            model.train(training)
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
    ddp, device = setup_distributed(cfg)
    accum = accumulation_per_rank(cfg, ddp.world_size)
    if ddp.master:
        os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    checkpoint = load_checkpoint(ckpt_path, device) if cfg.init_from == "resume" else None
    if checkpoint is None and os.path.exists(ckpt_path) and not cfg.overwrite and not cfg.eval_only:
        raise ConfigError(f"{ckpt_path} already exists; continue it with --init_from=resume, choose another "
                          "--out_dir, or pass --overwrite=True to replace it")
    task = make_task(cfg, model_args, device, ddp.master)
    gptconf, model, optimizer = build(cfg, model_args, task, device, checkpoint)
    raw_model = model
    dtype = autocast_dtype(cfg, device)
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    if checkpoint is not None and checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])
    if cfg.compile:
        model = torch.compile(model)
    if ddp.world_size > 1:
        model = DDP(model, device_ids=[ddp.local_rank] if device_type == "cuda" else None)

    start_iter = iter_num = checkpoint["iter_num"] if checkpoint else 0
    skipped = checkpoint.get("skipped_steps", 0) if checkpoint else 0  # batches whose update was dropped
    best_val = checkpoint["best_val_loss"] if checkpoint else float("inf")
    wandb_run = None
    if cfg.wandb_log and ddp.master:
        import wandb

        wandb_run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=asdict(cfg))
    log = MetricsLog(cfg.out_dir, ddp.master, iter_num if checkpoint else None, cfg.eval_only, wandb_run)
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
            print(f"resuming at iter {iter_num} (saved by {checkpoint['world_size']} process(es))"
                  + (f"; changed: {', '.join(changed)}" if changed else ""))

    def checkpoint_state() -> dict:
        return {"format": CHECKPOINT_FORMAT, "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "iter_num": iter_num, "best_val_loss": best_val,
                "model_args": asdict(gptconf), "config": asdict(cfg), "world_size": ddp.world_size,
                "skipped_steps": skipped, **({"data_meta": task.data.meta} if cfg.task == "lm" else {})}

    # the first iteration with a non-finite training loss, kept on the device: no sync per step
    first_bad = torch.full((), NEVER, dtype=torch.int64, device=device)
    t_last, iters_since_log = time.perf_counter(), 0
    while True:
        if iter_num % cfg.eval_interval == 0 or iter_num >= cfg.max_iters or cfg.eval_only:
            metrics = evaluate(model, raw_model, task, ddp, autocast)
            # never save a checkpoint from non-finite state; all ranks agree
            finite = all(math.isfinite(metrics[f"{split}_loss"]) for split in task.eval_splits())  # the model's own
            finite = finite or cfg.skip_nonfinite > 0  # when skipping, only non-finite state stops the run
            if all_ranks(torch.tensor(float(not finite or bool(nonfinite_state(raw_model, optimizer))),
                                      device=device), ddp).item():
                return report_divergence(log, ddp, iter_num, "non-finite eval loss or state", raw_model, optimizer,
                                         val_inputs(task))
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
                if iter_num > start_iter and not cfg.eval_only and (cfg.always_save_checkpoint or improved):
                    state = checkpoint_state()
                    save_checkpoint(ckpt_path, state)
                    if cfg.keep_every and iter_num % cfg.keep_every == 0:
                        save_checkpoint(os.path.join(cfg.out_dir, f"ckpt_{iter_num}.pt"), state)
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
            optimizer.zero_grad(set_to_none=True)  # drop this batch's update (Bir et al.'s loop); a sync per step
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

        log_now = iter_num % cfg.log_interval == 0
        if log_now or iter_num % cfg.eval_interval == 0 or iter_num >= cfg.max_iters:  # before any log or save
            bad_iter = first_nonfinite_iter(first_bad, ddp)  # the same on every rank, so all stop together
            if bad_iter is not None:
                return report_divergence(log, ddp, bad_iter + 1, "non-finite training loss", raw_model, optimizer,
                                         model_inputs(task.train_batch(bad_iter, 0)))
        if log_now:
            lossf = (all_ranks(loss_sum, ddp) / ddp.world_size).item()  # the global batch's loss
            dt = (time.perf_counter() - t_last) / iters_since_log
            t_last, iters_since_log = time.perf_counter(), 0
            if ddp.master:
                mfu = flops_per_iter / dt / peak
                print(f"iter {iter_num}: loss {lossf:.4f}, lr {optimizer.param_groups[0]['lr']:.3g}, "
                      f"{dt * 1000:.1f} ms/iter, {tokens_per_iter / dt:,.0f} tok/s, mfu {100 * mfu:.1f}%")
                log.write(kind="train", iter=iter_num, loss=lossf, lr=optimizer.param_groups[0]["lr"],
                          ms_per_iter=dt * 1000, tokens_per_s=tokens_per_iter / dt, mfu=mfu,
                          **({"skipped": skipped} if cfg.skip_nonfinite else {}))

    if ddp.master and cfg.sample_tokens > 0 and cfg.task == "lm":
        print_sample(raw_model, task.data.meta, cfg.sample_tokens, device)
    return 0


def print_sample(model: GPT, meta: dict, n_tokens: int, device: str) -> None:
    tokenizer = prepare_data.tokenizer_from_meta(meta)
    start = torch.tensor([tokenizer.encode("\n")], device=device)
    out = model.generate(start, n_tokens, temperature=0.8, top_k=200, generator=torch.Generator(device).manual_seed(0),
                         vocab_limit=tokenizer.vocab_size)
    print("-" * 40 + " sample\n" + tokenizer.decode(out[0].tolist()) + "\n" + "-" * 40)


def main() -> None:
    try:
        code = train(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        code = EXIT_CONFIG
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()

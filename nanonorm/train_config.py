"""
The training configuration: `TrainConfig`'s keys and defaults, a config file of plain assignments with
`--key=value` overrides, and the checks that stop a bad value before anything runs (`ConfigError`, exit 2).
Every key is a field of `TrainConfig`, of `model.GPTConfig` or a column of `model.Scheme` (overriding the
scheme's row); anything else stops with a message. `python train.py --help` lists them.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
import math
import os
import re
import sys
import traceback
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

import optim
from model import ELEMENTWISE_NORMS, GPTConfig, Scheme, block_scheme


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"  # the run's folder: checkpoints, metrics.jsonl and the lock that keeps other runs out
    eval_interval: int = 250  # evaluate, and checkpoint, every this many iterations and at the end
    log_interval: int = 10  # print and log the training loss every this many iterations
    eval_iters: int = 20  # batches per split in each evaluation (the least-squares task: its fixed eval set)
    init_from: str = "scratch"  # "scratch": a new run; "resume": go on from out_dir's checkpoint; "eval": evaluate it
    always_save_checkpoint: bool = True  # write ckpt.pt at every evaluation; False: only when val_loss improves
    overwrite: bool = False  # let a new run delete an earlier run's checkpoints and metrics in out_dir
    keep_every: int = 0  # also keep ckpt_<iter>.pt every this many iterations (0: none)
    sample_tokens: int = 0  # print this many tokens sampled from the final model (task lm)
    wandb_project: str = ""  # also log every train and eval line, the config and the commit to this wandb project
    wandb_group: str = ""  # the wandb group of the run (sweep.py gives its runs the sweep's out_root name)
    log_diagnostics: bool = False  # eval lines: gradients, sink mass, stream peak and kurtosis; at the end skip losses
    # data
    task: str = "lm"  # "lm": next-token prediction; "icl": Bir et al.'s in-context least squares (icl_task.py)
    dataset: str = "shakespeare_char"  # a folder of data_dir made by prepare_data.py (the embedded ones: on first use)
    compact_vocab: bool = False  # output only the token ids the dataset uses (small corpora: a cheaper head)
    data_dir: str = "data"  # where prepared datasets live
    gradient_accumulation_steps: int = 1  # micro-batches per iteration, over all ranks together
    batch_size: int = 12  # sequences per micro-batch
    icl_pairs: int = 64  # task icl: (x, y) pairs per sequence
    # optimizer and schedule
    optimizer: str = "adamw"  # adamw, sgdw, muon or manifold_muon (optim.py)
    learning_rate: float = 6e-4  # peak rate (AdamW's, SGDW's; the Muons' embeddings, head and gains)
    max_iters: int = 5000  # training iterations
    weight_decay: float = 0.1  # decoupled decay of the >= 2-D parameters (Manifold Muon: not its matrices)
    betas: tuple = (0.9, 0.95)  # AdamW's betas (also the Muons' AdamW side)
    momentum: float | None = None  # sgdw's, or the Muons' matrix momentum; None: the optimizer's (0.9 / 0.95)
    nesterov: bool | None = None  # Nesterov momentum (sgdw, muon, manifold_muon); None: the optimizer's
    matrix_lr: float | None = None  # muon / manifold_muon: the hidden matrices' rate; None: 0.02 / 0.1
    ns_steps: int | None = None  # muon: Newton-Schulz steps; manifold_muon: msign iterations; None: 5 / 10
    adjust_lr: str | None = None  # muon: update scale, "original" or "match_rms_adamw"; None: original
    gradient_scale: str | None = None  # manifold_muon: "unit_rms" (paper) or "raw" (released code); None: unit_rms
    dual_init: str | None = None  # manifold_muon: first dual, "bernstein" or "zero" (released code); None: bernstein
    dual_steps: int | None = None  # manifold_muon: dual-ascent steps per update; None: 1
    dual_lr: float | None = None  # manifold_muon: dual-ascent step size; None: 0.01
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: no clipping)
    skip_nonfinite: int = 0  # drop the update of up to this many non-finite batches, then stop (0: stop at once)
    lr_schedule: str = "cosine"  # after warmup: "cosine" to min_lr (nanoGPT), "wsd" (flat, then linear), "constant"
    warmup_iters: int = 100  # linear warmup from 0
    lr_decay_iters: int = 5000  # the schedule reaches min_lr here
    cooldown_iters: int = 0  # wsd: the linear decay takes the last this many iterations before lr_decay_iters
    min_lr: float = 6e-5  # the schedule's floor
    # system
    device: str = "auto"  # cpu, cuda, cuda:N, mps, or auto (cuda, then mps, then cpu)
    dtype: str = "auto"  # float32, bfloat16, float16, or auto: bf16 (fp16 on old GPUs) on CUDA, float32 else
    compile: bool | None = None  # torch.compile the model; None: on CUDA only (a CPU compile takes minutes)
    seed: int = 1337  # the init, and every batch and dropout mask (a pure function of seed and iteration)
    deterministic: bool = False  # deterministic kernels (use_deterministic_algorithms; cuBLAS workspace, no benchmark)
    dist_timeout: float = 1800.0  # seconds a rank waits for the others (torchrun) before it stops with a message


TRAIN_KEYS = {f.name: f for f in fields(TrainConfig)}
OPTIMIZER_KEYS = [k for k in TRAIN_KEYS if any(k in names for names in optim.OPTIONS.values())]  # optim.py's own
TASK_SET = ("vocab_size", "in_features", "out_features", "embed_fan_in")  # GPTConfig fields the task sets
MODEL_KEYS = {f.name: f for f in fields(GPTConfig) if f.name not in (*TASK_SET, "overrides")}
SCHEME_KEYS = set(Scheme._fields)  # a column of the scheme's row, overridden (GPTConfig.overrides)
KEYS = [*TRAIN_KEYS, *MODEL_KEYS, *Scheme._fields]


# float keys reach the model and the optimizer's update as float32 numbers (a norm's alpha, a softcap, QK-Clip's
# threshold, a learning rate): a magnitude above its largest one is infinite there, a positive one below its smallest
# normal one is 0 or loses its precision
FLOAT32 = torch.finfo(torch.float32)


class ConfigError(ValueError):
    """A config key or value the user has to fix; train.py exits with code 2."""


def exit_with(main: Callable[[], int]) -> typing.NoReturn:
    """sys.exit(main()) for a command line tool; a reader that closes stdout early (`sweep.py --dry_run | head`)
    ends it quietly with 141 (128 + SIGPIPE), as Unix tools do, not with a BrokenPipeError traceback."""
    try:
        sys.exit(main())
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail too
        sys.exit(141)


ADAMW_SIDE = ("adamw", "muon", "manifold_muon")  # optimizers that update some parameters with AdamW's betas


def places_norm(m: GPTConfig) -> bool:
    """Whether the model has a norm of type `norm` anywhere: on the input, before, inside or after a sub-layer, at
    the end, or in the first blocks of Mix-LN (post) or HybridNorm* (pre); the q/k/v norms are RMSNorms whatever
    `norm` says."""
    return any(block_scheme(m, layer).normalizes("input", "pre", "pre_attn", "pre_mlp", "mid", "post", "post_attn",
                                                  "final") for layer in range(m.n_layer))


def normalizes_heads(m: GPTConfig) -> bool:
    """Whether q, k (or v) go through an RMSNorm (nGPT's sphere attention normalizes them its own way)."""
    return m.scheme.normalizes("qk", "qk_all", "qkv", "k", "v") and not m.hypersphere


def uses(*optimizers: str) -> tuple[Callable[[TrainConfig, GPTConfig], bool], str]:
    return (lambda t, m: t.optimizer in optimizers), f"optimizer {' or '.join(optimizers)}"


# When a key has an effect, given the run's TrainConfig t and GPTConfig m, and that condition in words. A key
# set to a value other than its default where it has none prints one warning line; a new key is one row.
TAKES_EFFECT: dict[str, tuple[Callable[[TrainConfig, GPTConfig], bool], str]] = {
    "betas": uses(*ADAMW_SIDE),
    "momentum": uses("sgdw", "muon", "manifold_muon"),
    "nesterov": uses("sgdw", "muon", "manifold_muon"),
    "matrix_lr": uses("muon", "manifold_muon"),
    "ns_steps": uses("muon", "manifold_muon"),
    "adjust_lr": uses("muon"),
    **{key: uses("manifold_muon") for key in ("gradient_scale", "dual_init", "dual_steps", "dual_lr")},
    "warmup_iters": (lambda t, m: t.lr_schedule != "constant", "lr_schedule cosine or wsd"),
    "lr_decay_iters": (lambda t, m: t.lr_schedule != "constant", "lr_schedule cosine or wsd"),
    "min_lr": (lambda t, m: t.lr_schedule != "constant", "lr_schedule cosine or wsd"),
    "cooldown_iters": (lambda t, m: t.lr_schedule == "wsd", "lr_schedule='wsd'"),
    "compact_vocab": (lambda t, m: t.task == "lm", "task='lm'"),
    "sample_tokens": (lambda t, m: t.task == "lm", "task='lm'"),
    "icl_pairs": (lambda t, m: t.task == "icl", "task='icl'"),
    "wandb_group": (lambda t, m: bool(t.wandb_project), "wandb_project set"),
    "norm": (lambda t, m: places_norm(m), "a scheme with input, pre, mid, post or final norms"),
    "norm_eps": (lambda t, m: places_norm(m) and m.norm not in ELEMENTWISE_NORMS or normalizes_heads(m),
                 "LayerNorm, RMSNorm or head-wise norms, or q/k/v norms"),
    "norm_affine": (lambda t, m: places_norm(m) or normalizes_heads(m), "a scheme with norms"),
    "norm_alpha_init": (lambda t, m: m.norm in ELEMENTWISE_NORMS and places_norm(m), "norm='dyt' or 'derf'"),
    **{key: (lambda t, m: m.scheme.combine == "geodesic", "the geodesic step (norm_scheme='geonorm')")
       for key in ("geonorm_decay", "geonorm_clamp", "geonorm_radius")},
}


def default(key: str) -> object:
    """A key's default: TrainConfig's, GPTConfig's, or the value of its column in the chosen row (None here)."""
    return TRAIN_KEYS[key].default if key in TRAIN_KEYS else MODEL_KEYS[key].default if key in MODEL_KEYS else None


def ineffective_settings(settings: dict, train: TrainConfig, model: GPTConfig) -> list[str]:
    """The settings that change nothing in this run (a value other than the default, where the key has no
    effect), each with where it would have one. A base config's defaults, star-imported, are not named."""
    found = []
    for key, value in settings.items():
        effective, words = TAKES_EFFECT.get(key, (lambda t, m: True, ""))
        if value != default(key) and not effective(train, model):
            found.append(f"{key} (only with {words})")
    return found


# ----------------------------------------------------------------------------- configuration


def _expected_types(name: str) -> tuple[type, ...]:
    owner = TrainConfig if name in TRAIN_KEYS else GPTConfig if name in MODEL_KEYS else Scheme
    hint = typing.get_type_hints(owner)[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    allowed = tuple(type(None) if a is type(None) else a for a in args)
    return allowed + ((int,) if float in allowed else ())


def check_value(name: str, value: object) -> object:
    """Check a value against the key's type; ints are accepted for floats."""
    if name not in KEYS:
        set_by_task = f"; {name} is set by the task and its data" if name in TASK_SET else ""
        close = difflib.get_close_matches(name, KEYS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close and not set_by_task else ""
        raise ConfigError(f"unknown config key '{name}'{set_by_task}{hint} (python train.py --help lists the keys)")
    allowed = _expected_types(name)
    if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
        names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed[:2])
        raise ConfigError(f"config key '{name}' expects {names}, got {value!r} ({type(value).__name__})")
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{name}' expects a finite number, got {value}")
    for number in value if isinstance(value, tuple) else (value,):
        if isinstance(number, float) and not (number == 0 or FLOAT32.tiny <= abs(number) <= FLOAT32.max):
            raise ConfigError(f"config key '{name}' is {value!r}, outside what float32 (the number type of the model "
                              f"and its updates) holds: give 0 or a magnitude from {FLOAT32.tiny:.1e} to "
                              f"{FLOAT32.max:.1e}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        raise ConfigError(f"config key '{name}' expects a number below 2**63, got {value}")
    return value


def read_config_file(path: str) -> dict:
    """Execute a config file of plain assignments and return its public names."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found (see configs/ for examples)")
    namespace: dict = {}
    try:
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), path, "exec")
        exec(code, namespace)
    except SyntaxError as e:
        raise ConfigError(f"config file {path}, line {e.lineno}: {e.msg}. A config file holds Python assignments "
                          "such as n_layer = 6") from None
    except Exception as e:  # an undefined name, a failed import, a division by zero, a non-UTF-8 file, ...
        line = next((frame.lineno for frame in reversed(traceback.extract_tb(e.__traceback__))
                     if frame.filename == path), None)
        raise ConfigError(f"config file {path}, line {line}: {type(e).__name__}: {e}") from None
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and not isinstance(v, types.ModuleType) and not callable(v)}


def parse_overrides(args: list[str]) -> dict:
    overrides = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"cannot parse argument {arg!r}: use --key=value (python train.py --help lists the keys)")
        key, text = arg[2:].split("=", 1)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            value = text  # a bare word is a string: --norm_scheme=geonorm; so is a value Python cannot build
        if key in KEYS:
            allowed = _expected_types(key)
            if str in allowed and not isinstance(value, allowed):
                value = text  # a text key keeps the text as written: --out_dir=2024, --norms=pre+final
        overrides[key] = value
    return overrides


def explicit_settings(argv: list[str]) -> dict:
    """argv = [config.py] [--key=value ...] -> the settings the config file and the flags give, each checked."""
    settings: dict = {}
    if argv and not argv[0].startswith("--"):
        settings.update(read_config_file(argv[0]))
        argv = argv[1:]
    settings.update(parse_overrides(argv))
    return {k: check_value(k, v) for k, v in settings.items()}


def model_settings(settings: dict) -> dict:
    """The GPTConfig arguments among the settings: its keys, and the scheme columns as its `overrides`."""
    model_args = {k: v for k, v in settings.items() if k in MODEL_KEYS}
    overrides = {k: v for k, v in settings.items() if k in SCHEME_KEYS}
    return {**model_args, "overrides": overrides} if overrides else model_args


def load_config(argv: list[str]) -> tuple[TrainConfig, dict]:
    """argv = [config.py] [--key=value ...] -> (TrainConfig, model keys for GPTConfig); --help lists the keys."""
    if "--help" in argv or "-h" in argv:
        print(help_text())
        raise SystemExit(0)
    settings = explicit_settings(argv)
    train = TrainConfig(**{k: v for k, v in settings.items() if k in TRAIN_KEYS})
    model_args = model_settings(settings)
    check_train_config(train)
    model = check_model_args(train, model_args)
    ineffective = ineffective_settings(settings, train, model)
    if ineffective and os.environ.get("RANK", "0") == "0":
        print(f"warning: no effect in this run: {', '.join(ineffective)}", file=sys.stderr)
    return train, model_args


def help_text() -> str:
    """Every key, a line each: --key=default and what it does (the comment on its line in TrainConfig, GPTConfig
    or Scheme)."""
    lines = ["usage: python train.py [config.py] [--key=value ...]", ""]
    sections = ((TrainConfig, "training"), (GPTConfig, "model"), (Scheme, "scheme columns (default: the row's)"))
    for owner, title in sections:
        lines.append(f"{title}:")
        for key, comment in key_comments(owner).items():
            if key in KEYS:
                lines.append(f"  --{key}={default(key)!r}  {comment}")
    return "\n".join(lines)


def key_comments(owner: type) -> dict[str, str]:
    """The comment after each field of a dataclass or NamedTuple, read from its source."""
    found = {}
    for line in inspect.getsource(owner).splitlines():
        match = re.match(r" {4}(\w+): [^#]+?  # (.*)$", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def check_train_config(cfg: TrainConfig) -> None:
    from icl_task import DIM

    choices = {"init_from": ("scratch", "resume", "eval"), "task": ("lm", "icl"), "optimizer": optim.OPTIMIZERS,
               "dtype": ("auto", "float32", "bfloat16", "float16"), "lr_schedule": ("cosine", "wsd", "constant"),
               "adjust_lr": (None, "original", "match_rms_adamw"), "gradient_scale": (None, *optim.GRADIENT_SCALES),
               "dual_init": (None, *optim.DUAL_INITS)}
    for key, valid in choices.items():
        if getattr(cfg, key) not in valid:
            raise ConfigError(f"{key}={getattr(cfg, key)!r} is not valid; choose one of: "
                              f"{', '.join(str(v) for v in valid)}")
    for key in ("eval_interval", "log_interval", "eval_iters", "gradient_accumulation_steps", "batch_size",
                "icl_pairs", "ns_steps", "dual_steps"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be at least 1")
    for key in ("max_iters", "warmup_iters", "lr_decay_iters", "cooldown_iters", "keep_every", "sample_tokens",
                "grad_clip", "min_lr", "weight_decay", "skip_nonfinite", "dual_lr"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must not be negative")
    if cfg.task == "icl" and cfg.icl_pairs < DIM:  # icl_task.sample_well_conditioned
        raise ConfigError(f"icl_pairs={cfg.icl_pairs} is below the task's dimension {DIM}: with fewer pairs than "
                          f"dimensions every draw of X is rank deficient; give --icl_pairs of at least {DIM}")
    if not cfg.learning_rate > 0:  # the schedule divides by it
        raise ConfigError(f"learning_rate={cfg.learning_rate} must be positive")
    if cfg.matrix_lr is not None and not cfg.matrix_lr > 0:
        raise ConfigError(f"matrix_lr={cfg.matrix_lr} must be positive, or None for the optimizer's default")
    if not 0 <= cfg.seed < 2**32:  # the data and dropout streams hash it as one 32-bit word (stream_seed)
        raise ConfigError(f"seed={cfg.seed} must lie in [0, 2**32)")
    if cfg.keep_every % cfg.eval_interval:  # checkpoints are written at evaluations only
        raise ConfigError(f"keep_every={cfg.keep_every} must be a multiple of eval_interval={cfg.eval_interval}, "
                          "where checkpoints are written")
    if cfg.lr_schedule != "constant" and cfg.min_lr > cfg.learning_rate:
        raise ConfigError(f"min_lr={cfg.min_lr} is above learning_rate={cfg.learning_rate}; the schedule decays "
                          "from learning_rate down to min_lr, so lower --min_lr")
    if len(cfg.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in cfg.betas):
        raise ConfigError(f"betas={cfg.betas!r} must be two numbers in [0, 1), such as (0.9, 0.95)")
    if cfg.momentum is not None and not 0 <= cfg.momentum < 1:
        raise ConfigError(f"momentum={cfg.momentum} must lie in [0, 1)")
    if not 0 < cfg.dist_timeout <= MAX_TIMEOUT_S:
        raise ConfigError(f"dist_timeout={cfg.dist_timeout} must be a positive number of seconds, at most "
                          f"{MAX_TIMEOUT_S:.0e} (about 31 years)")
    if cfg.wandb_project and importlib.util.find_spec("wandb") is None:  # optional: imported only when asked for
        raise ConfigError(f"wandb_project={cfg.wandb_project!r}, but wandb is not installed: pip install wandb "
                          "(or leave wandb_project unset; metrics.jsonl holds every line anyway)")
    check_device(cfg.device)


# the process group's timeout: a timedelta (at most 999999999 days), which torch's C++ side counts in 64-bit
# milli- and nanoseconds (292 years of them); 1e9 s, about 31 years, stays inside all of them
MAX_TIMEOUT_S = 1e9


def use_deterministic(cfg: TrainConfig) -> None:
    """deterministic=True: the same kernels and so the same bits on every run of the same command (a resume
    then matches an uninterrupted run bitwise on a GPU too): torch.use_deterministic_algorithms, which needs
    cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG, read when CUDA starts, so this runs first), and no cuDNN
    autotuning. A CUBLAS_WORKSPACE_CONFIG already set (:16:8 also works) is kept."""
    if not cfg.deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def check_device(device: str) -> None:
    """A device string torch understands, of a kind this machine has."""
    if device == "auto":
        return
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda", "mps") or kind == "cpu" and torch.device(device).index:
        raise ConfigError(f"device={device!r} is not valid; choose auto, cpu, cuda, cuda:N or mps")
    mps = getattr(torch.backends, "mps", None)
    if kind == "cuda" and not torch.cuda.is_available() or kind == "mps" and not (mps and mps.is_available()):
        raise ConfigError(f"device={device!r}, but this machine has no {kind} device; use --device=cpu or auto")
    if kind == "cuda" and (torch.device(device).index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"device={device!r}, but this machine has {torch.cuda.device_count()} cuda device(s), "
                          "numbered from 0; use --device=cuda or auto")


def resolve_device(device: str) -> str:
    """device=auto: cuda if there is one, else mps, else cpu; cpu:0 is cpu (the name torch.load maps and the rest
    of the run checks for); any other device as given."""
    if device != "auto":
        return "cpu" if torch.device(device).type == "cpu" else device
    mps = getattr(torch.backends, "mps", None)
    return "cuda" if torch.cuda.is_available() else "mps" if mps and mps.is_available() else "cpu"


def check_model_args(cfg: TrainConfig, model_args: dict) -> GPTConfig:
    """Model values, checked before any data is read or process started."""
    try:
        config = GPTConfig(**model_args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not 0 <= config.dropout < 1:
        raise ConfigError(f"dropout={config.dropout} must lie in [0, 1)")
    if not config.norm_eps > 0:  # (a negative one is refused by GPTConfig)
        raise ConfigError(f"norm_eps={config.norm_eps} must be positive: it keeps a norm's division away from 0")
    if config.scheme.qk_clip is not None and cfg.optimizer == "manifold_muon":
        raise ConfigError("qk_clip with optimizer=manifold_muon: QK-Clip shrinks W_q and W_k off the Stiefel manifold "
                          "that Manifold Muon keeps them on, and its retraction undoes the clip; use one of the two")
    block_size = model_args.get("block_size")
    if cfg.task == "icl" and block_size is not None and block_size < 2 * cfg.icl_pairs:
        raise ConfigError(f"block_size={block_size} is shorter than a least-squares sequence "
                          f"(2 * icl_pairs = {2 * cfg.icl_pairs} tokens); raise --block_size or lower --icl_pairs")
    return config


def accumulation_per_rank(cfg: TrainConfig, world_size: int) -> int:
    if cfg.gradient_accumulation_steps % world_size:
        raise ConfigError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be divisible by "
                          f"the number of processes ({world_size}); it is the global count, split among them")
    return cfg.gradient_accumulation_steps // world_size


def autocast_dtype(cfg: TrainConfig, device: str) -> torch.dtype:
    """The config's dtype; auto: bf16 on a GPU that has it, else fp16 (with a loss scaler), float32 on a CPU."""
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def lr_multiplier(cfg: TrainConfig, it: int) -> float:
    """Linear warmup, then down to min_lr/learning_rate at lr_decay_iters, and flat after it.

    cosine: nanoGPT's cosine decay over [warmup_iters, lr_decay_iters].
    wsd: warmup, stable, decay (Bir et al.'s schedule: 2% warmup, constant, linear decay over the
    last 10%): flat until lr_decay_iters - cooldown_iters, then linear to the floor.
    """
    if cfg.lr_schedule == "constant":
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

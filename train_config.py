"""
The training configuration: `TrainConfig`'s keys and defaults, a config file of plain assignments with
`--key=value` overrides, and the checks that stop a bad value before anything runs (`ConfigError`, exit 2).
Every key is a field of `TrainConfig` or of `model.GPTConfig`; anything else stops with a message.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import math
import os
import sys
import traceback
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from model import ELEMENTWISE_NORMS, GPTConfig, block_scheme


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
    matrix_nesterov: bool = True  # muon / manifold_muon: Nesterov momentum (the released Manifold Muon: False)
    gradient_scale: str = "unit_rms"  # manifold_muon: G rescaled to singular values of RMS 1, or "raw" (released code)
    dual_init: str = "bernstein"  # manifold_muon: first dual -1/4 (W^T G + G^T W), or "zero" (released code)
    direction_dtype: str = "bfloat16"  # manifold_muon: precision of the two direction msigns, or "float32"
    dual_steps: int = 1  # manifold_muon: dual-ascent steps per update
    dual_lr: float = 0.01  # manifold_muon: dual-ascent step size
    dual_reset: bool = False  # manifold_muon: re-initialize the dual every step (not online)
    msign_steps: int = 10  # manifold_muon: iterations of the two direction msigns (the retraction polishes on its own)
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
    compile: bool | None = None  # torch.compile the model; None: on CUDA only (a CPU compile takes minutes)
    tf32: bool = True  # CUDA: float32 matmuls and convolutions on TF32 tensor cores (float32 runs; bf16 is unaffected)
    seed: int = 1337
    dist_timeout: float = 1800.0  # seconds a rank waits for the others (torchrun) before it stops with a message
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


ADAMW_SIDE = ("adamw", "muon", "manifold_muon")  # optimizers that update some parameters with AdamW's betas
MATRIX_OPTIMIZERS = ("muon", "manifold_muon")


def places_norm(m: GPTConfig) -> bool:
    """Whether the model has a norm of type `norm` anywhere: on the input, before, inside or after a sub-layer, at
    the end, or in the first blocks of Mix-LN (post) or HybridNorm* (pre); the q/k/v norms are RMSNorms whatever
    `norm` says."""
    blocks = [block_scheme(m, layer) for layer in range(m.n_layer)]
    return bool(m.scheme.input_norm or m.scheme.final_norm
                or any(b.pre_norm != "none" or b.mid_norm or b.post_norm for b in blocks))


def normalizes_heads(m: GPTConfig) -> bool:
    """Whether q, k (or v) go through an RMSNorm (nGPT's sphere attention normalizes them its own way)."""
    return bool((m.scheme.qk_norm or m.scheme.v_norm) and not m.scheme.hypersphere)


# When a key has an effect, given the run's TrainConfig t and GPTConfig m, and that condition in words. A key
# set to a value other than its default where it has none prints one warning line; a new key is one row.
TAKES_EFFECT: dict[str, tuple[Callable[[TrainConfig, GPTConfig], bool], str]] = {
    "beta1": (lambda t, m: t.optimizer in ADAMW_SIDE, "optimizer adamw, muon or manifold_muon"),
    "beta2": (lambda t, m: t.optimizer in ADAMW_SIDE, "optimizer adamw, muon or manifold_muon"),
    "momentum": (lambda t, m: t.optimizer == "sgdw", "optimizer sgdw"),
    "nesterov": (lambda t, m: t.optimizer == "sgdw", "optimizer sgdw"),
    "matrix_lr": (lambda t, m: t.optimizer in MATRIX_OPTIMIZERS, "optimizer muon or manifold_muon"),
    "matrix_momentum": (lambda t, m: t.optimizer in MATRIX_OPTIMIZERS, "optimizer muon or manifold_muon"),
    "matrix_weight_decay": (lambda t, m: t.optimizer in MATRIX_OPTIMIZERS, "optimizer muon or manifold_muon"),
    "matrix_nesterov": (lambda t, m: t.optimizer in MATRIX_OPTIMIZERS, "optimizer muon or manifold_muon"),
    **{key: (lambda t, m: t.optimizer == "manifold_muon", "optimizer manifold_muon")
       for key in ("gradient_scale", "dual_init", "direction_dtype")},
    "ns_steps": (lambda t, m: t.optimizer == "muon", "optimizer muon"),
    "adjust_lr": (lambda t, m: t.optimizer == "muon", "optimizer muon"),
    "dual_steps": (lambda t, m: t.optimizer == "manifold_muon", "optimizer manifold_muon"),
    "dual_lr": (lambda t, m: t.optimizer == "manifold_muon", "optimizer manifold_muon"),
    "dual_reset": (lambda t, m: t.optimizer == "manifold_muon", "optimizer manifold_muon"),
    "msign_steps": (lambda t, m: t.optimizer == "manifold_muon", "optimizer manifold_muon"),
    "warmup_iters": (lambda t, m: t.decay_lr, "decay_lr=True"),
    "lr_schedule": (lambda t, m: t.decay_lr, "decay_lr=True"),
    "lr_decay_iters": (lambda t, m: t.decay_lr, "decay_lr=True"),
    "min_lr": (lambda t, m: t.decay_lr, "decay_lr=True"),
    "cooldown_iters": (lambda t, m: t.decay_lr and t.lr_schedule == "wsd", "lr_schedule='wsd'"),
    "wandb_project": (lambda t, m: t.wandb_log, "wandb_log=True"),
    "wandb_run_name": (lambda t, m: t.wandb_log, "wandb_log=True"),
    "compact_vocab": (lambda t, m: t.task == "lm", "task='lm'"),
    "sample_tokens": (lambda t, m: t.task == "lm", "task='lm'"),
    **{key: (lambda t, m: t.task == "icl", "task='icl'")
       for key in ("icl_pairs", "icl_dim", "icl_noise_std", "icl_order", "icl_bias_feature", "icl_eval_batches")},
    "dnt_setting": (lambda t, m: m.norm_scheme == "dnt", "norm_scheme='dnt'"),
    # DyT and Derf also bring a gain on the embedding (see embed_scale), norms or not
    "norm": (lambda t, m: places_norm(m) or m.norm in ELEMENTWISE_NORMS and m.embed_scale is None,
             "a scheme with input, pre, mid, post or final norms"),
    "norm_eps": (lambda t, m: places_norm(m) and m.norm not in ELEMENTWISE_NORMS or normalizes_heads(m),
                 "LayerNorm, RMSNorm or head-wise norms, or q/k/v norms"),
    "norm_affine": (lambda t, m: places_norm(m) or normalizes_heads(m), "a scheme with norms"),
    "qk_norm_span": (lambda t, m: normalizes_heads(m), "qk_norm or v_norm"),
    "post_norm_at": (lambda t, m: m.scheme.post_norm, "post_norm"),
    "geonorm_decay": (lambda t, m: m.scheme.combine == "geodesic", "the geodesic step (norm_scheme='geonorm')"),
    "geonorm_clamp": (lambda t, m: m.scheme.combine == "geodesic", "the geodesic step (norm_scheme='geonorm')"),
    "geonorm_clamp_sides": (lambda t, m: m.scheme.combine == "geodesic", "the geodesic step (norm_scheme='geonorm')"),
    "geonorm_affine": (lambda t, m: m.scheme.combine == "geodesic", "the geodesic step (norm_scheme='geonorm')"),
    "geonorm_radius": (lambda t, m: m.scheme.combine == "geodesic", "the geodesic step (norm_scheme='geonorm')"),
    "rope_base": (lambda t, m: m.pos == "rope", "pos='rope'"),
    "mixln_fraction": (lambda t, m: m.scheme.first_blocks == "post", "norm_scheme='mixln' (first_blocks='post')"),
    "rezero_gate": (lambda t, m: m.scheme.combine == "rezero", "norm_scheme='rezero'"),
    "ngpt_alpha_init": (lambda t, m: m.scheme.combine == "nlerp", "norm_scheme='ngpt'"),
    **{key: (lambda t, m: m.norm in ("dyt", "derf"), "norm='dyt' or 'derf'")
       for key in ("norm_alpha_init", "norm_alpha_init_attn", "norm_alpha_init_final")},
    "embed_fan_in": (lambda t, m: t.task == "icl" or m.in_features is not None, "vector inputs (task='icl')"),
}


def ineffective_settings(settings: dict, train: TrainConfig, model: GPTConfig) -> list[str]:
    """The settings that change nothing in this run (a value other than the default, where the key has no
    effect), each with where it would have one. A base config's defaults, star-imported, are not named."""
    found = []
    for key, value in settings.items():
        effective, words = TAKES_EFFECT.get(key, (lambda t, m: True, ""))
        default = (TRAIN_KEYS if key in TRAIN_KEYS else MODEL_KEYS)[key].default
        if value != default and not effective(train, model):
            found.append(f"{key} (only with {words})")
    return found


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
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{name}' expects a finite number, got {value}")
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
            raise ConfigError(f"cannot parse argument {arg!r}: use --key=value")
        key, text = arg[2:].split("=", 1)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            value = text  # a bare word is a string: --norm_scheme=geonorm; so is a value Python cannot build
        if key in TRAIN_KEYS or key in MODEL_KEYS:
            allowed = _expected_types(key)
            if str in allowed and not isinstance(value, allowed):
                value = text  # a text key keeps the text as written: --out_dir=2024, --wandb_run_name=1e-3
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


def load_config(argv: list[str]) -> tuple[TrainConfig, dict]:
    """argv = [config.py] [--key=value ...] -> (TrainConfig, model keys for GPTConfig)."""
    settings = explicit_settings(argv)
    train = TrainConfig(**{k: v for k, v in settings.items() if k in TRAIN_KEYS})
    model_args = {k: v for k, v in settings.items() if k in MODEL_KEYS}
    check_train_config(train)
    model = check_model_args(train, model_args)
    ineffective = ineffective_settings(settings, train, model)
    if ineffective and os.environ.get("RANK", "0") == "0":
        print(f"warning: no effect in this run: {', '.join(ineffective)}", file=sys.stderr)
    return train, model_args


def check_train_config(cfg: TrainConfig) -> None:
    import optim

    choices = {"init_from": ("scratch", "resume"), "task": ("lm", "icl"),
               "optimizer": optim.OPTIMIZERS, "dtype": ("auto", "float32", "bfloat16", "float16"),
               "backend": ("auto", "nccl", "gloo"), "icl_order": ("random", "xy", "yx"),
               "adjust_lr": ("original", "match_rms_adamw"), "lr_schedule": ("cosine", "wsd"),
               "gradient_scale": optim.GRADIENT_SCALES, "dual_init": optim.DUAL_INITS,
               "direction_dtype": tuple(optim.DIRECTION_DTYPES)}
    for key, valid in choices.items():
        if getattr(cfg, key) not in valid:
            raise ConfigError(f"{key}={getattr(cfg, key)!r} is not valid; choose one of: {', '.join(valid)}")
    for key in ("eval_interval", "log_interval", "eval_iters", "gradient_accumulation_steps", "batch_size",
                "icl_pairs", "icl_dim", "icl_eval_batches", "ns_steps", "dual_steps", "msign_steps"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be at least 1")
    for key in ("max_iters", "warmup_iters", "lr_decay_iters", "cooldown_iters", "keep_every", "sample_tokens",
                "grad_clip", "min_lr", "weight_decay", "skip_nonfinite", "dual_lr", "icl_noise_std"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must not be negative")
    if cfg.task == "icl" and cfg.icl_pairs < cfg.icl_dim:  # icl_task.sample_well_conditioned
        raise ConfigError(f"icl_pairs={cfg.icl_pairs} is below icl_dim={cfg.icl_dim}: with fewer pairs than "
                          "dimensions every draw of X is rank deficient; give --icl_pairs of at least --icl_dim")
    if not cfg.learning_rate > 0:  # the schedule divides by it
        raise ConfigError(f"learning_rate={cfg.learning_rate} must be positive")
    if cfg.matrix_lr is not None and not cfg.matrix_lr > 0:
        raise ConfigError(f"matrix_lr={cfg.matrix_lr} must be positive, or None for the optimizer's default")
    if not 0 <= cfg.seed < 2**32:  # the data and dropout streams hash it as one 32-bit word (train.stream_seed)
        raise ConfigError(f"seed={cfg.seed} must lie in [0, 2**32)")
    if cfg.keep_every % cfg.eval_interval:  # checkpoints are written at evaluations only
        raise ConfigError(f"keep_every={cfg.keep_every} must be a multiple of eval_interval={cfg.eval_interval}, "
                          "where checkpoints are written")
    if cfg.wandb_log and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb_log=True needs the wandb package: pip install wandb, or drop --wandb_log")
    if cfg.decay_lr and cfg.min_lr > cfg.learning_rate:
        raise ConfigError(f"min_lr={cfg.min_lr} is above learning_rate={cfg.learning_rate}; the schedule decays "
                          "from learning_rate down to min_lr, so lower --min_lr")
    fractions = {"momentum": cfg.optimizer == "sgdw", "matrix_momentum": cfg.optimizer in MATRIX_OPTIMIZERS,
                 "beta1": cfg.optimizer in ADAMW_SIDE, "beta2": cfg.optimizer in ADAMW_SIDE}
    for key, used in fractions.items():
        if used and not 0 <= getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)} must lie in [0, 1) (optimizer {cfg.optimizer!r} uses it)")
    if not cfg.dist_timeout > 0:
        raise ConfigError(f"dist_timeout={cfg.dist_timeout} must be a positive number of seconds")
    check_device(cfg.device)


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
    """device=auto: cuda if there is one, else mps, else cpu; any other device as given."""
    if device != "auto":
        return device
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
    check_vector_shape(cfg, model_args)
    block_size = model_args.get("block_size")
    if cfg.task == "icl" and block_size is not None and block_size < 2 * cfg.icl_pairs:
        raise ConfigError(f"block_size={block_size} is shorter than a least-squares sequence "
                          f"(2 * icl_pairs = {2 * cfg.icl_pairs} tokens); raise --block_size or lower --icl_pairs")
    return config


def check_vector_shape(cfg: TrainConfig, model_args: dict) -> None:
    """in_features and out_features belong to the task: the least-squares task sets them from its dimension,
    a language model has none."""
    from icl_task import token_dim

    if cfg.task == "lm":  # (embed_fan_in alone changes nothing there: ineffective_settings warns of it)
        given = [k for k in ("in_features", "out_features") if model_args.get(k) is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)} set a model of vector tokens, which only task='icl' trains; "
                              "drop them (a language model reads token ids)")
        return
    shape = {"in_features": (token_dim(cfg.icl_dim, cfg.icl_bias_feature), "features per token"),
             "out_features": (cfg.icl_dim, "values per prediction")}
    for key, (value, what) in shape.items():
        if model_args.get(key) not in (None, value):
            raise ConfigError(f"{key}={model_args[key]} does not fit the least-squares task, which has {value} "
                              f"{what} (icl_dim={cfg.icl_dim}, icl_bias_feature={cfg.icl_bias_feature}); drop "
                              f"--{key}: the task sets it")


def accumulation_per_rank(cfg: TrainConfig, world_size: int) -> int:
    if cfg.gradient_accumulation_steps % world_size:
        raise ConfigError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be divisible by "
                          f"the number of processes ({world_size}); it is the global count, split among them")
    return cfg.gradient_accumulation_steps // world_size

"""
Train a nanoNorm GPT: one loop for one CPU, one GPU, or many GPUs and nodes.

    python train.py configs/quickstart.py                       # CPU or one GPU
    python train.py configs/quickstart.py --n_layer=2 --compile=True
    torchrun --standalone --nproc_per_node=8 train.py configs/geonorm_125m.py
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 \\
        --nproc_per_node=8 train.py configs/geonorm_125m.py     # then node_rank=1 on the other

A config file is Python assignments (`n_layer = 6`); `--key=value` overrides it; `--help` lists
every key (train_config.py), and anything else stops with a message.

Read top to bottom as nanoGPT's train.py: config, data (lm_task.py, icl_task.py), model and optimizer
(build), the training loop. What a run guarantees lives beside it: the same batches and dropout masks
whatever the number of ranks, and bitwise resumes (lm_task.py, resume.py); exit codes, divergence and
stop signals on which all ranks agree (guards.py); diagnostics on request (diagnostics.py).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig
from nanonorm.diagnostics import (
    device_peak_flops,
    geonorm_angles,
    gradient_statistics,
    residual_stream_metrics,
    skipping,
)
from nanonorm.guards import (
    EXIT_STOPPED,
    NEVER,
    Dist,
    StopSignals,
    all_ranks,
    batch_is_finite,
    check_in,
    claim_out_dir,
    eval_divergence,
    exit_code,
    lost_ranks_named,
    nonfinite_state,
    report_divergence,
    reuse_freed_memory,
    setup_distributed,
    stop_with_checkpoint,
    stopped_during_setup,
)
from nanonorm.lm_task import Task, check_batch_fits, dropout_seed, make_task, model_inputs, print_sample, val_inputs
from nanonorm.resume import (
    check_same_data,
    checkpoint_to_load,
    load_optimizer_state,
    load_weights,
    open_log,
    resume_model_args,
    resume_summary,
    resumed_settings,
    save_evaluated,
    starting_point,
)
from nanonorm.run_files import CHECKPOINT_FORMAT, MetricsLog, foreign_checkpoint
from nanonorm.train_config import OPTIMIZER_KEYS, ConfigError, TrainConfig, accumulation_per_rank, load_config


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


def build(cfg: TrainConfig, model_args: dict, task: Task, device: str,
          checkpoint: dict | None) -> tuple[GPTConfig, GPT, torch.optim.Optimizer]:
    """The model and its optimizer, from the config or, resumed, from the checkpoint (checked first)."""
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
    torch.manual_seed(cfg.seed)  # the same init on every rank
    try:
        model = GPT(gptconf).to(device)
    except RuntimeError as e:  # torch.OutOfMemoryError on a GPU, an allocator's RuntimeError on the CPU
        if "out of memory" not in str(e) and "allocate" not in str(e):
            raise
        raise ConfigError(f"the model (n_layer={gptconf.n_layer}, n_embd={gptconf.n_embd}, vocab_size="
                          f"{gptconf.vocab_size}) does not fit in {device}'s memory; make it smaller") from None
    if checkpoint is not None:
        load_weights(model, checkpoint, cfg.out_dir)
    try:
        optimizer = optim.build_optimizer(
            model, cfg.optimizer, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
            betas=cfg.betas, device_type=device.split(":")[0], **{k: getattr(cfg, k) for k in OPTIMIZER_KEYS})
    except ValueError as e:  # an option the optimizer refuses
        raise ConfigError(f"optimizer {cfg.optimizer}: {e}") from None
    if checkpoint is not None:
        load_optimizer_state(optimizer, checkpoint, cfg)
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


def forward_backward(model: torch.nn.Module, task: Task, ddp: Dist, accum: int, it: int, scaler, autocast,
                     seed: int) -> torch.Tensor:
    """Accumulate the gradients of iteration `it` over this rank's micro-batches; returns its mean loss.
    Global micro-batch k sees the data and dropout masks of (seed, it, k), whatever the world size."""
    loss_sum = None
    for micro in range(accum):
        k = ddp.rank * accum + micro
        torch.manual_seed(dropout_seed(seed, it, k))
        batch = task.train_batch(it, k)
        sync = micro == accum - 1 or ddp.world_size == 1
        with (nullcontext() if sync else model.no_sync()), autocast:
            loss = task.loss(model, batch) / accum
        scaler.scale(loss).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    return loss_sum


@torch.no_grad()
def evaluate(model: torch.nn.Module, raw_model: GPT, task: Task, ddp: Dist, autocast,
             skip_blocks: bool = False) -> dict:
    """Mean loss per split, averaged over all ranks' batches; plus the task's extra metrics, and with skip_blocks
    the val loss increase when each block is left out."""
    model.eval()
    out = {f"{split}_loss": split_loss(model, task, split, ddp, autocast) for split in task.eval_splits()}
    if hasattr(task, "extra_metrics"):
        out.update(task.extra_metrics(model, autocast))
    out.update(residual_stream_metrics(raw_model, val_inputs(task)))
    if skip_blocks:
        out["block_skip_loss"] = []
        for block in raw_model.blocks:
            with skipping(block):
                out["block_skip_loss"].append(split_loss(raw_model, task, "val", ddp, autocast) - out["val_loss"])
    model.train()
    return out


def split_loss(model: torch.nn.Module, task: Task, split: str, ddp: Dist, autocast) -> float:
    total = torch.zeros(2, device=next(model.parameters()).device)
    for batch in task.eval_batches(split, ddp):
        with autocast:
            total += torch.stack([task.loss(model, batch).float(), torch.ones((), device=total.device)])
    all_ranks(total, ddp)
    return (total[0] / total[1]).item()


def evaluates_at(cfg: TrainConfig, iteration: int) -> bool:
    """Whether the loop evaluates at `iteration`: every eval_interval, at the end, and only there to evaluate."""
    return iteration % cfg.eval_interval == 0 or iteration >= cfg.max_iters or cfg.init_from == "eval"


@dataclass
class LoopState:
    """A run once set up: what the training loop works with, and where it stands."""

    cfg: TrainConfig
    ddp: Dist
    device: str
    stop: StopSignals
    task: Task
    raw_model: GPT
    model: torch.nn.Module  # raw_model as trained: wrapped by DDP and compiled, as set up
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: contextlib.AbstractContextManager
    accum: int  # micro-batches per rank and iteration
    log: MetricsLog
    tokens_per_iter: int
    flops_per_iter: float
    peak: float  # matmul peak of all ranks together, FLOP/s
    iter_num: int
    best_val: float
    skipped: int  # batches whose update was dropped
    start_evaluated: bool  # False: a stop save at an eval iteration, before its evaluation; it is evaluated and saved
    start_iter: int = field(init=False)
    eval_iter: int = field(init=False)  # the last evaluation's iteration, skipped count and verdict, for the next
    eval_skipped: int = field(init=False)
    eval_finite: bool = True
    first_bad: torch.Tensor = field(init=False)  # the first iteration with a non-finite training loss, on the device
    t_last: float = field(default_factory=time.perf_counter)
    iters_since_log: int = 0

    def __post_init__(self) -> None:
        self.start_iter = self.eval_iter = self.iter_num
        self.eval_skipped = self.skipped
        self.first_bad = torch.full((), NEVER, dtype=torch.int64, device=self.device)  # no sync per step


def run(cfg: TrainConfig, model_args: dict, ddp: Dist, device: str, stop: StopSignals) -> int:
    """Set up the task, the model, the optimizer and the log (checking a resumed run's checkpoint first), and train."""
    accum = accumulation_per_rank(cfg, ddp.world_size)
    checkpoint = starting_point(cfg, device)
    cfg, task_args = resumed_settings(cfg, model_args, checkpoint)
    check_batch_fits(cfg, task_args, device)
    task = make_task(cfg, task_args, device, ddp.master)
    if checkpoint is not None:
        check_same_data(cfg, checkpoint, task)
    gptconf, model, optimizer = build(cfg, model_args, task, device, checkpoint)
    if stopped_during_setup(stop, ddp, device):
        return EXIT_STOPPED
    dtype = autocast_dtype(cfg, device)
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)
    if device_type == "cuda":  # float32 matmuls on TF32 tensor cores
        torch.set_float32_matmul_precision("high")
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    if checkpoint is not None and checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])
    compiled = cfg.compile if cfg.compile is not None else device_type == "cuda"
    wrapped = wrap_model(model, ddp, device_type, compiled)
    iter_num = checkpoint["iter_num"] if checkpoint else 0
    log = open_log(cfg, ddp, device, checkpoint, reevaluates=evaluates_at(cfg, iter_num))
    tokens_per_iter = task.tokens_per_batch * cfg.gradient_accumulation_steps
    flops_per_iter = model.flops_per_token(task.tokens_per_batch // cfg.batch_size) * tokens_per_iter
    # MFU's denominator, for rank 0's train lines: the other ranks do not log it, and on a CPU measuring takes a second
    peak = device_peak_flops(device, dtype) * ddp.world_size if ddp.master else float("nan")
    if ddp.master:
        has_norm = any("norm" in n and not isinstance(m, torch.nn.Identity) for n, m in model.named_modules())
        norms = f" / {gptconf.norm}" if has_norm else ", no norms"
        print(f"{gptconf.norm_scheme}{norms}: {model.get_num_params() / 1e6:.2f}M parameters, "
              f"{ddp.world_size} process(es) on {device}, {dtype}, {tokens_per_iter:,} tokens per iteration")
        if checkpoint:
            print(resume_summary(cfg, checkpoint))
            if log.moved:
                print(log.moved)
    return train_loop(LoopState(
        cfg, ddp, device, stop, task, model, wrapped, optimizer, scaler, autocast, accum, log,
        tokens_per_iter, flops_per_iter, peak, iter_num,
        best_val=checkpoint["best_val_loss"] if checkpoint else float("inf"),
        skipped=checkpoint.get("skipped_steps", 0) if checkpoint else 0,
        start_evaluated=checkpoint is None or checkpoint.get("evaluated", True)))


def train_loop(s: LoopState) -> int:
    """Evaluate, step and log until max_iters; the exit code (0, or a divergence or a stop: see guards.py)."""
    cfg, model, optimizer, scaler = s.cfg, s.model, s.optimizer, s.scaler
    while True:
        if evaluates_at(cfg, s.iter_num):
            code = evaluate_and_save(s)
            if code is not None:
                return code
        if s.iter_num >= cfg.max_iters or cfg.init_from == "eval":
            break

        mult = lr_multiplier(cfg, s.iter_num)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * mult
        loss_sum = forward_backward(model, s.task, s.ddp, s.accum, s.iter_num, scaler, s.autocast, cfg.seed)
        grad_norm = None
        if cfg.grad_clip > 0 or cfg.skip_nonfinite:  # one norm serves the skip check and the clipping
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        if cfg.skip_nonfinite and not all_ranks(batch_is_finite(loss_sum, grad_norm, scaler), s.ddp,
                                                dist.ReduceOp.MIN).item():
            code = skip_batch(s)  # a sync per step
            if code is not None:
                return code
        else:
            s.first_bad = torch.where(loss_sum.isfinite(), s.first_bad, s.first_bad.clamp(max=s.iter_num))
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.grad_clip, grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            s.raw_model.apply_parameter_constraints()
        s.iter_num += 1
        s.iters_since_log += 1
        if s.iter_num == s.start_iter + 1:  # the first step compiles and warms up: keep it out of ms/iter and MFU
            s.t_last, s.iters_since_log = time.perf_counter(), 0

        log_now = s.iter_num % cfg.log_interval == 0
        # before any log or save; one process also checks for a stop signal after every step (no sync needed),
        # several at these points only, where they sync anyway
        stop_now = False
        if (log_now or s.iter_num % cfg.eval_interval == 0 or s.iter_num >= cfg.max_iters
                or (s.ddp.world_size == 1 and s.stop.received)):
            bad_iter, stop_now = check_in(s.first_bad, s.stop, s.ddp)  # the same on every rank: all stop together
            if bad_iter is not None:
                return report_divergence(s.log, s.ddp, bad_iter + 1, "non-finite training loss", s.raw_model,
                                         optimizer, model_inputs(s.task.train_batch(bad_iter, 0)))
        if log_now:
            log_progress(s, loss_sum)
        if stop_now:  # after the iteration's train line, so the log has every completed iteration
            return stop_after_iteration(s)

    if s.ddp.master and cfg.sample_tokens > 0 and cfg.task == "lm":
        print_sample(s.raw_model, s.task.data.meta, cfg.sample_tokens, s.device, s.stop)
    return 0


def evaluate_and_save(s: LoopState) -> int | None:
    """Evaluate at s.iter_num: a non-finite loss or state ends the run as diverged (its exit code returned);
    else rank 0 prints and logs the evaluation, and saves a checkpoint of it first."""
    cfg = s.cfg
    metrics = evaluate(s.model, s.raw_model, s.task, s.ddp, s.autocast,
                       skip_blocks=cfg.log_diagnostics and s.iter_num >= cfg.max_iters)
    # never save a checkpoint from non-finite state; the losses are all-reduced, so all ranks agree
    finite = all(math.isfinite(metrics[f"{split}_loss"]) for split in s.task.eval_splits())
    reason = eval_divergence(cfg, finite, s.iter_num >= cfg.max_iters or cfg.init_from == "eval",
                             s.iter_num - s.eval_iter, s.skipped - s.eval_skipped)
    s.eval_iter, s.eval_skipped, s.eval_finite = s.iter_num, s.skipped, finite
    if all_ranks(torch.tensor(float(reason is not None or bool(nonfinite_state(s.raw_model, s.optimizer))),
                              device=s.device), s.ddp).item():
        return report_divergence(s.log, s.ddp, s.iter_num, reason or "non-finite eval loss or state", s.raw_model,
                                 s.optimizer, val_inputs(s.task))
    if cfg.log_diagnostics and s.raw_model.config.scheme.combine == "geodesic":  # GeoNorm's angles
        metrics.update(geonorm_angles(s.raw_model, val_inputs(s.task)))
    if cfg.log_diagnostics:  # the gradients this iteration's step will apply (same batches and masks)
        forward_backward(s.model, s.task, s.ddp, s.accum, s.iter_num, s.scaler, s.autocast, cfg.seed)
        if s.ddp.master:
            metrics.update(gradient_statistics(s.raw_model, s.scaler.get_scale() if s.scaler.is_enabled() else 1.0))
        s.optimizer.zero_grad(set_to_none=True)
    if s.ddp.master:
        print(f"iter {s.iter_num}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
        improved = metrics["val_loss"] < s.best_val
        s.best_val = min(s.best_val, metrics["val_loss"])
        if (s.iter_num > s.start_iter or not s.start_evaluated) and cfg.init_from != "eval" and finite:
            save_evaluated(cfg, s.iter_num, lambda: checkpoint_state(s), cfg.always_save_checkpoint or improved)
        s.log.write(kind="eval", iter=s.iter_num, **metrics)  # after the save: a logged eval has its checkpoint
    s.t_last = time.perf_counter()  # evaluation time is not training time
    return None


def skip_batch(s: LoopState) -> int | None:
    """Drop this batch's update (skip_nonfinite); more than skip_nonfinite skipped ends the run as diverged."""
    s.optimizer.zero_grad(set_to_none=True)
    if s.scaler.is_enabled():
        s.scaler.update()  # closes the unscale_ before the check (and lowers the fp16 loss scale)
    s.skipped += 1
    if s.skipped <= s.cfg.skip_nonfinite:
        return None
    return report_divergence(s.log, s.ddp, s.iter_num + 1, f"more than {s.cfg.skip_nonfinite} non-finite losses "
                             "skipped", s.raw_model, s.optimizer, model_inputs(s.task.train_batch(s.iter_num, 0)))


def log_progress(s: LoopState, loss_sum: torch.Tensor) -> None:
    """A train line: the global batch's loss, the learning rate, and the speed since the last line."""
    lossf = (all_ranks(loss_sum, s.ddp) / s.ddp.world_size).item()  # the global batch's loss
    speed = {}
    if s.iters_since_log:  # none yet right after the first step, which is not timed
        dt = (time.perf_counter() - s.t_last) / s.iters_since_log
        speed = {"ms_per_iter": dt * 1000, "tokens_per_s": s.tokens_per_iter / dt,
                 "mfu": s.flops_per_iter / dt / s.peak}
    s.t_last, s.iters_since_log = time.perf_counter(), 0
    if s.ddp.master:
        lr = s.optimizer.param_groups[0]["lr"]
        timing = (f", {speed['ms_per_iter']:.1f} ms/iter, {speed['tokens_per_s']:,.0f} tok/s, "
                  f"mfu {100 * speed['mfu']:.1f}%") if speed else ""
        print(f"iter {s.iter_num}: loss {lossf:.4f}, lr {lr:.3g}{timing}")
        s.log.write(kind="train", iter=s.iter_num, loss=lossf, lr=lr, **speed,
                    **({"skipped": s.skipped} if s.cfg.skip_nonfinite else {}))


def stop_after_iteration(s: LoopState) -> int:
    """A stop signal: save the last completed iteration and log the stop (exit code 4). No save from a state that
    may be poisoned: a non-finite last evaluation or state, or batches skipped since the last evaluation."""
    unsaved = ("its state is not finite" if not s.eval_finite or nonfinite_state(s.raw_model, s.optimizer) else
               "non-finite batches were skipped since the last evaluation" if s.skipped > s.eval_skipped else None)
    state = checkpoint_state(s, evaluated=False) if unsaved is None else None
    return stop_with_checkpoint(s.log, s.ddp, s.stop, s.iter_num, state, s.cfg, unsaved)


def checkpoint_state(s: LoopState, evaluated: bool = True) -> dict:
    """What a checkpoint holds; evaluated: saved after the evaluation at iter_num (a stop save may come before it)."""
    return {"format": CHECKPOINT_FORMAT, "model": s.raw_model.state_dict(), "optimizer": s.optimizer.state_dict(),
            "scaler": s.scaler.state_dict(), "iter_num": s.iter_num, "best_val_loss": s.best_val,
            "model_args": asdict(s.raw_model.config), "config": asdict(s.cfg), "world_size": s.ddp.world_size,
            "skipped_steps": s.skipped, "evaluated": evaluated, "metrics_lines": s.log.lines,
            **({"data_meta": s.task.data.meta} if s.cfg.task == "lm" else {})}


def train(argv: list[str]) -> int:
    """Run the training that `argv` (a config file and --key=value flags) asks for; its exit code."""
    cfg, model_args = load_config(argv)
    checkpoint_to_load(cfg)  # before out_dir is claimed: a mistyped out_dir is not created
    reuse_freed_memory()
    ddp, device = setup_distributed(cfg)
    stop = StopSignals()
    with lost_ranks_named(cfg, ddp, stop), claim_out_dir(cfg.out_dir, ddp, device), stop:
        return run(cfg, model_args, ddp, device, stop)


def main() -> None:
    """The command line: train, and exit with the run's exit code (see guards.py)."""
    sys.exit(exit_code(lambda: train(sys.argv[1:])))


if __name__ == "__main__":
    main()

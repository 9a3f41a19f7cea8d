"""
Train a nanoNorm GPT: one loop for one CPU, one GPU, or many GPUs and nodes.

    python train.py configs/quickstart.py --n_layer=2 --compile=True   # CPU or one GPU
    torchrun --standalone --nproc_per_node=8 train.py configs/geonorm_125m.py
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 \\
        --nproc_per_node=8 train.py configs/geonorm_125m.py     # then node_rank=1 on the other

A config file is Python assignments (`n_layer = 6`); `--key=value` overrides it; `--help` lists every key. Read
as nanoGPT's train.py: the pieces of a step, then `run`: config, data, model and optimizer, and the training loop.
What a run guarantees lives in nanonorm/ behind calls named for it: the same batches and dropout masks whatever
the number of ranks, and bitwise resumes (lm_task.py, resume.py); exit codes, divergence, stop signals and lost
ranks on which all ranks agree (guards.py); checkpoints and logs (run_files.py).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig
from nanonorm import diagnostics, guards, lm_task, resume, train_config
from nanonorm.diagnostics import device_peak_flops
from nanonorm.guards import Dist, StopSignals, report_divergence
from nanonorm.lm_task import Task
from nanonorm.run_files import CHECKPOINT_FORMAT, MetricsLog
from nanonorm.train_config import ConfigError, TrainConfig, accumulation_per_rank, load_config


def build(cfg: TrainConfig, model_args: dict, task: Task, device: str,
          checkpoint: dict | None) -> tuple[GPTConfig, GPT, torch.optim.Optimizer]:
    """The model and its optimizer, from the config or, resumed, from the checkpoint (checked first)."""
    import optim

    gptconf = resume.model_config(cfg, model_args, task, checkpoint)
    torch.manual_seed(cfg.seed)  # the same init on every rank
    with guards.out_of_memory_named(gptconf, device):
        model = GPT(gptconf).to(device)
    if checkpoint is not None:
        resume.load_weights(model, checkpoint, cfg.out_dir)
    try:
        options = {k: getattr(cfg, k) for k in train_config.OPTIMIZER_KEYS}
        optimizer = optim.build_optimizer(model, cfg.optimizer, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                          betas=cfg.betas, device_type=device.split(":")[0], **options)
    except ValueError as e:  # an option the optimizer refuses
        raise ConfigError(f"optimizer {cfg.optimizer}: {e}") from None
    if checkpoint is not None:
        resume.load_optimizer_state(optimizer, checkpoint, cfg)
    return gptconf, model, optimizer


def wrap_model(model: GPT, ddp: Dist, device_type: str, compiled: bool) -> torch.nn.Module:
    """DDP first, then torch.compile: dynamo then splits the graph at DDP's gradient buckets, so each bucket's
    all-reduce overlaps the rest of the backward."""
    if ddp.world_size > 1:  # every buffer is a constant: no sync in a forward (it would hang an uneven evaluation)
        model = DDP(model, device_ids=[ddp.local_rank] if device_type == "cuda" else None, gradient_as_bucket_view=True,
                    **{guards.NO_BUFFER_SYNC: False})
    return torch.compile(model) if compiled else model


def forward_backward(model: torch.nn.Module, task: Task, ddp: Dist, accum: int, it: int, scaler, autocast,
                     seed: int) -> torch.Tensor:
    """Accumulate the gradients of iteration `it` over this rank's micro-batches; returns its mean loss.
    Global micro-batch k sees the data and dropout masks of (seed, it, k), whatever the world size."""
    loss_sum = None
    for micro in range(accum):
        k = ddp.rank * accum + micro
        torch.manual_seed(lm_task.dropout_seed(seed, it, k))
        batch = task.train_batch(it, k)
        sync = micro == accum - 1 or ddp.world_size == 1
        with (contextlib.nullcontext() if sync else model.no_sync()), autocast:
            loss = task.loss(model, batch) / accum
        scaler.scale(loss).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    return loss_sum


@torch.no_grad()
def evaluate(model: torch.nn.Module, raw_model: GPT, task: Task, ddp: Dist, autocast,
             skip_blocks: bool = False) -> dict:
    """Mean loss per split over all ranks' batches, the task's extra metrics and the residual stream's."""
    model.eval()
    out = {f"{split}_loss": split_loss(model, task, split, ddp, autocast) for split in task.eval_splits()}
    out.update(task.extra_metrics(model, autocast, out))  # the LM task's val_bpb, the ICL task's losses by order
    out.update(diagnostics.residual_stream_metrics(raw_model, lm_task.val_inputs(task)))
    if skip_blocks:  # the "curse of depth" measure: the val loss without each block, less the model's
        out["block_skip_loss"] = diagnostics.block_skip_losses(
            raw_model, lambda: split_loss(raw_model, task, "val", ddp, autocast) - out["val_loss"])
    model.train()
    return out


def split_loss(model: torch.nn.Module, task: Task, split: str, ddp: Dist, autocast) -> float:
    total = torch.zeros(2, device=next(model.parameters()).device)
    for batch in task.eval_batches(split, ddp):
        with autocast:
            total += torch.stack([task.loss(model, batch).float(), torch.ones((), device=total.device)])
    guards.all_ranks(total, ddp)
    return (total[0] / total[1]).item()


def evaluates_at(cfg: TrainConfig, iteration: int) -> bool:
    """Whether the loop evaluates at `iteration`: every eval_interval, at the end, and only there to evaluate."""
    return iteration % cfg.eval_interval == 0 or iteration >= cfg.max_iters or cfg.init_from == "eval"


@dataclass
class LoopState:
    """What the training loop works with once a run is set up, and where it stands."""

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
        self.first_bad = torch.full((), guards.NEVER, dtype=torch.int64, device=self.device)  # no sync per step


def run(cfg: TrainConfig, model_args: dict, ddp: Dist, device: str, stop: StopSignals) -> int:
    """Set up the task, model, optimizer and log (a resumed run's checkpoint checked first), then train: 0, or the
    exit code of a divergence or a stop (nanonorm/guards.py)."""
    # ---- config, data, model and optimizer
    accum = accumulation_per_rank(cfg, ddp.world_size)
    checkpoint = resume.starting_point(cfg, device)
    cfg, task_args = resume.resumed_settings(cfg, model_args, checkpoint)
    lm_task.check_batch_fits(cfg, task_args, device)
    task = lm_task.make_task(cfg, task_args, device, ddp.master)
    if checkpoint is not None:
        resume.check_same_data(cfg, checkpoint, task)
    gptconf, model, optimizer = build(cfg, model_args, task, device, checkpoint)
    if guards.stopped_during_setup(stop, ddp, device):
        return guards.EXIT_STOPPED
    dtype = train_config.autocast_dtype(cfg, device)
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    autocast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)
    if device_type == "cuda":  # float32 matmuls on TF32 tensor cores
        torch.set_float32_matmul_precision("high")
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    if checkpoint is not None and checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])
    wrapped = wrap_model(model, ddp, device_type, cfg.compile if cfg.compile is not None else device_type == "cuda")
    iter_num = checkpoint["iter_num"] if checkpoint else 0
    log = resume.open_log(cfg, ddp, device, checkpoint, evaluates_at(cfg, iter_num), asdict(gptconf))
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
            print(resume.resume_summary(cfg, checkpoint, log))
    s = LoopState(cfg, ddp, device, stop, task, model, wrapped, optimizer, scaler, autocast, accum, log,
                  tokens_per_iter, flops_per_iter, peak, iter_num,
                  best_val=checkpoint["best_val_loss"] if checkpoint else float("inf"),
                  skipped=checkpoint.get("skipped_steps", 0) if checkpoint else 0,
                  start_evaluated=checkpoint is None or checkpoint.get("evaluated", True))

    # ---- the training loop
    while True:
        if evaluates_at(cfg, s.iter_num):  # evaluate, log, and save the checkpoint (a divergence ends the run)
            code = evaluate_and_save(s)
            if code is not None:
                return code
        if s.iter_num >= cfg.max_iters or cfg.init_from == "eval":
            break

        mult = train_config.lr_multiplier(cfg, s.iter_num)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * mult
        loss_sum = forward_backward(wrapped, task, ddp, accum, s.iter_num, scaler, autocast, cfg.seed)
        grad_norm = None
        if cfg.grad_clip > 0 or cfg.skip_nonfinite:  # one norm serves the skip check and the clipping
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in wrapped.parameters() if p.grad is not None])
        if cfg.skip_nonfinite and not guards.all_ranks(guards.batch_is_finite(loss_sum, grad_norm, scaler), ddp,
                                                dist.ReduceOp.MIN).item():
            code = skip_batch(s)  # a sync per step
            if code is not None:
                return code
        else:
            s.first_bad = torch.where(loss_sum.isfinite(), s.first_bad, s.first_bad.clamp(max=s.iter_num))
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(wrapped.parameters(), cfg.grad_clip, grad_norm)
            if not guards.optimizer_step(scaler, optimizer):  # a step size float32 cannot hold: an infinite update
                return report_divergence(log, ddp, s.iter_num + 1, "the update overflowed float32", model, optimizer,
                                         lm_task.model_inputs(task.train_batch(s.iter_num, 0)))
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            model.apply_parameter_constraints()  # nGPT's unit norms, the Lipschitz gains, QK-Clip
        s.iter_num += 1
        s.iters_since_log += 1
        if s.iter_num == s.start_iter + 1:  # the first step compiles and warms up: keep it out of ms/iter and MFU
            s.t_last, s.iters_since_log = time.perf_counter(), 0

        log_now = s.iter_num % cfg.log_interval == 0
        # before any log or save; one process also checks for a stop signal after every step (no sync needed),
        # several at these points only, where they sync anyway
        stop_now = False
        if (log_now or s.iter_num % cfg.eval_interval == 0 or s.iter_num >= cfg.max_iters
                or (ddp.world_size == 1 and stop.received)):
            bad_iter, stop_now = guards.check_in(s.first_bad, stop, ddp)  # the same on every rank: all stop together
            if bad_iter is not None:
                return report_divergence(log, ddp, bad_iter + 1, "non-finite training loss", model, optimizer,
                                         lm_task.model_inputs(task.train_batch(bad_iter, 0)))
        if log_now:
            log_progress(s, loss_sum)
        if stop_now:  # after the iteration's train line, so the log has every completed iteration
            return stop_after_iteration(s)

    if ddp.master and cfg.sample_tokens > 0 and cfg.task == "lm":
        lm_task.print_sample(model, task.data.meta, cfg.sample_tokens, device, stop)
    return 0


def evaluate_and_save(s: LoopState) -> int | None:
    """Evaluate at s.iter_num: a non-finite loss or state ends the run as diverged (its exit code returned);
    else rank 0 prints and logs the evaluation, and saves a checkpoint of it first."""
    cfg, at_end = s.cfg, s.iter_num >= s.cfg.max_iters or s.cfg.init_from == "eval"
    metrics = evaluate(s.model, s.raw_model, s.task, s.ddp, s.autocast, cfg.log_diagnostics and at_end)
    # never save a checkpoint from non-finite state; the losses are all-reduced, so all ranks agree
    finite = all(math.isfinite(metrics[f"{split}_loss"]) for split in s.task.eval_splits())
    reason = guards.diverged_at_eval(cfg, finite, at_end, s.iter_num - s.eval_iter, s.skipped - s.eval_skipped,
                                     s.raw_model, s.optimizer, s.ddp, s.device)
    s.eval_iter, s.eval_skipped, s.eval_finite = s.iter_num, s.skipped, finite
    if reason is not None:
        return report_divergence(s.log, s.ddp, s.iter_num, reason, s.raw_model, s.optimizer,
                                 lm_task.val_inputs(s.task))
    if cfg.log_diagnostics:  # per block: first-token attention mass, the stream's peak and kurtosis; GeoNorm's angles
        metrics.update(diagnostics.forward_diagnostics(s.raw_model, lm_task.val_inputs(s.task)))
    if cfg.log_diagnostics:  # the gradients this iteration's step will apply (same batches and masks)
        forward_backward(s.model, s.task, s.ddp, s.accum, s.iter_num, s.scaler, s.autocast, cfg.seed)
        if s.ddp.master:
            metrics.update(diagnostics.gradient_statistics(s.raw_model, s.scaler.get_scale()))
        s.optimizer.zero_grad(set_to_none=True)
    if s.ddp.master:
        print(f"iter {s.iter_num}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
        improved = metrics["val_loss"] < s.best_val
        s.best_val = min(s.best_val, metrics["val_loss"])
        if (s.iter_num > s.start_iter or not s.start_evaluated) and cfg.init_from != "eval" and finite:
            resume.save_evaluated(cfg, s.iter_num, lambda: checkpoint_state(s), improved, s.stop)
        s.log.write(kind="eval", iter=s.iter_num, **metrics)  # after the save: a logged eval has its checkpoint
    s.t_last = time.perf_counter()  # evaluation time is not training time
    return None


def skip_batch(s: LoopState) -> int | None:
    """Drop this batch's update (skip_nonfinite); more than skip_nonfinite skipped ends the run as diverged."""
    s.optimizer.zero_grad(set_to_none=True)
    s.raw_model.forget_step()  # no record of the dropped batch reaches the next step's QK-Clip
    if s.scaler.is_enabled():
        s.scaler.update()  # closes the unscale_ before the check (and lowers the fp16 loss scale)
    s.skipped += 1
    if s.skipped <= s.cfg.skip_nonfinite:
        return None
    reason = f"more than {s.cfg.skip_nonfinite} non-finite losses skipped"
    return report_divergence(s.log, s.ddp, s.iter_num + 1, reason, s.raw_model, s.optimizer,
                             lm_task.model_inputs(s.task.train_batch(s.iter_num, 0)))


def log_progress(s: LoopState, loss_sum: torch.Tensor) -> None:
    """A train line: the global batch's loss, the learning rate, and the speed since the last line."""
    lossf = (guards.all_ranks(loss_sum, s.ddp) / s.ddp.world_size).item()  # the global batch's loss
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
    unsaved = ("its state is not finite" if not s.eval_finite or guards.nonfinite_state(s.raw_model, s.optimizer) else
               "non-finite batches were skipped since the last evaluation" if s.skipped > s.eval_skipped else None)
    state = checkpoint_state(s, evaluated=False) if unsaved is None else None
    return guards.stop_with_checkpoint(s.log, s.ddp, s.stop, s.iter_num, state, s.cfg, unsaved)


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
    train_config.use_deterministic(cfg)  # before CUDA starts
    resume.checkpoint_to_load(cfg)  # before out_dir is claimed: a mistyped out_dir is not created
    guards.reuse_freed_memory()
    ddp, device = guards.setup_distributed(cfg)
    stop = StopSignals()
    with guards.lost_ranks_named(cfg, ddp, stop), guards.claim_out_dir(cfg.out_dir, ddp, device), stop:
        return run(cfg, model_args, ddp, device, stop)


def main() -> None:
    """The command line: train, and exit with the run's exit code (see guards.py)."""
    sys.exit(guards.exit_code(lambda: train(sys.argv[1:])))


if __name__ == "__main__":
    main()

"""
Train a nanoNorm GPT: one loop for one CPU, one GPU, or many GPUs and nodes.

    python train.py configs/quickstart.py                       # CPU or one GPU
    python train.py configs/quickstart.py --n_layer=2 --compile=True
    torchrun --standalone --nproc_per_node=8 train.py configs/geonorm_125m.py
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 \\
        --nproc_per_node=8 train.py configs/geonorm_125m.py     # then node_rank=1 on the other

A config file is Python assignments (`n_layer = 6`); `--key=value` overrides it. Every key is
a field of `train_config.TrainConfig` or of `model.GPTConfig`; anything else stops with a message.

The run's guarantees live beside this file: the same batches, dropout masks and losses whatever the
number of ranks, and bitwise resumes (lm_task.py, resume.py); exit codes, divergence and stop signals on
which all ranks agree (guards.py); diagnostics on request (diagnostics.py).
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from diagnostics import (
    device_peak_flops,
    geonorm_angles,
    gradient_statistics,
    residual_stream_metrics,
)
from guards import (
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    NEVER,
    Dist,
    LostRanks,
    StopSignals,
    agreed,
    all_ranks,
    batch_is_finite,
    check_in,
    claim_out_dir,
    eval_divergence,
    lost_ranks,
    nonfinite_state,
    report_divergence,
    reuse_freed_memory,
    setup_distributed,
    stop_with_checkpoint,
)
from lm_task import DROPOUT_STREAM, check_batch_fits, make_task, model_inputs, print_sample, stream_seed, val_inputs
from model import GPT, GPTConfig
from resume import (
    check_same_data,
    checkpoint_to_load,
    resume_model_args,
    resumed_settings,
    save_evaluated,
    starting_point,
)
from run_files import (
    CHECKPOINT_FORMAT,
    METRICS_NAME,
    MetricsLog,
    foreign_checkpoint,
    remove_previous_run,
)
from train_config import (
    TRAIN_KEYS,
    ConfigError,
    TrainConfig,
    accumulation_per_rank,
    load_config,
)


def autocast_dtype(cfg: TrainConfig, device: str) -> torch.dtype:
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


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

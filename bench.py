"""
Benchmark training steps: tokens/s and MFU per normalization scheme and per optimizer, with
every ratio taken against a baseline measured in the same run. Machines are noisy: the cases are
interleaved round by round (in a shuffled order), each ratio is the median over rounds of case / baseline within a round
(a slow patch hits both alike), and beside it stand the quartiles of those per-round ratios and a
95% confidence interval of their median. More rounds narrow the interval; a difference smaller
than it was not measured.

    python bench.py                                  # CPU bench shape, all schemes and optimizers
    python bench.py --shape 124m --compile           # GPT-2 small on a GPU, bf16
    python bench.py --schemes pre,geonorm --optimizers none
    python bench.py --schemes dyt,derf,rezero --optimizers none   # DyT/Derf: in place of Pre-Norm's norms
    python bench.py --schemes pre,geonorm --optimizers none --rounds 60
    python bench.py --threads 1 --clock cpu          # on a machine shared with other jobs
    python bench.py --nanogpt path/to/nanoGPT/model.py   # side by side with karpathy/nanoGPT
    python bench.py --schemes geonorm,dnt --optimizers none --profile 5   # which ops cost the time
    python gpu_report.py                             # everything a GPU should show, one report (built on this file)

MFU counts model FLOPs (6 N per token plus 12 L d T for attention) against the device's peak:
the datasheet dense bf16 peak on a known GPU; on a CPU, a matmul peak measured by this run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import math
import os
import platform
import random
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator

import torch

import optim
from model import ELEMENTWISE_NORMS, GPT, SCHEMES, GPTConfig
from nanonorm.diagnostics import device_peak_flops
from nanonorm.guards import reuse_freed_memory
from nanonorm.train_config import ConfigError, check_device

SHAPES = {  # n_layer, n_head, n_embd, block_size, batch_size, vocab_size
    "cpu": (4, 4, 256, 256, 8, 96),  # a CPU reference shape: nanoGPT's 4-layer char model, wider (char vocabulary)
    "cpu_wide": (4, 8, 512, 256, 8, 96),  # the same at twice the width: matmuls 4x, elementwise passes 2x
    "small": (4, 4, 128, 128, 16, 80),  # configs/quickstart.py
    "124m": (12, 12, 768, 1024, 16, 50304),  # GPT-2 small; 16 x 1024 tokens a step keep a GPU's matmuls busy
    "tiny": (2, 2, 32, 16, 2, 64),  # a smoke test
}


class BenchError(ValueError):
    """An option bench.py cannot run with (a --nanogpt file that is not nanoGPT's model.py): main prints it and
    exits with code 2."""


SCHEME_CASES = (*SCHEMES, *ELEMENTWISE_NORMS)  # every row of SCHEMES, and DyT and Derf in place of Pre-Norm's norms


def scheme_case(name: str) -> dict:
    """The config keys of a scheme case: a row of SCHEMES, or an elementwise norm type in Pre-Norm."""
    return {"norm": name} if name in ELEMENTWISE_NORMS else {"norm_scheme": name}


def model_config(shape: str, **changes) -> GPTConfig:
    n_layer, n_head, n_embd, block_size, _, vocab = SHAPES[shape]
    return GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=vocab,
                     bias=False, dropout=0.0, **changes)


def make_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, batch, autocast) -> Callable[[], None]:
    """One training step: forward, backward and (if given) the optimizer update."""
    x, y = batch
    constrain = getattr(model, "apply_parameter_constraints", None)  # as train.py does; nanoGPT has none

    def step() -> None:
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            if constrain is not None:
                constrain()
        for p in model.parameters():
            p.grad = None

    return step


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved(names: list[str], rounds: int, seed: int) -> Iterator[str]:
    """The names, round after round, in an order shuffled each round (seeded): a slow patch of a shared
    machine hits every case of a round alike, and no case always follows the same one."""
    order, shuffle = list(names), random.Random(seed).shuffle
    for _ in range(rounds):
        shuffle(order)
        yield from order


def time_interleaved(cases: dict[str, Callable[[], None]], device: str, rounds: int, warmup: int,
                     clock: str = "wall") -> dict[str, list[float]]:
    """Seconds per call of each case in every round (`interleaved`). clock="cpu" counts this process's
    CPU time, which other processes do not inflate."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    now = CLOCKS[clock]
    times: dict[str, list[float]] = {name: [] for name in cases}
    for name in interleaved(list(cases), rounds, seed=0):
        sync(device)
        t0 = now()
        cases[name]()
        sync(device)
        times[name].append(now() - t0)
    return times


def median_rank(n: int, confidence: float = 0.95) -> int:
    """The largest k whose binomial(n, 1/2) tail P(Bin <= k - 1) stays below (1 - confidence) / 2: the k-th
    smallest and k-th largest of n values bound their median at that confidence. 0 when even the whole
    range does not (fewer than 6 values for 95%)."""
    k, tail = 0, 0.0
    while k < n // 2:
        tail += math.comb(n, k) / 2**n  # P(Bin(n, 1/2) <= k)
        if tail > (1 - confidence) / 2:
            break
        k += 1
    return k


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median (see median_rank). With too few values for
    that confidence it is the whole range."""
    xs, n = sorted(values), len(values)
    k = max(median_rank(n, confidence), 1)
    return xs[k - 1], xs[n - k]


def has_median_interval(n: int, confidence: float = 0.95) -> bool:
    """Whether n values bound their median at that confidence."""
    return median_rank(n, confidence) > 0


def ratio_spread(times: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float]]:
    """Per case, from the ratios case / baseline of each round: their median, quartiles and the
    median's 95% confidence interval. Taking the ratio within a round cancels what slowed the
    whole round down."""
    out = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times[baseline], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        lo, hi = median_interval(ratios)
        out[name] = {"ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3, "ratio_lo": lo, "ratio_hi": hi}
    return out


def process_time_peak_flops(dtype: torch.dtype) -> float:
    """The CPU's matmul peak timed like `--clock cpu` steps, in process CPU time (as diagnostics.py's
    device_peak_flops: 2048^2 matmuls, the best of a few; bf16 without native support counts as float32)."""
    if dtype != torch.bfloat16 or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtype = torch.float32
    a = torch.randn(2048, 2048, dtype=dtype)
    a @ a
    best = float("inf")
    for _ in range(4):
        t0 = time.process_time()
        a @ a
        best = min(best, time.process_time() - t0)
    return 2 * 2048**3 / best


def profile_ops(cases: dict[str, Callable[[], None]], device: str, steps: int) -> dict[str, dict[str, float]]:
    """Milliseconds per step of each op, per case: the median over `steps` steps, each under torch.profiler,
    interleaved across the cases as `time_interleaved` does (a slow patch of the machine would otherwise
    land on whichever case was profiled then). An op's time is its self time: an aten op's own kernels
    (on the GPU when there is one). The profiler adds a little time to every op it records, so a case
    made of many small ops looks slower under it than it is: take ratios from the timing table and
    the profile for where the time goes."""
    cuda = device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    field = "self_device_time_total" if cuda else "self_cpu_time_total"
    steps_ms: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for name in interleaved(list(cases), steps, seed=1):
        with torch.profiler.profile(activities=activities) as prof:
            cases[name]()
            sync(device)
        ops = prof.key_averages()
        steps_ms[name].append({e.key: getattr(e, field) / 1000 for e in ops if getattr(e, field) > 0})
    return {name: {op: statistics.median(step.get(op, 0.0) for step in runs) for op in set().union(*runs)}
            for name, runs in steps_ms.items()}


def report_profile(ops: dict[str, dict[str, float]], baseline: str, top: int = 15) -> None:
    """The ops whose time differs most from the baseline's, ms per step and the difference, and the totals."""
    names = [n for n in ops if n != baseline]
    keys = set().union(*ops.values())
    delta = {k: max((abs(ops[n].get(k, 0.0) - ops[baseline].get(k, 0.0)) for n in names), default=0.0) for k in keys}
    rows = sorted(keys, key=lambda k: -(delta[k] if names else ops[baseline].get(k, 0.0)))[:top]
    print(f"\nWhere the time goes (profiler, ms per step, each op's median over steps; in brackets the "
          f"difference from {baseline})\n")
    print(f"| op | {baseline} | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * (len(names) + 1))

    def cells(pick) -> str:
        base = pick(ops[baseline])
        return f"{base:.2f} | " + " | ".join(f"{pick(ops[n]):.2f} ({pick(ops[n]) - base:+.2f})" for n in names)

    for k in rows:
        print(f"| {k} | " + cells(lambda case, k=k: case.get(k, 0.0)) + " |")
    print("| all ops | " + cells(lambda case: sum(case.values())) + " |")


def peak_memory(fn: Callable[[], None], device: str) -> float:
    if not device.startswith("cuda"):
        return float("nan")
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    return torch.cuda.max_memory_allocated(device) / 2**30


def state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if torch.is_tensor(t))


def build_case(config: GPTConfig, opt_name: str | None, device: str, compile_model: bool | str, batch, autocast):
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = None
    if opt_name is not None:
        optimizer = optim.build_optimizer(model, opt_name, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                                          device_type=device.split(":")[0], matrix_lr=1e-3)
    runner = model
    if compile_model == "whole":
        runner = torch.compile(model, dynamic=False)  # static shapes, as every case has
    elif compile_model:  # each block once, and the head (GPT.compile_regions)
        model.compile_regions(dynamic=False)
    return make_step(runner, optimizer, batch, autocast), model, optimizer


@contextlib.contextmanager
def compiling_many(cases: int):
    """Room for one compiled graph of GPT.forward per case: past dynamo's recompile limit (8) the remaining
    cases would run eager under a compiled label. Hitting the limit anyway is an error, not a fallback."""
    config = torch._dynamo.config
    saved = config.recompile_limit, config.fail_on_recompile_limit_hit
    config.recompile_limit, config.fail_on_recompile_limit_hit = max(saved[0], 2 * cases), True
    try:
        yield
    finally:
        config.recompile_limit, config.fail_on_recompile_limit_hit = saved


def how_it_ran(step: Callable[[], None], compiled: bool) -> str:
    """Run one step and say how: eager, or compiled into how many graphs (graph breaks split a model's forward
    into several; 'reused' when an identical model compiled before it in this process)."""
    if not compiled:
        step()
        return "eager"
    counters = torch._dynamo.utils.counters
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    step()
    graphs, breaks = counters["stats"]["unique_graphs"] - graphs, sum(counters["graph_break"].values()) - breaks
    if graphs == 0:
        return "compiled (reused)"
    return f"compiled, {graphs} graph{'s' * (graphs > 1)}" + (f", {breaks} break{'s' * (breaks > 1)}" if breaks else "")


def load_nanogpt(path: str) -> types.ModuleType:
    """karpathy/nanoGPT's model.py as a module; BenchError, saying why, when the file is not one."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", path) if os.path.isfile(path) else None
    if spec is None or spec.loader is None:
        raise BenchError(f"--nanogpt {path} is not a Python file; give the path of nanoGPT's model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # any file can be named here, and it can fail in any way, or exit
        raise BenchError(f"--nanogpt {path} failed to import ({type(e).__name__}: {e}); "
                         "give the path of nanoGPT's model.py") from None
    if not (hasattr(module, "GPT") and hasattr(module, "GPTConfig")):
        raise BenchError(f"--nanogpt {path} defines no GPT and GPTConfig; give the path of nanoGPT's model.py")
    return module


def nanogpt_case(path: str, shape: str, device: str, compile_model: bool, batch, autocast):
    """karpathy/nanoGPT's GPT from its model.py, at the same shape, with torch's AdamW."""
    module = load_nanogpt(path)
    n_layer, n_head, n_embd, block_size, _, vocab = SHAPES[shape]
    torch.manual_seed(0)
    try:
        model = module.GPT(module.GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                                            vocab_size=vocab, bias=False, dropout=0.0))
    except (Exception, SystemExit) as e:  # another model.py: GPTConfig or GPT with other arguments
        raise BenchError(f"--nanogpt {path}: its GPT cannot be built as nanoGPT's is ({type(e).__name__}: {e}); "
                         "give the path of nanoGPT's model.py") from None
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.startswith("cuda"))
    runner = torch.compile(model, dynamic=False) if compile_model else model
    return make_step(runner, optimizer, batch, autocast)


def report(title: str, rows: list[dict], baseline: str, rounds: int) -> None:
    """The table of rows; the median's 95% CI shows "-" when there are too few rounds to give one."""
    interval = has_median_interval(rounds)
    too_few = "" if interval else "; too few rounds for the median's 95% CI: give --rounds 6 or more"
    print(f"\n{title} (ratios against {baseline} in the same round, median over {rounds} rounds{too_few})\n")
    print(f"| case | ms/step | x {baseline} | rounds' IQR | median's 95% CI | tokens/s | MFU | peak GiB "
          "| opt. state MB | ran |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        peak = "-" if math.isnan(r["peak_gib"]) else f"{r['peak_gib']:.2f}"  # not measured on a CPU
        ci = f"{r['ratio_lo']:.3f}–{r['ratio_hi']:.3f}" if interval else "-"
        print(f"| {r['name']} | {1000 * r['seconds']:.1f} | {r['ratio']:.3f} | {r['ratio_q1']:.3f}–{r['ratio_q3']:.3f} "
              f"| {ci} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {peak} "
              f"| {r['state_bytes'] / 2**20:.1f} | {r.get('ran', '')} |")


def resolve_dtype(dtype: str, device: str) -> str:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 matmuls, else float32."""
    if dtype != "auto":
        return dtype
    native_bf16 = device.startswith("cuda") or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "bfloat16" if native_bf16 else "float32"


def run_bench(shape: str = "cpu", schemes: list[str] | None = None, optimizers: list[str] | None = None,
              device: str = "cpu", dtype: str = "auto", compile_model: bool | str = False, rounds: int = 20,
              warmup: int = 3, nanogpt: str | None = None, threads: int | None = None,
              clock: str = "wall", profile: int = 0, default_malloc: bool = False) -> dict[str, list[dict]]:
    """Time training steps; returns {"schemes": rows, "optimizers": rows}, each row a dict with name,
    seconds (median over rounds), ratio (median over rounds of the ratio to "pre" or "adamw" timed in
    the same round), ratio_q1 and ratio_q3 (its quartiles over rounds), ratio_lo and ratio_hi (the
    median's 95% confidence interval), tokens_per_s, mfu, peak_gib and state_bytes. schemes /
    optimizers None means all; [] skips that table. threads sets torch's CPU threads; clock is
    "wall" or "cpu" (process CPU time: exact with one thread, since idle threads spin). profile > 0
    also profiles that many steps of each case and prints the ops where each differs most from the
    baseline; the per-op times are in tables["profile_schemes"] and tables["profile_optimizers"].
    Freed CPU memory is reused as in train.py (`guards.reuse_freed_memory`) unless default_malloc."""
    reused = False if default_malloc else reuse_freed_memory()
    if threads is not None:
        torch.set_num_threads(threads)
    schemes = list(SCHEME_CASES) if schemes is None else schemes
    optimizers = list(optim.OPTIMIZERS) if optimizers is None else optimizers
    dtype = resolve_dtype(dtype, device)
    torch_dtype = getattr(torch, dtype)
    device_type = device.split(":")[0]
    autocast = torch.autocast(device_type, dtype=torch_dtype) if dtype != "float32" else contextlib.nullcontext()
    n_layer, n_head, n_embd, block_size, batch_size, vocab = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, vocab, (batch_size, block_size), generator=g).to(device) for _ in range(2))
    tokens = batch_size * block_size
    peak = process_time_peak_flops(torch_dtype) if clock == "cpu" else device_peak_flops(device, torch_dtype)
    name = torch.cuda.get_device_name(device) if device_type == "cuda" else platform.processor() or platform.machine()
    print(f"nanoNorm bench, {datetime.date.today()}: {name}, torch {torch.__version__}, {dtype}, "
          f"compile={compile_model}, {rounds} rounds, {torch.get_num_threads()} threads, {clock} clock, "
          f"malloc {'reusing freed memory' if reused else 'as the process found it'}, "
          f"shape {shape} (L{n_layer} d{n_embd} T{block_size} B{batch_size}), peak {peak / 1e12:.3g} TFLOP/s",
          flush=True)

    ran: dict[str, str] = {}

    def measure(cases: dict, flops: dict, states: dict, baseline: str) -> list[dict]:
        times = time_interleaved(cases, device, rounds, warmup, clock)
        spread = ratio_spread(times, baseline)
        rows = []
        for k, ts in times.items():
            s = statistics.median(ts)
            rows.append({"name": k, "seconds": s, **spread[k], "tokens_per_s": tokens / s,
                         "mfu": flops[k] * tokens / s / peak, "peak_gib": peak_memory(cases[k], device),
                         "state_bytes": states.get(k, 0), "ran": ran[k]})
        return rows

    def build_all(variants: dict[str, tuple[GPTConfig, str]]) -> tuple[dict, dict, dict]:
        cases, flops, states = {}, {}, {}
        with compiling_many(len(variants) + 1):
            for label, (config, opt_name) in variants.items():
                step, model, opt = build_case(config, opt_name, device, compile_model, batch, autocast)
                ran[label] = how_it_ran(step, compile_model)  # the first step compiles and creates optimizer state
                cases[label], flops[label], states[label] = step, model.flops_per_token(block_size), state_bytes(opt)
        return cases, flops, states

    tables: dict[str, list[dict]] = {}
    if schemes or nanogpt:
        variants = {s: (model_config(shape, **scheme_case(s)), "adamw") for s in dict.fromkeys(["pre", *schemes])}
        nanogpt_step = nanogpt_case(nanogpt, shape, device, compile_model, batch, autocast) if nanogpt else None
        cases, flops, states = build_all(variants)
        if nanogpt_step:
            cases["nanoGPT (pre)"] = nanogpt_step
            ran["nanoGPT (pre)"] = how_it_ran(nanogpt_step, compile_model)
            flops["nanoGPT (pre)"], states["nanoGPT (pre)"] = flops["pre"], states["pre"]
        tables["schemes"] = measure(cases, flops, states, "pre")
        report("Schemes, AdamW step", tables["schemes"], "pre", rounds)
        if profile:
            tables["profile_schemes"] = profile_ops(cases, device, profile)
            report_profile(tables["profile_schemes"], "pre")
    if optimizers:
        variants = {name: (model_config(shape), name) for name in dict.fromkeys(["adamw", *optimizers])}
        cases, flops, states = build_all(variants)
        tables["optimizers"] = measure(cases, flops, states, "adamw")
        report("Optimizers, Pre-Norm step", tables["optimizers"], "adamw", rounds)
        if profile:
            tables["profile_optimizers"] = profile_ops(cases, device, profile)
            report_profile(tables["profile_optimizers"], "adamw")
    return tables


def name_list(text: str) -> list[str] | None:
    """'all' -> None (every one), 'none' -> [], else the comma-separated names."""
    return None if text == "all" else [] if text == "none" else text.split(",")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every bad option ends here with exit code 2 and one line saying what to give instead."""
    for option, value, least in (("--rounds", args.rounds, 1), ("--warmup", args.warmup, 0),
                                 ("--threads", args.threads, 1), ("--profile", args.profile, 0)):
        if value is not None and value < least:
            p.error(f"{option} {value} must be at least {least}")
    unknown = [name for name in name_list(args.schemes) or [] if name not in SCHEME_CASES]
    if unknown:
        p.error(f"unknown scheme(s) {', '.join(unknown)}; choose from: {', '.join(SCHEME_CASES)}")
    if error := optim.optimizer_names_error(name_list(args.optimizers) or []) or optim.timing_device_error(args.device):
        p.error(error)
    try:  # and what train.py refuses (cpu:1, a cuda index this machine lacks); the fix is bench's own
        check_device(args.device)
    except ConfigError as e:
        p.error(f"--{str(e).split(';')[0]}; give cpu, cuda or cuda:N")
    if args.clock == "cpu" and not args.device.startswith("cpu"):
        p.error(f"--clock cpu times work on the CPU; on {args.device} use --clock wall")
    if args.nanogpt is not None:
        try:
            load_nanogpt(args.nanogpt)
        except BenchError as e:
            p.error(str(e))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="cpu")
    p.add_argument("--schemes", default="all",
                   help="comma-separated norm_scheme names or dyt/derf (in Pre-Norm), 'all' or 'none'")
    p.add_argument("--optimizers", default="all", help="comma-separated optimizer names, 'all' or 'none'")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="autocast dtype; auto = bfloat16 on CUDA and on CPUs with native bf16, else float32")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block and the head (GPT.compile_regions: one compile per block structure)")
    p.add_argument("--compile_whole", action="store_true",
                   help="torch.compile the whole model into one graph, as train.py does (longer to compile)")
    p.add_argument("--rounds", type=int, default=20,
                   help="timed steps per case; more rounds narrow the median's confidence interval")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nanogpt", help="path to karpathy/nanoGPT's model.py, timed beside Pre-Norm")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: one per core)")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="wall time, or this process's CPU time (other processes on a shared machine do not "
                        "inflate it; use with --threads 1, since idle threads spin)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS steps of each case (torch.profiler, interleaved like the timed "
                        "rounds) and print the ops where each case spends more or less time than the baseline")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc settings as they are instead of reusing freed memory as train.py "
                        "does (to measure what that saves: compare two runs)")
    args = p.parse_args()
    check_args(p, args)
    try:
        run_bench(args.shape, name_list(args.schemes), name_list(args.optimizers), args.device, args.dtype,
                  "whole" if args.compile_whole else args.compile, args.rounds, args.warmup, args.nanogpt,
                  args.threads, args.clock, args.profile, args.default_malloc)
    except BenchError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()

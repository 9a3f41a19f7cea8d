"""
One command that checks a GPU and writes what it measured as one Markdown report:

    python gpu_report.py --budget 540     # every part within 540 s on one H100/H200
    python gpu_report.py --dry_run        # its plan part by part: estimated seconds and each part's limit

It runs, in order:
  1. the CUDA-marked tests (pytest -m cuda);
  2. GPT-2 small (124M) under torch.compile, bf16: every scheme with AdamW and every optimizer with
     Pre-Norm (bench.py), timed one process, after every case was compiled once in parallel worker
     processes (torch.compile's on-disk caches then serve the timed process in seconds a case). Each case
     compiles regionally (GPT.compile_regions: each block structure once, and the head), not the whole model;
  3. `torchrun --nproc_per_node=1 train.py configs/geonorm_125m.py --deterministic=True --compile=False` on the
     embedded Shakespeare corpus (GPT-2 BPE, offline) for 200 iterations, stopped by SIGTERM after iteration 100
     and resumed, against an uninterrupted run: every logged loss and the final weights and optimizer state must
     agree bitwise (deterministic kernels make two runs of one command agree; eager, so that no compile shares
     the budget). It runs while the workers compile (it is not timed).
Every part has a time limit, and the limits add up to at most --budget (part_limits); one that fails or runs
out is reported as such and the rest still run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.abspath(__file__))
WORKER_GIB = 16  # GPU memory of one compile worker (124M, AdamW, 16 x 1024 tokens), with room to spare


@dataclass(frozen=True)
class Plan:
    """What the report runs: the real one on a GPU, or `--smoke`, the same parts at a tiny size on the CPU
    (it checks the report's own plumbing and measures nothing)."""
    shape: str = "124m"
    device: str = "cuda"
    compile: bool = True
    iters: int = 200  # the resume check's run length; SIGTERM after half of it
    train_args: tuple[str, ...] = ()
    cases: int | None = None  # the first this many cases (None: all)

    @property
    def bench_args(self) -> list[str]:
        return ["--shape", self.shape, "--device", self.device, *(["--compile"] * self.compile),
                "--dtype", "bfloat16" if self.device == "cuda" else "float32", "--rounds", "20", "--warmup", "3"]

    @property
    def profile_args(self) -> list[str]:
        return [*self.bench_args[:-4], "--rounds", "1", "--warmup", "1", "--schemes", "geonorm,ngpt",
                "--optimizers", "muon,manifold_muon", "--profile", "2"]

    @property
    def resume_args(self) -> list[str]:
        return ["configs/geonorm_125m.py", "--dataset=shakespeare", f"--max_iters={self.iters}",
                f"--lr_decay_iters={self.iters}", f"--warmup_iters={self.iters // 10}",
                f"--eval_interval={self.iters // 2}", "--eval_iters=10", "--log_interval=1", "--sample_tokens=0",
                "--always_save_checkpoint=True", "--deterministic=True", "--compile=False", *self.train_args]


SMOKE = Plan(shape="tiny", device="cpu", compile=False, iters=20, cases=3, train_args=(
    "--dataset=shakespeare_char", "--device=cpu", "--n_layer=2", "--n_head=2", "--n_embd=32",
    "--block_size=32", "--batch_size=2", "--gradient_accumulation_steps=2", "--eval_iters=2"))
# (part, estimated seconds on one H100/H200 with 16 host cores). The first three run side by side (phase 1), then
# the bench (2) and the profile (3) alone on the GPU. Estimated, not yet measured with this code: the 2026-11-27
# H200 run (tests 80 s; 22 cases compiled whole, 330 s in 6 workers; bench 240 s, mostly rebuilding the compiled
# cases; profile 60 s) scaled by the CPU compile time of regional against whole-model compilation (docs/speed.md)
# and to 27 cases; the resume check runs eager now (about 200 steps of 124M and three process starts).
PARTS = (("CUDA-marked tests", 1, 80), ("compile every case in parallel workers", 1, 200),
         ("torchrun geonorm_125m, SIGTERM half way and resume, against a straight run", 1, 90),
         ("bench: schemes and optimizers, 124M, compiled, bf16", 2, 110),
         ("profile: where the time goes in GeoNorm's and nGPT's steps, and in Muon's and Manifold Muon's", 3, 40))
STARTUP_S = 15  # the report's own start, the environment lines and the report's writing


def part_limits(budget: float) -> dict[str, float]:
    """Each part's time limit: the budget less STARTUP_S, shared among the three phases in proportion to their
    estimated seconds (a phase's estimate: its longest part's), every part of a phase at the phase's share. The
    phases run one after another, so the limits of phase 1 (any of its parts), 2 and 3 add up to the budget at
    most, and a part that runs out is cut off and reported, never the report."""
    phases = phase_estimates()
    scale = max(budget - STARTUP_S, 0.0) / sum(phases.values())
    return {part: phases[phase] * scale for part, phase, _ in PARTS}


def phase_estimates() -> dict[int, int]:
    """Each phase's estimated seconds: its longest part's (the parts of a phase run side by side)."""
    return {phase: max(est for _, p, est in PARTS if p == phase) for _, phase, _ in PARTS}


def cases(plan: Plan) -> list[tuple[str, str]]:
    """(scheme case, optimizer) of every step bench.py times: each scheme with AdamW, Pre-Norm with each optimizer."""
    import optim
    from bench import SCHEME_CASES

    every = [(s, "adamw") for s in SCHEME_CASES] + [("pre", o) for o in optim.OPTIMIZERS if o != "adamw"]
    return every[:plan.cases]


def warm(plan: Plan, case: str, optimizer: str) -> None:
    """Compile and run one step of one case exactly as bench.py builds it, filling torch.compile's caches."""
    import contextlib

    import torch

    import bench

    *_, block_size, batch_size, vocab = bench.SHAPES[plan.shape]
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, vocab, (batch_size, block_size), generator=g).to(plan.device) for _ in range(2))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if plan.device == "cuda" else contextlib.nullcontext()
    config = bench.model_config(plan.shape, **bench.scheme_case(case))
    with bench.compiling_many(2):
        step, *_ = bench.build_case(config, optimizer, plan.device, plan.compile, batch, autocast)
        step()


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants: torchrun starts its workers in sessions of their own, which
    outlive a kill of the launcher's process group and would keep the GPU busy while the bench is timed."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    todo, found = [pid], []
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    for p in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run(cmd: list[str], limit: float, log: str, env: dict | None = None) -> tuple[int | None, str]:
    """Run a command with a time limit (it and every process it started are killed past it); (exit code or None,
    output)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            code = None
    with open(log) as f:
        return code, f.read()


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def records(out_dir: str) -> list[dict]:
    return [json.loads(line) for line in read(os.path.join(out_dir, "metrics.jsonl")).splitlines()]


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def warm_all(plan: Plan, limit: float, workers: int, logs: str) -> str:
    """Compile every case in `workers` processes at once (the compile is CPU work; each has a few threads)."""
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 2) // workers))}
    deadline, failed = time.monotonic() + limit, []

    def one(case: tuple[str, str]) -> None:
        name = "-".join(case)
        smoke = ["--smoke"] * (plan == SMOKE)
        code, out = run([sys.executable, __file__, *smoke, "--warm", *case], max(1.0, deadline - time.monotonic()),
                        os.path.join(logs, f"warm-{name}.log"), env)
        if code != 0:
            failed.append(f"{name} ({'time limit' if code is None else f'exit {code}'}): {tail(out, 3)}")

    models = [(case, "adamw") for case in dict.fromkeys(case for case, _ in cases(plan))]  # an optimizer's case
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # compiles Pre-Norm's model: compiled once here
        list(pool.map(one, models))
    return "every case compiled" if not failed else "failed: " + "; ".join(failed)


def resume_check(plan: Plan, limit: float, logs: str) -> str:
    """SIGTERM a geonorm_125m run after half its iterations, resume it, and compare it with an uninterrupted run:
    logged losses and final state, bitwise."""
    import torch

    deadline = time.monotonic() + limit
    work = tempfile.mkdtemp(prefix="gpu_report_")
    stopped, straight = os.path.join(work, "stopped"), os.path.join(work, "straight")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"]
    common = [*plan.resume_args, f"--data_dir={os.path.join(work, 'data')}"]
    stop_after = plan.iters // 2
    log_a = os.path.join(logs, "torchrun-stopped.log")
    with open(log_a, "w") as f:
        proc = subprocess.Popen([*torchrun, *common, f"--out_dir={stopped}"], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    metrics = os.path.join(stopped, "metrics.jsonl")
    while proc.poll() is None and time.monotonic() < deadline:
        if os.path.exists(metrics) and f'"kind": "train", "iter": {stop_after},' in read(metrics):
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    try:
        code = proc.wait(timeout=max(1.0, min(120.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        return f"the first run did not stop in time: {tail(read(log_a), 5)}"
    stop_line = next((r for r in records(stopped) if r.get("status") == "stopped"), None) if os.path.exists(metrics) \
        else None
    if stop_line is None:
        return f"the first run ended (exit {code}) without a stop checkpoint: {tail(read(log_a), 8)}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the resumed run and the straight one, side by side
        resumed = pool.submit(run, [*torchrun, *common, f"--out_dir={stopped}", "--init_from=resume"],
                              max(1.0, deadline - time.monotonic()), os.path.join(logs, "torchrun-resumed.log"))
        whole = pool.submit(run, [*torchrun, *common, f"--out_dir={straight}"],
                            max(1.0, deadline - time.monotonic()), os.path.join(logs, "torchrun-straight.log"))
        (code_r, out_r), (code_s, out_s) = resumed.result(), whole.result()
    if code_r != 0 or code_s != 0:
        return (f"resumed run exit {code_r}, straight run exit {code_s}: {tail(out_r, 5)} / {tail(out_s, 5)}")

    def losses(out_dir: str) -> dict:
        return {(r["kind"], r["iter"]): r.get("loss", r.get("val_loss")) for r in records(out_dir)
                if r["kind"] in ("train", "eval")}

    a, b = (torch.load(os.path.join(d, "ckpt.pt"), map_location="cpu", weights_only=True) for d in (stopped, straight))
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    worst = max((float((a["model"][k].float() - b["model"][k].float()).abs().max()) for k in differ), default=0.0)
    same_losses = losses(stopped) == losses(straight)
    ms = [r["ms_per_iter"] for r in records(straight) if r["kind"] == "train" and "ms_per_iter" in r]
    speed = (f"; the straight run's median {sorted(ms)[len(ms) // 2]:.1f} ms/iter (not a timing: other work "
             "shared the GPU)") if ms else ""
    shutil.rmtree(work, ignore_errors=True)
    verdict = ("bitwise: every logged loss and every weight equal" if same_losses and not differ else
               f"not bitwise: losses {'equal' if same_losses else 'differ'}, {len(differ)} of {len(a['model'])} "
               f"weight tensors differ (largest difference {worst:.3g})")
    return f"stopped by SIGTERM after iter {stop_line['iter']}, resumed to {plan.iters}: {verdict}{speed}"


def environment(plan: Plan) -> list[str]:
    import torch

    smi = shutil.which("nvidia-smi")
    driver = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                            text=True).stdout.strip() if smi else "?"
    cuda = plan.device == "cuda"
    device = f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)" if cuda else "CPU"
    return [f"- device: {device}, driver {driver}",
            f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {sys.version.split()[0]}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- command: python gpu_report.py (bench: python bench.py {' '.join(plan.bench_args)}; resume "
            f"check: torchrun --nproc_per_node=1 train.py {' '.join(plan.resume_args)})"]


def dry_run(plan: Plan, budget: float) -> None:
    limits = part_limits(budget)
    print(f"python gpu_report.py --budget {budget:g} would run, on one CUDA GPU (estimated seconds on one "
          "H100/H200; each part's time limit under the budget):")
    for part, phase, estimate in PARTS:
        alongside = " (side by side with the other phase-1 parts)" if phase == 1 else ""
        print(f"{phase}. {part}{alongside}: ~{estimate} s, limit {limits[part]:.0f} s")
    total = sum(phase_estimates().values()) + STARTUP_S
    limit = sum(max(limits[part] for part, p, _ in PARTS if p == phase) for phase in phase_estimates()) + STARTUP_S
    fits = "within the budget" if total <= budget else "OVER the budget: parts will be cut off at their limits"
    print(f"estimated ~{total:.0f} s in all, {fits}; the phases' limits and the start add up to {limit:.0f} s "
          f"of {budget:g}")
    models = list(dict.fromkeys(case for case, _ in cases(plan)))
    print(f"  compile workers: the {len(models)} models of the {len(cases(plan))} cases ({', '.join(models)}; the "
          "optimizers' cases train Pre-Norm's)")
    print(f"  bench: python bench.py {' '.join(plan.bench_args)}")
    print(f"  profile: python bench.py {' '.join(plan.profile_args)}")
    print(f"  resume: torchrun --standalone --nproc_per_node=1 train.py {' '.join(plan.resume_args)}")


def gpu_report(plan: Plan, report_path: str, workers: int | None, budget: float) -> int:
    import torch

    if plan.device == "cuda" and not torch.cuda.is_available():
        print("gpu_report.py needs a CUDA GPU and this machine has none (torch.cuda.is_available() is "
              "False); see what it would run with --dry_run", file=sys.stderr)
        return 2
    if workers is None:  # a compiling worker holds a 124M model, its AdamW state and one step's activations
        free = torch.cuda.mem_get_info()[0] / 2**30 if plan.device == "cuda" else 12 + WORKER_GIB
        workers = int(max(1, min(6, (os.cpu_count() or 2) // 3, (free - 12) // WORKER_GIB)))  # cores for the rest
    logs = os.path.splitext(report_path)[0] + "_logs"
    os.makedirs(logs)
    lines = ["# nanoNorm GPU report" + " (smoke run: plumbing only, no measurement)" * (plan == SMOKE), "",
             *environment(plan), ""]
    t0 = time.monotonic()

    def timed(part: str, what: str) -> None:
        lines.extend([f"## {part}", "", f"{what} ({time.monotonic() - t0:.0f} s since the start)", ""])
        print(f"[{time.monotonic() - t0:5.0f} s] {part}: {what}", flush=True)

    tests, compiles, resume, bench, profile = (part for part, _, _ in PARTS)
    limits = part_limits(budget)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # none of these three is timed
        ran_tests = pool.submit(run, [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                                 "--continue-on-collection-errors"],
                                limits[tests], os.path.join(logs, "tests.log"))
        resumed = pool.submit(resume_check, plan, limits[resume], logs)
        timed(compiles, warm_all(plan, limits[compiles], workers, logs))
        code, out = ran_tests.result()
        timed(tests, f"exit {code}: {tail(out, 1)}" if code is not None else "ran out of time")
        try:
            timed(resume, resumed.result())
        except Exception as e:  # reported, not raised: the report is written whatever failed
            timed(resume, f"failed: {type(e).__name__}: {e}")
    for part, args in ((bench, plan.bench_args), (profile, plan.profile_args)):
        log, left = os.path.join(logs, f"{part.split(':')[0]}.log"), t0 + budget - time.monotonic()
        code, out = run([sys.executable, "bench.py", *args], max(1.0, min(limits[part], left)), log)
        timed(part, f"python bench.py {' '.join(args)}: " + (f"exit {code}" if code is not None else "ran out of time"))
        lines.extend(line for line in out.splitlines()
                     if line.startswith(("|", "nanoNorm bench", "Schemes", "Optimizers", "Where the time goes")))
        lines.append("")
    with open(report_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {report_path}; logs in {logs}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry_run", action="store_true", help="print what would run and how long each part should take")
    p.add_argument("--report", help="the Markdown report to write, a new file (its logs go in a folder beside it); "
                                    "default out/gpu_report/<UTC date and time>.md")
    p.add_argument("--workers", type=int, help="parallel compile workers (default: by cores and GPU memory, at most 6)")
    p.add_argument("--budget", type=float, default=540,
                   help="seconds for everything (default 540): each part's limit is its share (part_limits), and the "
                        "bench and the profile also stop where the budget ends")
    p.add_argument("--smoke", action="store_true",
                   help="the same parts on the CPU at a tiny size, uncompiled: checks the plumbing, measures nothing")
    p.add_argument("--warm", nargs=2, metavar=("CASE", "OPTIMIZER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    plan = SMOKE if args.smoke else Plan()
    if args.warm:
        warm(plan, *args.warm)
        return 0
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers {args.workers} must be at least 1")
    if not args.budget > 0:
        p.error(f"--budget {args.budget} must be a positive number of seconds")
    now = datetime.datetime.now(datetime.timezone.utc)
    args.report = args.report or os.path.join("out", "gpu_report", f"{now:%Y%m%d-%H%M%S}.md")
    logs = os.path.splitext(args.report)[0] + "_logs"
    for path in (args.report, logs):  # never over an earlier report, its logs, or a file of the user's
        if os.path.lexists(path):
            p.error(f"{path} exists; give another --report (a new file name such as gpu_report.md)")
    if args.dry_run:
        dry_run(plan, args.budget)
        return 0
    return gpu_report(plan, args.report, args.workers, args.budget)


if __name__ == "__main__":
    sys.exit(main())

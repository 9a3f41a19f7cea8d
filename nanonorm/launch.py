"""
Where a sweep's runs train: the devices of this node each run gets, the command that starts it, and the executors
that run it (sweep.py plans the runs; this module places them).

Devices. `--gpus 0,1,2,3` (or `all`: every visible CUDA device) splits the GPUs into groups of `--gpus_per_run`;
each group takes `--runs_per_gpu` runs at once (its slots). A run starts on the group with the fewest runs on
it (the first such group on a tie), gets it through CUDA_VISIBLE_DEVICES, and frees its slot when it ends: runs
never exceed the slots. A run on several GPUs is launched by `torchrun --standalone --nproc_per_node=N`.

Executors. "process" runs each train.py as a child of the sweep (the default). "local" and "slurm" go through
submitit: each run is one submitit job (`TrainJob`) that starts the same command, writes its train.log and
run.json, and on SLURM is an sbatch job of its own. A job that ends before its run has (preempted, out of time,
stopped) is submitted again to resume from its checkpoint (--init_from=resume); the job ids are kept in each run's
job.json, so that the same sweep command, run again, waits for the jobs still queued or running instead of
submitting them twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

EXECUTORS = ("process", "local", "slurm")
JOB_FILE = "job.json"  # in a run's folder: the submitit job that runs it (executor, id, folder)
LIVE_SLURM_STATES = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED",
                     "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT")  # a job that still holds its run
POLL_S = {"local": 1.0, "slurm": 30.0}  # seconds between looks at the running jobs (sacct is rate-limited)
MAX_RESUBMITS = 20  # submissions of one run past its first in one sweep command, when each ends unfinished
STOP_WAIT_S = 120  # seconds a job waits for its train.py to save and stop after a stop signal (then SIGKILL)


class LaunchError(ValueError):
    """A device or executor setting the user has to fix; sweep.py exits with code 2."""


# ----------------------------------------------------------------------------- devices


def parse_gpus(text: str, visible: int) -> list[int]:
    """--gpus: comma-separated device ids (as CUDA numbers them, each once), or "all": range(visible)."""
    if text == "all":
        if visible == 0:
            raise LaunchError("--gpus all: this machine has no visible CUDA device (torch.cuda.device_count() is "
                              "0); give the ids of the node's GPUs, e.g. --gpus 0,1, or leave --gpus out to run on "
                              "the CPU")
        return list(range(visible))
    parts = text.split(",")
    if not all(p.isdigit() for p in parts) or len(set(map(int, parts))) != len(parts):
        raise LaunchError(f"--gpus {text!r}: give distinct device ids separated by commas, e.g. 0,1,2,3, or all")
    return [int(p) for p in parts]


def gpu_groups(gpus: list[int], gpus_per_run: int) -> list[tuple[int, ...]]:
    """The GPUs in groups of gpus_per_run, in the order given: each group trains one run at a time per slot."""
    if gpus_per_run < 1 or len(gpus) % gpus_per_run:
        raise LaunchError(f"--gpus_per_run {gpus_per_run}: give a number that divides the {len(gpus)} GPU(s) of "
                          f"--gpus {','.join(map(str, gpus))}")
    return [tuple(gpus[i:i + gpus_per_run]) for i in range(0, len(gpus), gpus_per_run)]


def least_loaded(load: list[int], capacity: int) -> int | None:
    """The group a new run starts on: the fewest runs on it, the first such on a tie; None when all are full."""
    free = [i for i, n in enumerate(load) if n < capacity]
    return min(free, key=lambda i: load[i]) if free else None


def planned_devices(runs: int, groups: list[tuple[int, ...]], capacity: int) -> list[tuple[int, ...]]:
    """The group each of `runs` runs gets if they all take equally long: they start in order, and when every slot
    is taken the earliest started run is the first to end. (Runs of unequal length take the first free slot;
    run.json records the one each ran on.)"""
    load, running, out = [0] * len(groups), [], []
    for _ in range(runs):
        if least_loaded(load, capacity) is None:
            load[running.pop(0)] -= 1
        group = least_loaded(load, capacity)
        load[group] += 1
        running.append(group)
        out.append(groups[group])
    return out


class DevicePool:
    """The slots of the groups, handed out by `slot()`: a run waits for a free one and frees it when it ends."""

    def __init__(self, groups: list[tuple[int, ...]], capacity: int):
        self.groups, self.capacity = groups, capacity
        self.load = [0] * len(groups)
        self._free = threading.Condition()

    @contextlib.contextmanager
    def slot(self) -> Iterator[tuple[int, ...]]:
        with self._free:
            while (group := least_loaded(self.load, self.capacity)) is None:
                self._free.wait()
            self.load[group] += 1
        try:
            yield self.groups[group]
        finally:
            with self._free:
                self.load[group] -= 1
                self._free.notify()


def device_env(gpus: tuple[int, ...] | None, visible: str | None = None) -> dict[str, str]:
    """The environment that gives a run its GPUs (none: nothing is set, the run sees what the sweep sees). The ids
    are the sweep's device numbers: under a CUDA_VISIBLE_DEVICES of the sweep's own (`visible`, default the
    environment's), id i is its i-th entry."""
    if not gpus:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    names = visible.split(",") if visible else None
    return {"CUDA_VISIBLE_DEVICES": ",".join(names[g] if names and g < len(names) else str(g) for g in gpus)}


def device_text(gpus: tuple[int, ...] | None) -> str:
    return f"GPU{'s' * (len(gpus) > 1)} {','.join(map(str, gpus))}" if gpus else "the CPU"


# ----------------------------------------------------------------------------- how the sweep launches


@dataclass
class Launcher:
    """How a sweep runs its train.py runs: `workers` at a time with OMP_NUM_THREADS=`threads`, on `groups` of GPUs
    (`capacity` runs each; none: on the CPU), each on `gpus_per_run` GPUs, through `executor` (EXECUTORS) with
    `slurm` options (submitit SlurmExecutor parameters)."""

    workers: int
    threads: int
    groups: list[tuple[int, ...]] = field(default_factory=list)
    capacity: int = 1
    gpus_per_run: int = 1
    executor: str = "process"
    slurm: dict = field(default_factory=dict)

    def pool(self) -> DevicePool | None:
        return DevicePool(self.groups, self.capacity) if self.groups else None

    def prefix(self, train_py: str) -> list[str]:
        """What starts train.py: python, or torchrun over the run's GPUs when it has several."""
        if self.gpus_per_run > 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={self.gpus_per_run}", train_py]
        return [sys.executable, train_py]

    def command(self, train_py: str, argv: list[str]) -> list[str]:
        return [*self.prefix(train_py), *argv]

    def launcher_text(self) -> str:
        """The launcher as a person types it (what run.json records)."""
        return (f"torchrun --standalone --nproc_per_node={self.gpus_per_run}" if self.gpus_per_run > 1
                else "python") + " train.py"

    def describe(self) -> str:
        """One line: where the runs go."""
        groups = ", ".join(map(device_text, self.groups))
        where = (f" on {len(self.groups)} group(s) of {self.gpus_per_run} GPU(s) ({groups}), {self.capacity} run(s) "
                 "per group at a time" if self.groups else "")
        if self.executor == "slurm":
            threads = f"OMP_NUM_THREADS={self.threads}" if self.threads else "the threads its node gives"
            return f"each a SLURM job (submitit: sbatch {' '.join(sbatch_flags(self.slurm))}), {threads}"
        through = ", through submitit's local executor" if self.executor == "local" else ""
        return f"{self.workers} at a time with OMP_NUM_THREADS={self.threads}{where}{through}"

    def dry_run_lines(self, train_py: str, argvs: list[list[str]]) -> list[str]:
        """One line per run: its devices, then its command (as planned_devices places them)."""
        if self.executor == "slurm":
            gpus = self.slurm.get("gpus_per_node")
            where = [f"# a SLURM job{f' with {gpus} GPU(s)' if gpus else ''}\n"] * len(argvs)
        elif self.groups:
            where = [f"# {device_text(g)}: " + " ".join(f"{k}={v}" for k, v in device_env(g).items()) + "\n"
                     for g in planned_devices(len(argvs), self.groups, self.capacity)]
        else:  # on the CPU: the commands alone
            where = [""] * len(argvs)
        return [f"{w}{shlex.join(self.command(train_py, argv)).replace(sys.executable, 'python', 1)}"
                for w, argv in zip(where, argvs, strict=True)]


def sbatch_flags(slurm: dict) -> list[str]:
    """The sbatch options of the SLURM parameters, as a person reads them."""
    names = {"partition": "partition", "time": "time", "gpus_per_node": "gpus-per-node",
             "cpus_per_task": "cpus-per-task"}
    flags = [f"--{names[k]}={v}" for k, v in slurm.items() if k in names and v is not None]
    return flags + [f"--{k}={v}" for k, v in slurm.get("additional_parameters", {}).items()]


def slurm_parameters(partition: str | None, minutes: int, gpus: int, cpus: int | None, extra: list[str]) -> dict:
    """submitit SlurmExecutor parameters: one task on one node per job; --slurm_extra KEY=VALUE options go to
    sbatch as they are (e.g. account=proj, qos=high, constraint=h100)."""
    additional = {}
    for item in extra:
        key, eq, value = item.partition("=")
        if not key or not eq or key.startswith("-"):
            raise LaunchError(f"--slurm_extra {item!r}: give sbatch options as KEY=VALUE without dashes, e.g. "
                              "account=myproject qos=high")
        additional[key] = value
    if minutes < 1:
        raise LaunchError(f"--slurm_time {minutes}: give the minutes a job may run, at least 1")
    return {"partition": partition, "time": minutes, "gpus_per_node": gpus or None, "cpus_per_task": cpus,
            "nodes": 1, "ntasks_per_node": 1, "additional_parameters": additional}


# ----------------------------------------------------------------------------- a run as a submitit job


def resume_argv(argv: list[str]) -> list[str]:
    """A run's command made to go on from its checkpoint: --init_from=resume in place of a fresh start's flags."""
    return [a for a in argv if not a.startswith(("--init_from=", "--overwrite="))] + ["--init_from=resume"]


def has_checkpoint(out_dir: str) -> bool:
    return any(os.path.exists(os.path.join(out_dir, n)) for n in ("ckpt.pt", "ckpt_last.pt"))


@dataclass
class TrainJob:
    """One run as a submitit job: train.py (or torchrun) on the job's node, its output to out_dir/train.log, its
    exit code and wall time, with `record` (the run's point, settings, commit, devices), to out_dir/run.json;
    returns that record. A stop signal to the job (SIGTERM: SLURM's preemption or time limit, the local executor's
    cancel; SIGUSR2: submitit's warning before the time limit) reaches train.py as SIGTERM, on which it saves its
    last iteration and stops. A job SLURM requeued after a preemption resumes from the run's checkpoint."""

    prefix: list[str]
    argv: list[str]
    out_dir: str
    env: dict
    record: dict

    def __call__(self) -> dict:
        from nanonorm.run_files import write_atomically

        argv = self.argv
        if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0 and has_checkpoint(self.out_dir):
            argv = resume_argv(argv)  # requeued by SLURM after its train.py saved
        command = [*self.prefix, *argv]
        os.makedirs(self.out_dir, exist_ok=True)
        resumed = "--init_from=resume" in argv
        before = previous_wall_s(self.out_dir) if resumed else 0.0
        start = time.perf_counter()
        with open(os.path.join(self.out_dir, "train.log"), "a" if resumed else "w") as log:
            # train.py ignores SIGUSR2 (its default action would kill it unsaved): the job turns it into SIGTERM
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                       preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
            with forwarding_to(process):
                code = process.wait()
        info = {**self.record, "argv": argv, "exit_code": code, "wall_s": before + time.perf_counter() - start}
        write_atomically(os.path.join(self.out_dir, "run.json"), json.dumps(info, indent=1).encode())
        return info


def previous_wall_s(out_dir: str) -> float:
    try:
        with open(os.path.join(out_dir, "run.json")) as f:
            value = json.load(f).get("wall_s", 0.0)
    except (OSError, ValueError, AttributeError):
        return 0.0
    return float(value) if isinstance(value, (int, float)) else 0.0


@contextlib.contextmanager
def forwarding_to(process: subprocess.Popen) -> Iterator[None]:
    """SIGTERM, SIGINT and SIGUSR2 to this process reach `process` as SIGTERM (its save-and-stop signal); after
    STOP_WAIT_S without its end it is killed (a scheduler would kill it soon anyway)."""
    def forward(signum: int, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        timer = threading.Timer(STOP_WAIT_S, lambda: process.poll() is None and process.kill())
        timer.daemon = True  # the job ends with its train.py, not STOP_WAIT_S later
        timer.start()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ----------------------------------------------------------------------------- submitting and waiting


def make_executor(launcher: Launcher, folder: str, repo: str):
    """submitit's executor for launcher.executor; its jobs import nanonorm from `repo` (PYTHONPATH)."""
    try:
        import submitit
    except ImportError:
        raise LaunchError(f"--executor {launcher.executor} needs submitit: pip install submitit") from None
    setup = [f"export PYTHONPATH={shlex.quote(repo)}${{PYTHONPATH:+:$PYTHONPATH}}"]
    if launcher.executor == "local":
        executor = submitit.LocalExecutor(folder=os.path.join(folder, "%j"))
        executor.update_parameters(timeout_min=60 * 24 * 365, setup=setup)  # runs end on their own here
    else:
        executor = submitit.SlurmExecutor(folder=os.path.join(folder, "%j"))
        executor.update_parameters(setup=setup, **launcher.slurm)
    return executor


def recorded_job(out_dir: str, executor: str):
    """The SLURM job an earlier sweep command submitted for this run and that still holds it (queued or running),
    from its job.json; None if there is none (local jobs end with the command that started them)."""
    if executor != "slurm":
        return None
    try:
        with open(os.path.join(out_dir, JOB_FILE)) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, dict) or recorded.get("executor") != "slurm":
        return None
    import submitit

    job = submitit.SlurmJob(folder=recorded["folder"], job_id=str(recorded["job_id"]))
    return job if job.state.split()[0] in LIVE_SLURM_STATES else None


@dataclass
class Submission:
    """A run submitted as a job: the sweep's job dict, the submitit job, and how often it was resubmitted."""

    job: dict
    handle: object
    gpus: tuple[int, ...] | None = None
    resubmits: int = 0


def run_jobs(jobs: list[dict], launcher: Launcher, out_root: str, make_job: Callable[[dict, tuple | None], TrainJob],
             finished: Callable[[dict], bool], report: Callable[[dict, dict], None],
             stopping: Callable[[], bool]) -> None:
    """Submit every job (through submitit), at most launcher.workers at once on this machine, all at once on SLURM,
    and wait for them: `report(job, info)` as each ends (info: run.json's record, or {"error": ...}). A job that
    ends while its run is neither `finished` nor failed for a reason of its own (a stop, preemption, the time
    limit: the run saved a checkpoint) is submitted again to resume, up to MAX_RESUBMITS times. A run whose earlier
    SLURM job still holds it is waited for, not submitted again. `stopping()` true: nothing more is submitted; local
    jobs get SIGTERM (they save and stop) and are waited for, SLURM jobs go on (the same command continues)."""
    folder = os.path.join(out_root, "submitit")
    executor = make_executor(launcher, folder, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pool = launcher.pool()
    queue, active = list(jobs), []
    slots: dict[int, contextlib.ExitStack] = {}
    try:
        while queue or active:
            while queue and not stopping() and (launcher.executor == "slurm" or len(active) < launcher.workers):
                job = queue.pop(0)
                stack = contextlib.ExitStack()
                gpus = stack.enter_context(pool.slot()) if pool and launcher.executor == "local" else None
                handle = recorded_job(job["out_dir"], launcher.executor) or submit(executor, make_job(job, gpus),
                                                                                   job, folder, launcher.executor)
                active.append(Submission(job, handle, gpus, job.get("resubmits", 0)))
                slots[id(active[-1])] = stack
            done = [s for s in active if s.handle.done()]
            for s in done:
                active.remove(s)
                slots.pop(id(s)).close()
                info = job_result(s.handle)
                again = not stopping() and not finished(s.job) and has_checkpoint(s.job["out_dir"]) and (
                    info.get("exit_code") in (None, 4) or "error" in info) and s.resubmits < MAX_RESUBMITS
                if again:
                    queue.append({**s.job, "argv": resume_argv(s.job["argv"]), "state": "resume",
                                  "resubmits": s.resubmits + 1})
                    print(f"resubmit {s.job['out_dir']}: its job ended before the run did "
                          f"({info.get('error') or 'stopped'}); it resumes from its checkpoint", flush=True)
                else:
                    report(s.job, info)
            if stopping() and launcher.executor == "slurm":
                return
            if active and not done:
                time.sleep(POLL_S[launcher.executor])
    except KeyboardInterrupt:
        if launcher.executor == "local":
            stop_local(active)
        raise


def submit(executor, train_job: TrainJob, job: dict, folder: str, kind: str):
    """Submit one run; its job.json records the job so that a later sweep command finds it."""
    from nanonorm.run_files import write_atomically

    if kind == "slurm":
        executor.update_parameters(job_name=os.path.basename(job["out_dir"])[:100])
    handle = executor.submit(train_job)
    os.makedirs(job["out_dir"], exist_ok=True)
    record = {"executor": kind, "job_id": handle.job_id, "folder": os.path.join(folder, "%j")}
    write_atomically(os.path.join(job["out_dir"], JOB_FILE), json.dumps(record, indent=1).encode())
    print(f"submitted {job['out_dir']}" + (" (resume)" if job["state"] == "resume" else "")
          + f": {kind} job {handle.job_id}", flush=True)
    return handle


def job_result(handle) -> dict:
    """What a finished job returned (the run's record), or {"error": why it has none}."""
    try:
        result = handle.result()
    except Exception as e:  # submitit raises its UncompletedJobError or FailedJobError, with the job's traceback
        lines = str(e).strip().splitlines()
        why = lines[-1][:200] if lines else type(e).__name__
        return {"error": f"job {handle.job_id} ended without a result ({why}; its logs: {handle.paths.stderr})"}
    return result if isinstance(result, dict) else {"error": f"job {handle.job_id} returned {result!r}"}


def stop_local(active: list[Submission]) -> None:
    """SIGTERM to each local job's controller (it reaches train.py, which saves and stops), then wait for them."""
    for s in active:
        process = getattr(s.handle, "_process", None)
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for s in active:
        process = getattr(s.handle, "_process", None)
        while process is not None and process.poll() is None:
            with contextlib.suppress(KeyboardInterrupt):  # however many signals follow: no run is left running
                process.wait()

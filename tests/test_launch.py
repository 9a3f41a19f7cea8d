"""Where a sweep's runs train (nanonorm/launch.py): each run on GPUs of its own, never more runs on a GPU than its
slots, several GPUs a run by torchrun, and the same runs as submitit jobs (locally here; SLURM's sbatch script
checked by a stand-in sbatch), a job that ends before its run resubmitted to resume."""

import json
import os
import pathlib
import signal
import stat
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT, tiny_run_args

import sweep
from nanonorm import launch

CONFIG = os.path.join(ROOT, "configs", "cpu_base.py")


def one_line_error(capsys, *parts: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(p in err for p in parts), err
    return err


# ----------------------------------------------------------------------------- devices


def test_runs_go_to_the_least_loaded_gpu_and_never_past_its_slots():
    groups = launch.gpu_groups([0, 1, 2, 3], 1)
    assert launch.least_loaded([1, 0, 0, 1], 2) == 1  # the fewest runs, the first such on a tie
    assert launch.least_loaded([2, 2], 2) is None  # every slot taken: the run waits
    placed = launch.planned_devices(10, groups, 2)
    assert placed[:4] == [(0,), (1,), (2,), (3,)]  # one run per GPU before any GPU gets a second
    for start in range(len(placed) - 7):  # 8 slots: any 8 runs in a row that run together
        window = placed[start:start + 8]
        assert all(window.count(g) <= 2 for g in groups)
    assert launch.gpu_groups([4, 5, 6, 7], 2) == [(4, 5), (6, 7)]  # torchrun's groups, in the order given


def test_a_freed_slot_is_taken_by_the_next_run_and_no_gpu_holds_more_than_its_slots():
    """12 runs of unequal length from 6 threads on 2 GPUs with 2 slots each: at no moment more than 2 runs on a
    GPU, and every run got a slot (a finished run frees its own)."""
    pool = launch.DevicePool([(0,), (1,)], 2)
    on, most, lock, got = {(0,): 0, (1,): 0}, {(0,): 0, (1,): 0}, threading.Lock(), []

    def run(i: int) -> None:
        with pool.slot() as gpus:
            with lock:
                on[gpus] += 1
                most[gpus] = max(most[gpus], on[gpus])
                got.append(gpus)
            time.sleep(0.002 * (i % 3))
            with lock:
                on[gpus] -= 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12) for _ in range(1)]
    for t in threads[:6]:
        t.start()
    for t in threads[6:]:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(got) == 12 and max(most.values()) <= 2 and set(got) == {(0,), (1,)}
    assert pool.load == [0, 0]


def test_gpu_ids_are_the_sweeps_own_under_its_cuda_visible_devices():
    assert launch.device_env((0, 1), visible="") == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert launch.device_env((1,), visible="4,6") == {"CUDA_VISIBLE_DEVICES": "6"}  # id 1 of what the sweep sees
    assert launch.device_env(None) == {}
    assert launch.parse_gpus("0,2", visible=0) == [0, 2]  # a list is taken as given (a dry run starts nothing)
    for bad in ("0,0", "a", "1,-1"):
        with pytest.raises(launch.LaunchError):
            launch.parse_gpus(bad, visible=4)
    with pytest.raises(launch.LaunchError):
        launch.gpu_groups([0, 1, 2], 2)  # 3 GPUs do not split into runs of 2


def test_dry_run_prints_each_runs_device(tmp_path, capsys):
    """The command of the request, with a device list this machine need not have: two runs on each GPU."""
    argv = [CONFIG, "--grid", "norm_scheme=pre,geonorm", "--seeds", "1,2", "--gpus", "0,1", "--runs_per_gpu", "2",
            "--out_root", str(tmp_path / "s"), "--dry_run"]
    assert sweep.main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    devices = [line for line in lines if line.startswith("# GPU")]
    commands = [line for line in lines if line.startswith("python train.py")]
    assert len(devices) == len(commands) == 4
    assert [d.split(": ")[1] for d in devices] == [f"CUDA_VISIBLE_DEVICES={g}" for g in (0, 1, 0, 1)]
    assert "4 at a time" in out and not os.path.exists(tmp_path / "s")


def test_several_gpus_a_run_launch_by_torchrun(tmp_path, capsys):
    argv = [CONFIG, "--grid", "norm_scheme=pre,geonorm", "--gpus", "0,1,2,3", "--gpus_per_run", "2",
            "--out_root", str(tmp_path / "s"), "--dry_run"]
    assert sweep.main(argv) == 0
    out = capsys.readouterr().out
    assert "# GPUs 0,1: CUDA_VISIBLE_DEVICES=0,1" in out and "# GPUs 2,3: CUDA_VISIBLE_DEVICES=2,3" in out
    assert out.count("python -m torch.distributed.run --standalone --nproc_per_node=2 train.py") == 2


@pytest.mark.parametrize("flags, words", [
    (["--gpus", "all"], ["--gpus all", "no visible CUDA device"]),
    (["--gpus", "0,1", "--gpus_per_run", "3"], ["--gpus_per_run 3"]),
    (["--runs_per_gpu", "2"], ["--gpus"]),
    (["--gpus", "0", "--jobs", "3"], ["--jobs 3"]),
    (["--slurm_partition", "gpu"], ["--executor slurm"]),
    (["--executor", "slurm", "--slurm_extra", "account"], ["KEY=VALUE"]),
])
def test_device_and_executor_settings_that_cannot_work_are_refused(tmp_path, capsys, monkeypatch, flags, words):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # this machine, as CI's: no CUDA
    assert sweep.main([CONFIG, "--grid", "norm_scheme=pre", *flags, "--out_root", str(tmp_path / "s"),
                       "--dry_run"]) == 2
    one_line_error(capsys, *words)


def test_run_json_records_the_gpus_and_the_launcher(data_dir, tmp_path, monkeypatch, capsys):
    """Two real tiny runs on two (pretended) GPUs: each run's record names the GPU it was given, and its train.py
    saw that GPU alone through CUDA_VISIBLE_DEVICES (a CPU run ignores it)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fixed = [a[2:] for a in tiny_run_args(data_dir, "unused", max_iters=4, lr_decay_iters=4, eval_interval=4,
                                           sample_tokens=0, device="cpu") if not a.startswith("--out_dir=")]
    out_root = tmp_path / "s"
    assert sweep.main([CONFIG, "--seeds", "1,2", "--gpus", "0,1", "--threads_per_run", "1", "--out_root",
                       str(out_root), "--set", *fixed]) == 0, capsys.readouterr().err
    infos = [json.loads((out_root / f"seed={s}" / "run.json").read_text()) for s in (1, 2)]
    assert sorted(i["gpus"] for i in infos) == [[0], [1]] and {i["launcher"] for i in infos} == {"python train.py"}
    assert all(i["exit_code"] == 0 for i in infos)


# ----------------------------------------------------------------------------- submitit


STAND_IN = """import os, sys
out = sys.argv[sys.argv.index('--out') + 1]
if '--init_from=resume' in sys.argv:
    open(os.path.join(out, 'done'), 'w').close()
    print('resumed on', os.environ.get('CUDA_VISIBLE_DEVICES'))
    sys.exit(0)
open(os.path.join(out, 'ckpt.pt'), 'w').close()
sys.exit(4)  # stopped: saved, as train.py does on SIGTERM (a preemption, the time limit)
"""


def test_a_job_that_ends_before_its_run_is_resubmitted_to_resume(tmp_path, capsys):
    """submitit's local executor runs a stand-in for train.py that saves and stops on its first start: the job
    records run.json and job.json, and the run is submitted again with --init_from=resume, which finishes it."""
    pytest.importorskip("submitit")
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    out_dir = str(tmp_path / "root" / "run")
    job = {"out_dir": out_dir, "argv": ["--out", out_dir, "--overwrite=True"], "state": "new", "point": {"seed": 1}}
    launcher = launch.Launcher(workers=1, threads=1, groups=[(3,)], executor="local")
    reports = []

    def make_job(j: dict, gpus) -> launch.TrainJob:
        return launch.TrainJob([sys.executable, str(script)], j["argv"], j["out_dir"], launch.device_env(gpus),
                               {"point": j["point"], "gpus": list(gpus)})

    launch.run_jobs([job], launcher, str(tmp_path / "root"), make_job,
                    lambda j: os.path.exists(os.path.join(j["out_dir"], "done")),
                    lambda j, info: reports.append(info), lambda: False)
    out = capsys.readouterr().out
    assert "resubmit" in out and len(reports) == 1
    info = reports[0]
    assert info["exit_code"] == 0 and info["argv"] == ["--out", out_dir, "--init_from=resume"]
    assert info["gpus"] == [3] and "resumed on 3" in pathlib.Path(out_dir, "train.log").read_text()
    recorded = json.loads(pathlib.Path(out_dir, "run.json").read_text())
    assert recorded["exit_code"] == 0 and recorded["wall_s"] > 0
    assert json.loads(pathlib.Path(out_dir, "job.json").read_text())["executor"] == "local"


def test_slurm_jobs_carry_the_sweeps_options(tmp_path, monkeypatch):
    """A stand-in sbatch records the script submitit writes: the partition, time, GPUs and extra options given,
    the import path of this checkout, and one job per run, recorded in its job.json."""
    pytest.importorskip("submitit")
    bin_dir, scripts = tmp_path / "bin", tmp_path / "scripts"
    bin_dir.mkdir()
    scripts.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\ncp \"$1\" {scripts}/job.sh\necho 'Submitted batch job 4242'\n")
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for it before it submits
    for tool in (sbatch, bin_dir / "srun"):
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    slurm = launch.slurm_parameters("gpu", 90, 2, None, ["account=proj", "qos=high"])
    launcher = launch.Launcher(1, 0, gpus_per_run=2, executor="slurm", slurm=slurm)
    executor = launch.make_executor(launcher, str(tmp_path / "submitit"), ROOT)
    out_dir = str(tmp_path / "run")
    job = {"out_dir": out_dir, "argv": ["--seed=1"], "state": "new"}
    handle = launch.submit(executor, launch.TrainJob(launcher.prefix("train.py"), job["argv"], out_dir, {}, {}), job,
                           str(tmp_path / "submitit"), "slurm")
    assert handle.job_id == "4242"
    text = (scripts / "job.sh").read_text()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --time=90", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --account=proj", "#SBATCH --qos=high", f"export PYTHONPATH={ROOT}"):
        assert line in text, text
    assert json.loads(pathlib.Path(out_dir, "job.json").read_text())["job_id"] == "4242"


def test_executor_local_runs_a_two_arm_lr_grid_sweep_to_its_verdict_table(data_dir, tmp_path, capsys):
    """The same sweep code path through submitit's local executor: 2 arms x 2 rates on the selection seed, then
    each arm's held-out seed at its best rate (the baseline's at its second-best too), and the table with the
    verdict column: 7 runs, each a submitit job running train.py."""
    pytest.importorskip("submitit")
    fixed = [a[2:] for a in tiny_run_args(data_dir, "unused", max_iters=4, lr_decay_iters=4, eval_interval=4,
                                           sample_tokens=0) if not a.startswith(("--out_dir=", "--learning_rate="))]
    out_root = tmp_path / "lr"
    argv = [CONFIG, "--grid", "norm_scheme=pre,geonorm", "--lr_grid", "1e-3,3e-3", "--select_seeds", "0", "--seeds",
            "1", "--baseline", "norm_scheme=pre", "--executor", "local", "--threads_per_run", "1", "--out_root",
            str(out_root), "--set", *fixed]
    assert sweep.main(argv) == 0, capsys.readouterr().err
    summary = json.loads((out_root / "summary.json").read_text())
    assert [p["norm_scheme"] for p in summary["lr_points"]] == ["pre", "geonorm"]
    assert all(p["best_lr"] in ("1e-3", "3e-3") for p in summary["lr_points"])
    runs = [d for d in out_root.iterdir() if (d / "run.json").exists()]
    assert len(runs) == 7 and all((d / "job.json").exists() for d in runs)
    assert {d.name for d in runs if d.name.endswith("seed=1")} == {
        "norm_scheme=pre,learning_rate=1e-3,seed=1", "norm_scheme=pre,learning_rate=3e-3,seed=1",
        f"norm_scheme=geonorm,learning_rate={summary['lr_points'][1]['best_lr']},seed=1"}
    assert "verdict vs baseline" in (out_root / "summary.md").read_text()


def test_a_sweep_groups_its_runs_in_wandb(tmp_path, capsys):
    """Every run of a sweep that logs to wandb gets the sweep's group: --wandb_group, or the out_root's name. (Planning
    refuses --set wandb_project without wandb installed, an optional package.)"""
    pytest.importorskip("wandb")
    base = [CONFIG, "--grid", "norm_scheme=pre,geonorm", "--set", "wandb_project=p", "--dry_run"]
    assert sweep.main([*base, "--out_root", str(tmp_path / "depth_L4")]) == 0
    assert capsys.readouterr().out.count("--wandb_group=depth_L4") == 2
    assert sweep.main([*base, "--out_root", str(tmp_path / "s"), "--wandb_group", "mine"]) == 0
    assert capsys.readouterr().out.count("--wandb_group=mine") == 2
    assert sweep.main([CONFIG, "--wandb_group", "g", "--out_root", str(tmp_path / "s"), "--dry_run"]) == 2
    one_line_error(capsys, "--wandb_group", "wandb_project")


WAITS_FOR_A_STOP = """import os, signal, sys, time
out = sys.argv[1]
os.kill(os.getpid(), signal.SIGUSR2)  # submitit's warning before a time limit: ignored here, not fatal
def stop(signum, frame):
    open(os.path.join(out, 'got'), 'w').write(signal.Signals(signum).name)
    sys.exit(4)  # as train.py: saved, then stopped
signal.signal(signal.SIGTERM, stop)
open(os.path.join(out, 'ready'), 'w').close()
time.sleep(60)
"""


def test_a_stop_signal_to_a_job_reaches_its_train_py_as_sigterm(tmp_path):
    """SLURM's SIGUSR2 before the time limit (or its SIGTERM at preemption) to the job's process reaches the run's
    train.py as SIGTERM, on which it saves and stops; SIGUSR2 sent to train.py itself does not kill it."""
    script = tmp_path / "stand_in.py"
    script.write_text(WAITS_FOR_A_STOP)
    out_dir = tmp_path / "run"
    job = launch.TrainJob([sys.executable, str(script)], [str(out_dir)], str(out_dir), {}, {"point": {}})

    def signal_when_ready() -> None:
        deadline = time.monotonic() + 60
        while not (out_dir / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGUSR2)

    threading.Thread(target=signal_when_ready, daemon=True).start()
    info = job()
    assert info["exit_code"] == 4 and (out_dir / "got").read_text() == "SIGTERM"
    assert json.loads((out_dir / "run.json").read_text())["exit_code"] == 4

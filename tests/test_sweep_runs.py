"""sweep.py as a process with real tiny train.py runs: a stop signal to the sweep reaches its runs."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from conftest import ROOT, tiny_run_args

from sweep import main as sweep_main

CONFIG = os.path.join(ROOT, "configs", "cpu_base.py")


def sweep_command(data_dir: str, out_root: str, max_iters: int) -> list[str]:
    """One tiny run of max_iters iterations (about 3 ms each on one thread), evaluated at its start and end."""
    args = tiny_run_args(data_dir, "unused", max_iters=max_iters, lr_decay_iters=max_iters, eval_interval=max_iters,
                         log_interval=10, sample_tokens=0)
    fixed = [arg[2:] for arg in args if not arg.startswith("--out_dir=")]
    return [sys.executable, "sweep.py", CONFIG, "--seeds", "1", "--out_root", out_root, "--threads_per_run", "1",
            "--set", *fixed]


def wait_for_training(run: str, sweep: subprocess.Popen, timeout: float = 60.0) -> int:
    """The pid of the train.py that holds the run's folder, once it has logged a training step."""
    metrics, deadline = os.path.join(run, "metrics.jsonl"), time.monotonic() + timeout
    while not (os.path.exists(metrics) and '"kind": "train"' in pathlib.Path(metrics).read_text()):
        assert sweep.poll() is None and time.monotonic() < deadline, "the run never started training"
        time.sleep(0.05)
    with open(os.path.join(run, ".lock")) as f:
        return int(f.read())


def read_json(*path: str) -> dict:
    return json.loads(pathlib.Path(*path).read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_runs_with_the_sweep_and_the_same_command_resumes(data_dir, tmp_path, capsys):
    """The stopped sweep is a process, the signal sent to it alone; the same command then runs through sweep.py's
    main in this process (its run, resumed, is again a train.py process)."""
    out_root, run = str(tmp_path / "sweep"), str(tmp_path / "sweep" / "seed=1")
    command = sweep_command(data_dir, out_root, max_iters=600)
    sweep = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = None
    try:
        child = wait_for_training(run, sweep)
        sweep.send_signal(signal.SIGTERM)  # to the sweep alone, as `kill PID` or a scheduler sends it
        _, err = sweep.communicate(timeout=60)
        assert sweep.returncode == 143 and "interrupted: run the same command to continue the sweep" in err, err
        assert not alive(child)  # waited for, not left running into the folder
    finally:
        if sweep.poll() is None:
            sweep.kill()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        status = [r for r in map(json.loads, f) if r.get("kind") == "status"]
    assert status[-1]["status"] == "stopped" and status[-1]["signal"] == "SIGTERM"  # saved, then stopped
    assert read_json(run, "run.json")["exit_code"] == 4

    assert command[:2] == [sys.executable, "sweep.py"]
    code = sweep_main(command[2:])
    again = capsys.readouterr()
    assert code == 0, again.out + again.err
    assert f"start {run} (resume)" in again.out
    info = read_json(run, "run.json")
    assert info["exit_code"] == 0 and info["settings"]["max_iters"] == 600 and info["settings"]["n_layer"] == 2

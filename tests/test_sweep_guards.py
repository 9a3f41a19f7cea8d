"""sweep.py, plot.py and prepare_data.py guarding what they count and keep: a run is counted only with the settings
and data its sweep planned, a key or a root is taken once, a run that cannot be launched or a stop signal ends the
sweep cleanly, and a preparation stopped by a full disk or Ctrl-C leaves the earlier data as it was."""

import errno
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT
from test_sweep_rules import LOWER, POST, PRE, curve, finished_run, lr_sweep, recorded_settings, saved_settings
from test_sweep_runs import alive, read_json, sweep_command, wait_for_training

import plot
import prepare_data
import sweep

CONFIG = os.path.join(ROOT, "configs", "cpu_base.py")


def one_line_error(capsys, *parts: str) -> str:
    """The one line a refused command printed on stderr, holding every one of `parts`."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(p in err for p in parts), err
    return err


# ----------------------------------------------------------------------------- a key given once


@pytest.mark.parametrize("flags, key", [
    (["--grid", "learning_rate=1e-3", "--grid", "learning_rate+min_lr=1e-4,2e-4"], "learning_rate"),
    (["--grid", "n_layer+n_head=2,4", "--grid", "n_head=2"], "n_head"),
    (["--set", "min_lr=1e-5", "--set", "learning_rate+min_lr=1e-4"], "min_lr"),
])
def test_a_key_in_two_grid_or_set_flags_is_refused(tmp_path, capsys, flags, key):
    """One run folder name would carry both values while the run trains with the last: refused, naming the key."""
    assert sweep.main([CONFIG, *flags, "--out_root", str(tmp_path), "--dry_run"]) == 2
    one_line_error(capsys, f"{key}=", "twice")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("lr_grid", [[], ["--lr_grid", "1e-3"]])
def test_a_seed_given_by_set_and_seeds_is_refused(tmp_path, capsys, lr_grid):
    """--seeds names every run's seed and folder: a --set seed beside it would be dropped without a word."""
    assert sweep.main([CONFIG, "--set", "seed=7", "--seeds", "1,2", *lr_grid, "--out_root", str(tmp_path),
                       "--dry_run"]) == 2
    one_line_error(capsys, "seed=7", "--seeds")


def test_the_swept_rate_given_by_set_too_is_refused(tmp_path, capsys):
    """--lr_grid sets the rate of every run: a --set value of it would be dropped without a word."""
    argv = [CONFIG, "--set", "learning_rate=1e-3", "--lr_grid", "1e-3,1e-2", "--out_root", str(tmp_path), "--dry_run"]
    assert sweep.main(argv) == 2
    one_line_error(capsys, "learning_rate", "--lr_grid")
    assert sweep.main([CONFIG, "--lr_keys", "learning_rate+learning_rate", *argv[3:]]) == 2  # a key twice
    one_line_error(capsys, "--lr_keys", "learning_rate")


# ----------------------------------------------------------------------------- a root given once


def test_a_leaderboard_root_given_twice_is_read_once(tmp_path, capsys):
    """The same sweep by a trailing slash or a symlink is one sweep: its rows once, the baseline never against
    itself, each comparison once in Holm's family."""
    root = tmp_path / "a"
    lr_sweep(root, {"pre": curve("1e-3", PRE), "post": curve("1e-3", POST)})
    os.symlink(root, tmp_path / "link")
    once = sweep.leaderboard([str(root)], {"norm_scheme": "pre"}, LOWER)
    for again in (f"{root}/", str(tmp_path / "link")):
        board = sweep.leaderboard([str(root), again], {"norm_scheme": "pre"}, LOWER)
        assert [row["label"] for row in board] == [row["label"] for row in once] == ["norm_scheme=pre",
                                                                                     "norm_scheme=post"]
        assert board[1]["verdict"] == once[1]["verdict"] and "Holm" not in board[1]["verdict"]  # a family of one
    capsys.readouterr()
    assert sweep.main(["--leaderboard", str(root), f"{root}/", "--baseline", "norm_scheme=pre"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "once" in line]
    assert len(notes) == 1 and str(root) in notes[0], notes


def test_a_leaderboard_row_claim_that_matches_no_row_is_refused(tmp_path, capsys):
    """A mistyped --row_claim would leave its row described, not judged, without a word: refused, listing the
    rows it could name."""
    lr_sweep(tmp_path, {"pre": curve("1e-3", PRE), "post": curve("1e-3", POST)})
    argv = ["--leaderboard", str(tmp_path), "--baseline", "norm_scheme=pre"]
    assert sweep.main([*argv, "--row_claim", "norm_scheme=postt:lower:0.05"]) == 2
    one_line_error(capsys, "norm_scheme=postt", "norm_scheme=pre", "norm_scheme=post")
    assert sweep.main([*argv, "--row_claim", "norm_scheme=post:lower:0.05"]) == 0


def test_plot_reads_a_folder_given_twice_once(tmp_path, monkeypatch, capsys):
    """A run named twice (out/sweep/*/ beside out/sweep/a) would count twice in its seeds' mean; a sweep named
    twice would draw its curves twice."""
    configs = {}
    for scheme, seed, ys in (("pre", 1, [4.0, 2.0]), ("pre", 2, [4.0, 3.0]), ("post", 1, [4.0, 3.5])):
        run = tmp_path / f"{scheme}{seed}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "eval", "iter": 50 * i, "val_loss": y}) + "\n"
                                                   for i, y in enumerate(ys)))
        configs[str(run)] = {"norm_scheme": scheme, "seed": seed}
    runs = list(configs)
    monkeypatch.setattr(plot, "run_config", lambda d: configs[os.path.normpath(d)])
    assert plot.main([*runs, f"{runs[0]}/", "--seed_means", "--out", str(tmp_path / "runs.png")]) == 0
    out = capsys.readouterr().out
    assert out.count("once") == 1 and runs[0] in out, out
    fig = plot.draw(plot.distinct_folders([*runs, f"{runs[0]}/"]), ["val_loss"], seed_means=True)
    means = {line.get_label(): line.get_ydata().tolist() for line in fig.axes[0].get_lines()
             if "mean" in line.get_label()}
    assert means["norm_scheme=pre (mean of 2 seeds)"] == pytest.approx([4.0, 2.5])
    lr_sweep(tmp_path / "lr", {"pre": curve("1e-3", PRE)})
    merged = plot.load_lr_sweeps(plot.distinct_folders([str(tmp_path / "lr"), f"{tmp_path / 'lr'}/"]))
    assert len(merged["lr_points"]) == 1


# ----------------------------------------------------------------------------- a run counted with its own settings


def test_a_run_trained_by_hand_with_other_settings_is_not_counted_as_the_sweeps(tmp_path, capsys):
    """run.json records what the sweep launched; a run resumed by hand with other flags (its checkpoint says what it
    trained with) is refused, finished or not, naming the folder and the keys that differ."""
    fixed = {"max_iters": "4", "batch_size": "2", "learning_rate": "1e-3"}
    [job] = sweep.plan_runs(CONFIG, {}, [1], fixed, str(tmp_path))
    run, by_hand = job["out_dir"], [*job["argv"], "--learning_rate=0.02", "--batch_size=8", "--init_from=resume"]
    finished_run(run, job["argv"], settings=recorded_settings(job["argv"]))
    command = [CONFIG, "--set", *(f"{k}={v}" for k, v in fixed.items()), "--seeds", "1", "--out_root", str(tmp_path)]
    saved_settings(os.path.join(run, "ckpt.pt"), [*job["argv"], "--init_from=resume"])  # resumed by the sweep
    assert sweep.plan_runs(CONFIG, {}, [1], fixed, str(tmp_path))[0]["state"] == "finished"
    saved_settings(os.path.join(run, "ckpt.pt"), [*job["argv"], "--max_iters=8"])  # trained on past max_iters
    assert sweep.plan_runs(CONFIG, {}, [1], fixed, str(tmp_path))[0]["state"] == "finished"
    saved_settings(os.path.join(run, "ckpt.pt"), by_hand)
    assert sweep.main(command) == 2
    one_line_error(capsys, run, "learning_rate", "batch_size")
    assert not os.path.exists(tmp_path / "summary.json")
    pathlib.Path(run, "metrics.jsonl").write_text("")  # unfinished: resumed, it would go on from the other settings
    saved_settings(os.path.join(run, "ckpt.pt"), [*job["argv"], "--init_from=resume"])
    saved_settings(os.path.join(run, "ckpt_last.pt"), by_hand)
    with pytest.raises(sweep.SweepError, match="learning_rate"):
        sweep.plan_runs(CONFIG, {}, [1], fixed, str(tmp_path))
    assert sweep.plan_runs(CONFIG, {}, [1], fixed, str(tmp_path), rerun=True)[0]["state"] == "new"


# ----------------------------------------------------------------------------- a sweep's runs on one corpus


def prepared(data_dir, text: str, force: bool = False) -> str:
    """data_dir/corpus_char prepared from `text` (its vocabulary and token files); its path."""
    corpus = pathlib.Path(data_dir).parent / f"corpus_{abs(hash(text))}.txt"
    corpus.write_text(text)
    return prepare_data.prepare("corpus", tokenizer="char", data_dir=str(data_dir), force=force, input=str(corpus))


TEXT_A = "the quick brown fox jumps over the lazy dog\n" * 40
TEXT_B = "pack my box with five dozen liquor jugs now\n" * 40


def trains_on_what_meta_says(dataset: str, after_first=None):
    """A stand-in for sweep.launch: the run trains on what the dataset's meta.json holds when it starts, as train.py
    does (its checkpoint saves that meta), and ends evaluated at max_iters; `after_first` runs after the first run."""
    calls = []

    def launch(job: dict, threads: int) -> dict:
        meta = prepare_data.load_meta(dataset)
        os.makedirs(job["out_dir"], exist_ok=True)
        loss = 2.0 + 0.01 * job["point"]["seed"] + abs(math.log10(float(job["settings"]["learning_rate"])) + 3)
        evals = [{"kind": "eval", "iter": i, "val_loss": loss + 1.0 / (1 + i)}
                 for i in (0, job["settings"]["max_iters"])]
        pathlib.Path(job["out_dir"], "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
        torch.save({"data_meta": meta}, os.path.join(job["out_dir"], "ckpt.pt"))
        info = {"point": job["point"], "argv": job["argv"], "exit_code": 0, "wall_s": 1.0, "threads": 1,
                "settings": job["settings"]}
        pathlib.Path(job["out_dir"], "run.json").write_text(json.dumps(info))
        calls.append(job["out_dir"])
        if len(calls) == 1 and after_first:
            after_first()
        return info

    return launch


@pytest.mark.parametrize("lr_grid", [[], ["--lr_grid", "1e-3,1e-2"]])
def test_data_prepared_again_while_a_sweep_runs_is_not_averaged(tmp_path, capsys, monkeypatch, lr_grid):
    """Seed 1 trains on corpus A, then the dataset is prepared again from corpus B and the later runs train on it:
    the sweep refuses to summarize them together (exit 2), naming the runs trained on the other data."""
    data = tmp_path / "data"
    dataset = prepared(data, TEXT_A)
    monkeypatch.setattr(sweep, "launch", trains_on_what_meta_says(dataset, lambda: prepared(data, TEXT_B, True)))
    root = tmp_path / "sweep"
    argv = [CONFIG, "--set", "max_iters=4", f"data_dir={data}", "dataset=corpus_char", "--seeds", "1,2",
            "--out_root", str(root), "--jobs", "1", *lr_grid]
    assert sweep.main(argv) == 2
    err = one_line_error(capsys, "prepared again", str(data / "corpus_char"))
    first = "learning_rate=1e-3,seed=0" if lr_grid else "seed=1"  # trained on corpus A, as the sweep started
    later = [str(root / d) for d in os.listdir(root) if "=" in d and d != first]
    assert later and all(d in err for d in later) and not re.search(re.escape(str(root / first)) + r"\b", err), err
    assert not os.path.exists(root / "summary.json")


def lr_sweep_on(tmp_path, monkeypatch, name: str, scheme: str, text: str) -> str:
    """An --lr_grid sweep of one scheme, its runs standing in for train.py, on a corpus_char prepared from `text` in
    a data folder of its own; its out_root."""
    data = tmp_path / f"data_{name}"
    monkeypatch.setattr(sweep, "launch", trains_on_what_meta_says(prepared(data, text)))
    root = str(tmp_path / name)
    assert sweep.main([CONFIG, "--grid", f"norm_scheme={scheme}", "--set", "max_iters=4", f"data_dir={data}",
                       "dataset=corpus_char", "--seeds", "1", "--lr_grid", "1e-3,1e-2", "--out_root", root]) == 0
    return root


def test_a_leaderboard_of_sweeps_on_other_text_is_refused(tmp_path, capsys, monkeypatch):
    """Two sweeps on a dataset of one name prepared from other text (another vocabulary and other tokens) are not
    compared: the leaderboard and the learning-rate figure exit 2 naming both; on the same text they are."""
    pre = lr_sweep_on(tmp_path, monkeypatch, "pre", "pre", TEXT_A)
    other = lr_sweep_on(tmp_path, monkeypatch, "other", "post", TEXT_B)
    same = lr_sweep_on(tmp_path, monkeypatch, "same", "post", TEXT_A)
    capsys.readouterr()
    assert sweep.main(["--leaderboard", pre, other, "--baseline", "norm_scheme=pre"]) == 2
    one_line_error(capsys, pre, other)
    assert plot.main(["--lr_sweep", pre, other, "--out", str(tmp_path / "lr.png")]) == 2
    one_line_error(capsys, pre, other)
    assert plot.main(["--depth", pre, other, "--out", str(tmp_path / "depth.png")]) == 2
    one_line_error(capsys, pre, other)
    assert sweep.main(["--leaderboard", pre, same, "--baseline", "norm_scheme=pre"]) == 0
    assert plot.main(["--lr_sweep", pre, same, "--out", str(tmp_path / "lr.png")]) == 0
    assert plot.main(["--depth", pre, same, "--out", str(tmp_path / "depth.png")]) == 0
    summary = json.loads(pathlib.Path(other, "summary.json").read_text())
    summary["data_fingerprint"]["corpus_char"] = "edited"
    pathlib.Path(other, "summary.json").write_text(json.dumps(summary))
    capsys.readouterr()
    assert sweep.main(["--leaderboard", pre, other]) == 2  # a fingerprint edited into another type: named
    one_line_error(capsys, "data_fingerprint")


# ----------------------------------------------------------------------------- a run that cannot be launched


STUB_TRAIN = """import json, os, sys
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
iters = int(flags["max_iters"])
with open(os.path.join(flags["out_dir"], "metrics.jsonl"), "w") as f:
    for i in (0, iters):
        f.write(json.dumps({"kind": "eval", "iter": i, "val_loss": 3.0 - i / iters}) + "\\n")
"""


@pytest.mark.parametrize("flags", [["--grid", "learning_rate=0.001" + "0" * 260],
                                   ["--lr_grid", "1e-3,0.003" + "0" * 260]])
def test_a_run_folder_name_over_the_limit_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch, flags):
    """A grid value that makes a run's folder name longer than the file system allows (255 bytes) is refused with
    the value and the limit before any run starts, not found by the run that cannot make its folder."""
    monkeypatch.setattr(sweep, "launch", lambda job, threads: pytest.fail(f"{job['out_dir']} was launched"))
    root = tmp_path / "sweep"
    assert sweep.main([CONFIG, *flags, "--set", "max_iters=4", "--seeds", "1", "--out_root", str(root)]) == 2
    one_line_error(capsys, "learning_rate=0.00", "255")
    assert [d for d in os.listdir(root) if not d.startswith(".")] == []


def disk_full_at_seed_2(monkeypatch, root) -> str:
    """seed=2's run.json cannot be written (the disk fills as it trains); the error it gets."""
    write = sweep.write_atomically

    def write_unless_seed_2(path: str, data: bytes) -> None:
        if path.endswith(os.path.join("seed=2", "run.json")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write(path, data)

    monkeypatch.setattr(sweep, "write_atomically", write_unless_seed_2)
    return os.strerror(errno.ENOSPC)


def no_log_at_seed_2(monkeypatch, root) -> str:
    """seed=2's train.log cannot be opened (a folder of that name is in the way): the run cannot be launched."""
    os.makedirs(root / "seed=2" / "train.log")
    return os.strerror(errno.EISDIR)


@pytest.mark.parametrize("failure", [disk_full_at_seed_2, no_log_at_seed_2])
def test_a_run_that_cannot_be_launched_stops_the_sweep_with_the_summary_of_what_finished(tmp_path, capsys,
                                                                                           monkeypatch, failure):
    """Seed 2 cannot be launched or recorded: it is reported as failed in its own line, seed 3 never starts, the
    summary holds seed 1, and the sweep exits 1 with one line, no traceback."""
    stub = tmp_path / "stub_train.py"
    stub.write_text(STUB_TRAIN)
    monkeypatch.setattr(sweep, "TRAIN", str(stub))
    root = tmp_path / "sweep"
    reason = failure(monkeypatch, root)
    argv = [CONFIG, "--set", "max_iters=4", "--seeds", "1,2,3", "--out_root", str(root), "--jobs", "1"]
    assert sweep.main(argv) == 1
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "seed=2" in err and reason in err, err
    [reported] = [line for line in out.splitlines() if line.startswith("[") and "seed=2" in line]  # its own line
    assert reason in reported, reported
    assert not os.path.exists(root / "seed=3")  # never launched
    summary = json.loads((root / "summary.json").read_text())
    assert [(r["seed"], r["val_loss"]) for r in summary["runs"]] == [(1, 2.0)]


def test_a_summary_that_cannot_be_written_exits_with_one_line(tmp_path, capsys, monkeypatch):
    """The disk fills as the summary is written: one line saying so (exit 1); the runs and the earlier summary stay."""
    stub = tmp_path / "stub_train.py"
    stub.write_text(STUB_TRAIN)
    monkeypatch.setattr(sweep, "TRAIN", str(stub))
    root = tmp_path / "sweep"
    argv = [CONFIG, "--set", "max_iters=4", "--seeds", "1", "--out_root", str(root)]
    assert sweep.main(argv) == 0
    before = (root / "summary.json").read_bytes()

    write = sweep.write_atomically

    def disk_full_at_the_summary(path: str, data: bytes) -> None:
        if os.path.basename(path).startswith("summary"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write(path, data)

    monkeypatch.setattr(sweep, "write_atomically", disk_full_at_the_summary)
    assert sweep.main([*argv, "--rerun"]) == 1
    one_line_error(capsys, os.strerror(errno.ENOSPC), "summary")
    assert (root / "summary.json").read_bytes() == before and os.path.exists(root / "seed=1" / "metrics.jsonl")


# ----------------------------------------------------------------------------- stop signals to the sweep alone


def test_sigint_to_the_sweep_alone_stops_its_run_with_a_save_and_the_same_command_resumes(data_dir, tmp_path, capsys):
    """`kill -INT <sweep pid>`, as a supervisor sends it, reaches the running train.py (it saves and stops) rather
    than letting it train to its end; the same command then resumes it."""
    out_root, run = str(tmp_path / "sweep"), str(tmp_path / "sweep" / "seed=1")
    command = sweep_command(data_dir, out_root, max_iters=600)
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = None
    try:
        child = wait_for_training(run, process)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
        assert process.returncode == 130, err
        assert not alive(child)
    finally:
        if process.poll() is None:
            process.kill()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        status = [r for r in map(json.loads, f) if r.get("kind") == "status"]
    assert status[-1]["status"] == "stopped" and status[-1]["saved"]  # told by the sweep, as SIGTERM
    assert status[-1]["iter"] < 600 and read_json(run, "run.json")["exit_code"] == 4
    assert sweep.main(command[2:]) == 0
    assert f"start {run} (resume)" in capsys.readouterr().out
    assert read_json(run, "run.json")["exit_code"] == 0


STUB_STOPPABLE = """import os, signal, sys, time
out_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--out_dir="))
signals = []
def stop(signum, frame):  # as train.py: the first stop signal saves and stops, a second SIGINT stops at once
    if signals and signum == signal.SIGINT:
        sys.exit(130)
    signals.append(signum)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
with open(os.path.join(out_dir, "pid"), "w") as f:
    f.write(str(os.getpid()))
for _ in range(600):
    if signals:
        time.sleep(0.5)  # saving
        sys.exit(4)
    time.sleep(0.1)
"""


def default_stop_signals() -> None:
    """The sweep starts as from a terminal, whatever this test process ignores (under nohup or in a background job
    SIGHUP or SIGINT are ignored, and a sweep keeps a signal it was started ignoring ignored)."""
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signum, repeats, code", [(signal.SIGINT, 3, 130), (signal.SIGHUP, 1, 129)])
def test_repeated_stop_signals_to_the_sweep_leave_no_run_behind(tmp_path, signum, repeats, code):
    """However many stop signals reach the sweep alone (a supervisor's, or a closed terminal's SIGHUP), it passes
    them on to its running run, waits for it and records it: no train.py is left running without a run.json."""
    stub = tmp_path / "stub_train.py"
    stub.write_text(STUB_STOPPABLE)
    root = tmp_path / "sweep"
    code_line = "import sys, sweep; sweep.TRAIN = sys.argv[1]; sweep.exit_with(lambda: sweep.main(sys.argv[2:]))"
    process = subprocess.Popen([sys.executable, "-c", code_line, str(stub), CONFIG, "--seeds", "1,2", "--jobs", "1",
                                "--out_root", str(root)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, preexec_fn=default_stop_signals)
    pid_file, child = root / "seed=1" / "pid", None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        for _ in range(repeats):
            process.send_signal(signum)
            time.sleep(0.05)
        _, err = process.communicate(timeout=60)
        assert process.returncode == code, err
        assert not alive(child), "a run was left running"
    finally:
        if process.poll() is None:
            process.kill()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)
    assert read_json(str(root / "seed=1"), "run.json")["exit_code"] in (4, 130)
    assert not os.path.exists(root / "seed=2")  # nothing started after the signal


# ----------------------------------------------------------------------------- a preparation cut short


def fills_the_disk(path: pathlib.Path, *args) -> tuple[int, str, int]:
    """A split writer on a disk that fills: part of the file is written, then ENOSPC (as a write reports it)."""
    path.write_bytes(b"\0" * 64)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def interrupted(path: pathlib.Path, *args) -> tuple[int, str, int]:
    """A split writer stopped by Ctrl-C halfway through its file."""
    path.write_bytes(b"\0" * 64)
    raise KeyboardInterrupt


@pytest.mark.parametrize("writer, code, said", [(fills_the_disk, 1, "no space left on"), (interrupted, 130, "")])
def test_a_preparation_cut_short_keeps_the_earlier_data_and_says_so_in_one_line(tmp_path, capsys, monkeypatch,
                                                                                writer, code, said):
    """prepare_data.py --force over a prepared dataset, cut short by a full disk or Ctrl-C: one line saying so, the
    earlier dataset and how to go on (the same command), exit 1 or 130; the earlier data is untouched and the
    partial output is gone."""
    data = tmp_path / "data"
    dataset = pathlib.Path(prepared(data, TEXT_A))
    before = snapshot(dataset)
    corpus = tmp_path / "b.txt"
    corpus.write_text(TEXT_B)
    monkeypatch.setattr(prepare_data, "_write_split", writer)
    with pytest.raises(SystemExit) as exit_:
        prepare_data.main(["corpus", "--tokenizer", "char", "--input", str(corpus), "--data_dir", str(data),
                           "--force"])
    assert exit_.value.code == code
    one_line_error(capsys, said, str(dataset), "same command")
    assert snapshot(dataset) == before
    assert sorted(os.listdir(data)) == ["corpus_char"]  # no partial output, no lock left


def snapshot(folder: pathlib.Path) -> dict:
    """Bytes and modification times of every file in folder, to prove nothing was touched."""
    return {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(folder.iterdir())}


def test_ctrl_c_at_the_terminal_stops_a_parallel_preparation_with_one_line(tmp_path):
    """SIGINT to prepare_data.py's process group (Ctrl-C at its terminal) while its pool of processes tokenizes:
    exit 130 with one line, no traceback from it or its workers, the earlier dataset untouched, nothing left."""
    data = tmp_path / "data"
    dataset = pathlib.Path(prepared(data, TEXT_A))
    before = snapshot(dataset)
    corpus = tmp_path / "books"
    corpus.mkdir()
    for i in range(400):  # about 40 MB of documents: seconds of work for two processes
        (corpus / f"{i:03d}.txt").write_text(f"book {i}: " + TEXT_B * 2300)
    process = subprocess.Popen([sys.executable, "prepare_data.py", "corpus", "--tokenizer", "char", "--input",
                                str(corpus), "--data_dir", str(data), "--force", "--num_proc", "2"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any((p / "train.bin").exists() for p in data.glob("corpus_char.partial-*")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if "%|" not in line and line.strip()]  # tqdm's bars aside
    assert process.returncode == 130 and len(lines) == 1 and "Traceback" not in err, err
    assert snapshot(dataset) == before and sorted(os.listdir(data)) == ["corpus_char"]


def test_the_lr_figure_draws_no_unigram_line_from_data_prepared_again_since(tmp_path, capsys, monkeypatch):
    """The unigram reference is computed from the dataset as it is now: prepared again from other text since the
    sweep, it would not be the sweep's; the figure leaves it out and says so."""
    root = lr_sweep_on(tmp_path, monkeypatch, "pre", "pre", TEXT_A)

    def unigram_notes(fig) -> list[str]:
        return [t.get_text() for ax in fig.axes for t in ax.texts if "unigram" in t.get_text()]

    assert len(unigram_notes(plot.draw_lr_sensitivity([root]))) == 1
    prepared(tmp_path / "data_pre", TEXT_B, force=True)
    capsys.readouterr()
    assert unigram_notes(plot.draw_lr_sensitivity([root])) == []
    out = capsys.readouterr().out
    assert "unigram" in out and "corpus_char" in out, out


def test_a_reference_line_named_twice_is_refused(tmp_path, capsys):
    """plot.py --ref NAME=VALUE twice with one name would draw only the last value."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "iter": 0, "val_loss": 3.0}) + "\n")
    assert plot.main([str(run), "--ref", "target=1.8", "--ref", "target=1.9", "--out", str(tmp_path / "r.png")]) == 2
    one_line_error(capsys, "target")
    assert not os.path.exists(tmp_path / "r.png")

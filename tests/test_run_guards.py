"""What a run guarantees when its world misbehaves: a resume that goes back keeps the abandoned branch's kept
checkpoints aside, a new run deletes only names a run writes (named in the refusal first), a run whose out_dir
was deleted or replaced writes nothing more, a second Ctrl-C never cuts a save in half, a closed stdout does not
stop the training, a number float32 cannot hold is refused before anything runs, a full disk is named with what
was kept, and a checkpoint that reads is never blamed for an error of the device."""

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, tiny_run_args
from test_run_files import main

import train
from nanonorm import guards, resume, run_files
from nanonorm.train_config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(folder) -> dict[str, bytes]:
    """Every file under folder (names relative to it) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def without_lock(files: dict[str, bytes]) -> dict[str, bytes]:
    """A snapshot less the .lock a run creates to claim its folder."""
    return {name: data for name, data in files.items() if name != run_files.LOCK_NAME}


def records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def verified(path) -> dict:
    """The checkpoint at path, read as a resume reads it (its SHA-256 checked)."""
    return run_files.load_checkpoint(str(path), "cpu")


def stray_temporary_files(folder) -> list[str]:
    return [p.name for p in folder.rglob("*.tmp")]


# ----------------------------------------------------------------------------- a resume that goes back


def test_a_resume_that_rewinds_moves_the_abandoned_branchs_kept_checkpoints_aside(data_dir, tmp_path, capsys):
    """keep_every=4, always_save_checkpoint=False: lr 5 from iter 4 to 12 makes the run worse, so ckpt.pt stays at the
    best evaluation (iter 4) while ckpt_8.pt and ckpt_12.pt keep the lr-5 branch. Resumed at lr 1e-3 to 8, the run
    goes on from iter 4: the lr-5 branch's kept checkpoints leave out_dir whole (nothing lost), byte for byte with
    their checksums, and out_dir's kept checkpoints are all of the branch that goes on (nothing mixed)."""
    out = tmp_path / "run"
    settings = dict(always_save_checkpoint=False, lr_schedule="constant", eval_interval=4, keep_every=4)
    assert train.train(tiny_run_args(data_dir, str(out), max_iters=4, **settings)) == 0
    assert train.train(tiny_run_args(data_dir, str(out), max_iters=12, learning_rate=5.0, init_from="resume",
                                     **settings)) == 0
    assert verified(out / "ckpt.pt")["iter_num"] == 4  # lr 5 made it worse
    abandoned = {name: (out / name).read_bytes() for name in ("ckpt_8.pt", "ckpt_8.pt.sha256", "ckpt_12.pt",
                                                               "ckpt_12.pt.sha256")}
    capsys.readouterr()
    assert train.train(tiny_run_args(data_dir, str(out), max_iters=8, init_from="resume", **settings)) == 0
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_4.pt", "ckpt_8.pt"]
    assert verified(out / "ckpt_8.pt")["config"]["learning_rate"] == 1e-3
    aside = out / "dropped_after_iter_4"
    assert snapshot(aside) == abandoned
    assert verified(aside / "ckpt_12.pt")["config"]["learning_rate"] == 5.0
    assert str(aside) in capsys.readouterr().out  # one line says where they went


def test_a_second_rewind_to_the_same_iteration_keeps_each_branch_in_its_own_folder(tmp_path):
    """Two branches abandoned at the same iteration never share a folder (nor replace each other's files)."""
    for branch in ("first", "second"):
        for it in (8, 12):
            run_files.save_checkpoint(str(tmp_path / f"ckpt_{it}.pt"), {"branch": branch, "iter_num": it})
        run_files.move_dropped_checkpoints(str(tmp_path), 4)
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == ["dropped_after_iter_4", "dropped_after_iter_4.2"]
    for folder, branch in zip(folders, ("first", "second"), strict=True):
        assert {torch.load(p, weights_only=True)["branch"] for p in (tmp_path / folder).glob("*.pt")} == {branch}


# ----------------------------------------------------------------------------- a new run deletes only what a run writes


def test_a_new_run_deletes_only_names_a_run_writes_and_names_them_in_the_refusal_first(monkeypatch, capsys, data_dir,
                                                                                       tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    users = {"metrics.jsonl.bak": b"mine", "metrics.jsonl.notes": b"notes", "ckpt_best_manual.pt": b"a copy",
             "ckpt_best_manual.pt.sha256": b"its digest", "ckpt_4.pt.orig": b"another copy"}
    earlier_run = {"metrics.jsonl": b'{"kind": "train", "iter": 1}\n', "metrics.jsonl.dropped": b"{}\n",
                   "ckpt.pt": b"c", "ckpt.pt.sha256": b"d", "ckpt_4.pt": b"e", "ckpt_4.pt.sha256": b"f",
                   "ckpt_last.pt.tmp": b"g", "ckpt.pt.sha256.4242.tmp": b"h",
                   "dropped_after_iter_4/ckpt_8.pt": b"i", "dropped_after_iter_4/ckpt_8.pt.sha256": b"j"}
    for files in ({**users, "metrics.jsonl.dropped": b"{}\n"}, {**users, **earlier_run}):
        shutil.rmtree(out)
        for name, data in files.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
        code, _, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(out), max_iters=0))
        assert code == 2 and without_lock(snapshot(out)) == files, err  # refused, nothing deleted
        named = err.split("(")[1].split(")")[0].split(", ")  # the refusal's list of what --overwrite would delete
        code, printed, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(out), max_iters=0,
                                                                     overwrite=True))
        assert code == 0, err
        deleted = printed.split("deleted the earlier run's ")[1].split(" from ")[0].split(", ")
        assert set(deleted) <= set(named)
        assert {name: data for name, data in snapshot(out).items() if name in users} == users  # left alone
        assert not any(name in snapshot(out) for name in files if name not in users and name != "metrics.jsonl")


def test_overwrite_refuses_a_dropped_folder_that_holds_a_file_a_run_does_not_write(tmp_path):
    (tmp_path / "dropped_after_iter_4").mkdir()
    (tmp_path / "dropped_after_iter_4" / "notes.txt").write_text("mine")
    cfg, _ = train.load_config([f"--out_dir={tmp_path}", "--overwrite=True"])
    with pytest.raises(ConfigError, match=r"dropped_after_iter_4.*notes.txt"):
        resume.starting_point(cfg, "cpu")
    assert (tmp_path / "dropped_after_iter_4" / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- an out_dir deleted or replaced


@pytest.mark.parametrize("replaced", [True, False], ids=["replaced", "deleted"])
def test_a_run_whose_out_dir_is_deleted_or_replaced_stops_and_writes_nothing_there(monkeypatch, capsys, data_dir,
                                                                                 tmp_path, replaced):
    """`rm -rf out && mkdir out` (and a second run locking the new folder) during iteration 2: the first run holds
    the lock of a folder that is gone. It stops at its next write with exit 5 and writes nothing into the new
    folder (nor removes the second run's lock), or, deleted, creates none."""
    out = tmp_path / "run"
    forward_backward, held = train.forward_backward, []

    def replace_at_iter_2(model, task, ddp, accum, it, *args):
        if it == 2 and not held:
            shutil.rmtree(out)
            held.append(None)
            if replaced:  # what a second run holds in the new folder
                out.mkdir()
                held.append(os.open(out / ".lock", os.O_RDWR | os.O_CREAT))
                os.write(held[-1], b"4242\n")
                fcntl.flock(held[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        return forward_backward(model, task, ddp, accum, it, *args)

    monkeypatch.setattr(train, "forward_backward", replace_at_iter_2)
    code, _, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(out), max_iters=8))
    assert code == 5, err
    assert guards.EXIT_OUT_DIR_GONE == 5
    assert err.count("\n") == 1 and str(out) in err
    if replaced:
        assert snapshot(out) == {".lock": b"4242\n"}
        os.close(held[-1])
    else:
        assert not out.exists()


# ----------------------------------------------------------------------------- a second Ctrl-C during a save


def sigint_during_the_write(monkeypatch, count: int) -> None:
    """The checkpoint writer sends this process `count` SIGINTs as it writes its second block (mid-file)."""
    write, calls = run_files._HashingWriter.write, []

    def interrupted(self, data):
        calls.append(None)
        if len(calls) == 2:
            for _ in range(count):
                os.kill(os.getpid(), signal.SIGINT)
        return write(self, data)

    monkeypatch.setattr(run_files._HashingWriter, "write", interrupted)


STOP_SETTINGS = dict(max_iters=10, eval_interval=4, lr_decay_iters=10)


@pytest.mark.parametrize("when", ["during", "after"])
def test_a_second_sigint_at_the_stop_save_lets_it_finish_and_exits_4(monkeypatch, capsys, data_dir, tmp_path, when):
    """SIGINT during iteration 5 stops the run after it with a save of iter 6; a second SIGINT during that save (or
    right after it) does not cut it: the save completes and verifies, no temporary file is left, and the exit code
    says that the iteration was saved (4)."""
    out = tmp_path / "run"
    save_stop_checkpoint = guards.save_stop_checkpoint

    def second_sigint(*args, **kwargs):
        if when == "during":
            sigint_during_the_write(monkeypatch, 1)
        path = save_stop_checkpoint(*args, **kwargs)
        if when == "after":
            os.kill(os.getpid(), signal.SIGINT)
        return path

    monkeypatch.setattr(guards, "save_stop_checkpoint", second_sigint)
    forward_backward = train.forward_backward

    def first_sigint(model, task, ddp, accum, it, *args):
        if it == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return forward_backward(model, task, ddp, accum, it, *args)

    monkeypatch.setattr(train, "forward_backward", first_sigint)
    code, _, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(out), **STOP_SETTINGS))
    assert code == guards.EXIT_STOPPED == 4, err
    assert verified(out / "ckpt.pt")["iter_num"] == 6 and not stray_temporary_files(out)
    assert records(out)[-1] == {"kind": "status", "status": "stopped", "iter": 6, "signal": "SIGINT", "saved": True}


def test_two_sigints_during_an_evaluation_save_let_it_finish_then_stop_at_once(monkeypatch, capsys, data_dir,
                                                                               tmp_path):
    """Ctrl-C twice while iteration 4's checkpoint is written: the save completes (it verifies, no temporary file),
    then the run stops at once (130) instead of going on."""
    out = tmp_path / "run"
    sigint_during_the_write(monkeypatch, 2)
    code, _, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(out), **STOP_SETTINGS))
    assert code == guards.EXIT_INTERRUPTED == 130, err
    assert verified(out / "ckpt.pt")["iter_num"] == 4 and not stray_temporary_files(out)
    assert err.count("\n") == 1


@pytest.mark.parametrize("ignored", [False, True], ids=["terminal_closed", "nohup"])
def test_sighup_stops_with_a_save_unless_the_run_was_started_ignoring_it(monkeypatch, capsys, data_dir, tmp_path,
                                                                         ignored):
    """A closed terminal sends SIGHUP to its process group (a sweep's runs included): the run stops after the
    iteration with a save (exit 4), as on SIGTERM, instead of dying unsaved. Under nohup (SIGHUP ignored from the
    start) it stays ignored and the run trains to its end. (Before the run, a SIGHUP that reaches this test's own
    handler fails the test rather than ending the test process.)"""
    def reached_the_default(signum, frame):
        raise AssertionError("SIGHUP was not handled by the run")

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else reached_the_default)
    try:
        forward_backward = train.forward_backward

        def hangup(model, task, ddp, accum, it, *args):
            if it == 5:
                os.kill(os.getpid(), signal.SIGHUP)
            return forward_backward(model, task, ddp, accum, it, *args)

        monkeypatch.setattr(train, "forward_backward", hangup)
        code, _, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(tmp_path / "run"), **STOP_SETTINGS))
    finally:
        signal.signal(signal.SIGHUP, previous)
    last = records(tmp_path / "run")[-1]
    if ignored:
        assert code == 0 and last["iter"] == STOP_SETTINGS["max_iters"] and last["kind"] == "eval", err
    else:
        assert code == 4 and last == {"kind": "status", "status": "stopped", "iter": 6, "signal": "SIGHUP",
                                      "saved": True}, err
        assert verified(tmp_path / "run" / "ckpt.pt")["iter_num"] == 6


# ----------------------------------------------------------------------------- a closed stdout


def test_a_closed_stdout_stops_the_printing_not_the_run(data_dir, tmp_path):
    """`train.py ... | head` whose reader has gone before the first line (unbuffered, so the first print meets the
    closed pipe mid-run): no traceback, the run trains to its end, saves and logs as usual, and exits 0."""
    out = tmp_path / "run"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "train.py", *tiny_run_args(data_dir, str(out), max_iters=8)],
                                cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    finally:
        os.close(write_end)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert verified(out / "ckpt.pt")["iter_num"] == 8
    assert [r["iter"] for r in records(out) if r["kind"] == "eval"] == [0, 4, 8]


# ----------------------------------------------------------------------------- numbers float32 cannot hold


@pytest.mark.parametrize("setting", [
    "gain_cap=1e39", "qk_clip=1e300", "norm_alpha_init=1e300", "norm_alpha_init=(0.5, 1e39, 0.5)",
    "logit_softcap=1e300", "attn_softcap=1e300", "branch_scale=1e300", "z_loss=1e39", "norm_eps=1e39",
    "norm_eps=1e-50", "learning_rate=1e39", "matrix_lr=1e39", "dual_lr=1e39", "grad_clip=1e39", "weight_decay=1e39",
    "geonorm_clamp=1e-50", "dropout=1e-50"])
def test_a_number_float32_cannot_hold_is_refused_naming_the_key_and_the_limit(setting):
    """float32's largest number is about 3.4e38 and its smallest normal one about 1.2e-38 (torch.finfo); a key that
    reaches the model or the update as a float32 number is refused outside that range (0 stays allowed)."""
    key = setting.split("=")[0]
    with pytest.raises(ConfigError, match=rf"'{key}'.*float32.*3\.4e\+38"):
        train.load_config([f"--{setting}", "--norm=dyt"])


def test_a_dist_timeout_past_what_a_timedelta_holds_is_refused():
    with pytest.raises(ConfigError, match="dist_timeout"):
        train.load_config(["--dist_timeout=1e20"])


@pytest.mark.parametrize("setting", [dict(learning_rate=3e38, min_lr=0.0),
                                     dict(optimizer="muon", matrix_lr=3e38)], ids=["adamw", "muon"])
def test_an_update_that_overflows_float32_ends_the_run_as_diverged(data_dir, tmp_path, setting):
    """A rate float32 holds whose step size does not (lr / (1 - beta1^t), lr times Muon's scale): the update is
    infinite, a divergence caused by the rate (exit 3 with its status, as a sweep counts it), not a traceback."""
    out = tmp_path / "run"
    assert train.train(tiny_run_args(data_dir, str(out), max_iters=4, **setting)) == guards.EXIT_DIVERGED
    assert records(out)[-1]["status"] == "diverged"


# ----------------------------------------------------------------------------- a full disk


def disk_full_from_iteration_6(monkeypatch, target: str) -> None:
    """From iteration 6 on, writing the checkpoint (its bytes) or metrics.jsonl fails as on a full disk."""
    forward_backward, full = train.forward_backward, []

    def filling(model, task, ddp, accum, it, *args):
        if it == 6:
            full.append(None)
        return forward_backward(model, task, ddp, accum, it, *args)

    monkeypatch.setattr(train, "forward_backward", filling)
    no_space = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if target == "checkpoint":
        write = run_files._HashingWriter.write

        def full_disk_write(self, data):
            if full:
                raise no_space
            return write(self, data)

        monkeypatch.setattr(run_files._HashingWriter, "write", full_disk_write)
        return

    class FullFile:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            raise no_space

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_disk_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)  # noqa: SIM115 (the caller's `with` closes it)
        return FullFile(f) if full and str(path).endswith("metrics.jsonl") and "a" in mode else f

    monkeypatch.setattr(run_files, "open", full_disk_open, raising=False)


@pytest.mark.parametrize("target", ["checkpoint", "metrics"])
def test_a_full_disk_says_so_in_one_line_keeps_the_last_checkpoint_and_resumes(monkeypatch, capsys, data_dir,
                                                                               tmp_path, target):
    """The disk fills after iteration 4's save: the run stops with EXIT_NO_SPACE and one line naming the place, the
    checkpoint kept and --init_from=resume; the kept checkpoint verifies, no temporary file is left, and once there
    is space again the resume it names finishes the run."""
    out = tmp_path / "run"
    disk_full_from_iteration_6(monkeypatch, target)
    settings = dict(max_iters=8, eval_interval=4, keep_every=0)
    code, _, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(out), **settings))
    assert code == 6, err
    assert guards.EXIT_NO_SPACE == 6
    assert err.count("\n") == 1 and "no space left on" in err and str(out) in err, err
    assert str(out / "ckpt.pt") in err and "--init_from=resume" in err
    assert verified(out / "ckpt.pt")["iter_num"] == 4 and not stray_temporary_files(out)
    monkeypatch.undo()
    assert train.train(tiny_run_args(data_dir, str(out), **settings, init_from="resume")) == 0


# ----------------------------------------------------------------------------- errors that are not the file's


def test_a_run_on_cpu_0_resumes_and_samples(data_dir, tmp_path):
    """--device=cpu:0 is the CPU: its checkpoints resume and sample (they are not 'truncated')."""
    import sample

    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=4, device="cpu:0")) == 0
    assert train.train(tiny_run_args(data_dir, out, max_iters=8, device="cpu:0", init_from="resume")) == 0
    assert sample.main(["--out_dir", out, "--device=cpu:0", "--max_new_tokens=4"]) == 0


def test_a_checkpoint_that_reads_on_the_cpu_is_not_blamed_for_a_device_error(tmp_path, monkeypatch):
    """Loading onto a device fails (out of its memory, say) while the file matches its checksum and reads on the CPU:
    the message names the device, not a damaged file."""
    path = str(tmp_path / "ckpt.pt")
    run_files.save_checkpoint(path, {"format": run_files.CHECKPOINT_FORMAT, "iter_num": 4})
    load = torch.load

    def device_out_of_memory(f, map_location=None, **kwargs):
        if torch.device(map_location).type != "cpu":
            raise RuntimeError("CUDA error: out of memory")
        return load(f, map_location=map_location, **kwargs)

    monkeypatch.setattr(torch, "load", device_out_of_memory)
    with pytest.raises(ConfigError) as error:
        run_files.load_checkpoint(path, "cuda")
    message = str(error.value)
    assert "cuda" in message and "truncated" not in message and "not a nanoNorm checkpoint" not in message

"""An out_dir holds one run: a lock keeps a second run out, --overwrite removes the first run's files before
the new one starts, every checkpoint is verified against its SHA-256, eval_only leaves the history alone,
and metrics.jsonl is strict JSON with no checkpoint ever written from a state that cannot be evaluated."""

import errno
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, tiny_run_args

import train
from nanonorm import guards, resume, run_files

pytestmark = pytest.mark.usefixtures("one_thread")


def main(monkeypatch, capsys, argv: list[str]) -> tuple[int, str, str]:
    """train.py's main in-process: exit code, stdout and stderr."""
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def strict_records(path) -> list[dict]:
    """metrics.jsonl read as strict JSON: a bare NaN or Infinity fails."""
    def refuse(name: str):
        raise AssertionError(f"non-standard JSON constant {name} in {path}")

    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


@pytest.fixture(scope="module")
def trained_once(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    assert train.train(tiny_run_args(data_dir, str(out), max_iters=4, keep_every=4)) == 0
    return out


@pytest.fixture
def finished_run(trained_once, tmp_path):
    """A copy of a finished 4-iteration run (ckpt.pt and ckpt_4.pt), for a test to change."""
    return shutil.copytree(trained_once, tmp_path / "run")


# ----------------------------------------------------------------------------- the lock


def test_a_second_run_into_a_busy_out_dir_exits_2_naming_the_holder(monkeypatch, capsys, data_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "w") as held:  # what a running train.py holds
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, _, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(out), max_iters=2))
    assert code == 2, err
    assert err == (f"error: out_dir '{out}' is in use by another run (process 4242 holds {out}/.lock); wait for it "
                   "to end, stop it, or choose another --out_dir\n")
    assert sorted(os.listdir(out)) == [".lock"]  # nothing written


def test_a_read_only_out_dir_with_a_writable_old_lock_exits_2(finished_run, monkeypatch):
    """Stands in for chmod a-w out_dir (which root ignores): the earlier run's .lock opens, nothing new is created."""
    open_file = os.open

    def read_only(path, flags, *args):
        if os.path.dirname(path) == str(finished_run) and os.path.basename(path) != ".lock" and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return open_file(path, flags, *args)

    before = snapshot(finished_run)
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(train.ConfigError, match=r"cannot write to out_dir .* \(Permission denied\); choose a "
                                                "writable --out_dir"):
        run_files.OutDirLock(str(finished_run))
    monkeypatch.undo()
    assert snapshot(finished_run) == before


# ----------------------------------------------------------------------------- overwrite


@pytest.mark.parametrize("name, decoy", [("run[1]", "run1"), ("a*", "ab"), ("b?", "bc")])
def test_an_out_dir_with_glob_characters_is_a_name_not_a_pattern(tmp_path, name, decoy):
    for folder, files in ((name, ("ckpt.pt", "metrics.jsonl")), (decoy, ("ckpt_4.pt",))):
        (tmp_path / folder).mkdir()
        for file in files:
            (tmp_path / folder / file).write_text("x")
    out = str(tmp_path / name)
    assert run_files.previous_run_files(out) == ["ckpt.pt", "metrics.jsonl"]
    cfg, _ = train.load_config([f"--out_dir={out}"])
    with pytest.raises(train.ConfigError, match=r"an earlier run already exists .*\(ckpt.pt, metrics.jsonl\)"):
        resume.starting_point(cfg, "cpu")
    assert run_files.remove_previous_run(out) == ["ckpt.pt", "metrics.jsonl"]
    assert os.listdir(out) == [] and os.listdir(tmp_path / decoy) == ["ckpt_4.pt"]


def test_metrics_of_a_run_without_checkpoint_need_overwrite(tmp_path):
    """A run that diverged before its first save leaves only metrics.jsonl: still a run, not to be deleted silently."""
    (tmp_path / "metrics.jsonl").write_text('{"kind": "status", "status": "diverged", "iter": 2}\n')
    cfg, _ = train.load_config([f"--out_dir={tmp_path}"])
    with pytest.raises(train.ConfigError, match=r"an earlier run already exists in .* \(metrics.jsonl\); continue it "
                                                r"with --init_from=resume, choose another --out_dir, or pass"):
        resume.starting_point(cfg, "cpu")
    cfg, _ = train.load_config([f"--out_dir={tmp_path}", "--overwrite=True"])
    assert resume.starting_point(cfg, "cpu") is None


def test_overwrite_removes_the_earlier_run_before_the_new_one_starts(data_dir, finished_run, monkeypatch):
    """A new run that dies before its first save leaves no checkpoint of the earlier run to resume."""
    out = str(finished_run)
    forward_backward = train.forward_backward

    def crash_at_iter_2(model, task, ddp, accum, it, *args):
        if it == 2:
            raise RuntimeError("killed")
        return forward_backward(model, task, ddp, accum, it, *args)

    monkeypatch.setattr(train, "forward_backward", crash_at_iter_2)
    with pytest.raises(RuntimeError, match="killed"):
        train.train(tiny_run_args(data_dir, out, max_iters=8, eval_interval=8, overwrite=True, learning_rate=2e-3,
                                  lr_schedule="constant"))
    assert sorted(os.listdir(out)) == [".lock", "metrics.jsonl"]
    assert {r["lr"] for r in strict_records(os.path.join(out, "metrics.jsonl")) if r["kind"] == "train"} == {2e-3}
    with pytest.raises(train.ConfigError, match="there is no checkpoint at"):
        train.train(tiny_run_args(data_dir, out, max_iters=8, init_from="resume"))


# ----------------------------------------------------------------------------- checksums


def test_checksum_file_is_sha256sum_format(finished_run):
    digest = hashlib.sha256((finished_run / "ckpt.pt").read_bytes()).hexdigest()
    assert (finished_run / "ckpt.pt.sha256").read_text() == f"{digest}  ckpt.pt\n"


def test_flipped_bytes_in_a_checkpoint_exit_2_naming_the_file(monkeypatch, capsys, data_dir, finished_run):
    """64 bytes in the middle of the file (tensor data: torch.load itself would not notice)."""
    path = finished_run / "ckpt.pt"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))
    before = snapshot(finished_run)
    code, _, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(finished_run), max_iters=8,
                                                           init_from="resume"))
    assert code == 2 and f"checkpoint {path} does not match its checksum" in err and "Nothing was changed" in err
    assert snapshot(finished_run) == before


def test_a_checkpoint_without_checksum_is_refused_with_the_command_that_records_one(data_dir, finished_run):
    os.remove(finished_run / "ckpt.pt.sha256")
    with pytest.raises(train.ConfigError, match=f"has no checksum file .*cd {finished_run} && sha256sum ckpt.pt > "
                                                "ckpt.pt.sha256"):
        train.train(tiny_run_args(data_dir, str(finished_run), max_iters=8, init_from="resume"))


def saved_checkpoint(tmp_path) -> str:
    path = str(tmp_path / "ckpt.pt")
    run_files.save_checkpoint(path, {"format": run_files.CHECKPOINT_FORMAT, "iter_num": 4})
    return path


def test_an_empty_or_unreadable_checksum_file_is_refused_naming_it(tmp_path):
    path = saved_checkpoint(tmp_path)
    with open(f"{path}.sha256", "w"):
        pass
    with pytest.raises(train.ConfigError, match=r"has an empty checksum file .*ckpt.pt.sha256, so its integrity"):
        run_files.load_checkpoint(path, "cpu")
    os.remove(f"{path}.sha256")
    os.mkdir(f"{path}.sha256")
    with pytest.raises(train.ConfigError, match=r"cannot read the checksum file .*ckpt.pt.sha256 \(Is a directory\)"):
        run_files.load_checkpoint(path, "cpu")


def test_an_unreadable_stop_save_points_back_to_the_best_checkpoint(tmp_path):
    """Resume takes ckpt_last.pt while it exists; if it cannot be read, the message says how to go back to
    ckpt.pt (the best evaluation's), which is still there."""
    (tmp_path / "ckpt_last.pt").write_bytes(b"junk")
    cfg, _ = train.load_config([f"--out_dir={tmp_path}", "--init_from=resume"])
    with pytest.raises(train.ConfigError, match=r"or delete .*ckpt_last.pt and its .sha256 to resume from ckpt.pt"):
        resume.starting_point(cfg, "cpu")


def test_overwrite_refuses_a_folder_named_like_a_run_file_before_the_setup(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    cfg, _ = train.load_config([f"--out_dir={tmp_path}", "--overwrite=True"])
    with pytest.raises(train.ConfigError, match=r"metrics.jsonl in .* is a folder, not a run's file"):
        resume.starting_point(cfg, "cpu")


def test_resume_drops_metrics_lines_that_are_not_records_of_an_iteration(tmp_path):
    """The policy for a line cut short by a kill, for any line that is not a JSON object with an integer iter."""
    kept = [b'{"kind": "train", "iter": 3, "loss": 2.0}\n', b'{"kind": "train", "iter": 4, "loss": 1.9}\n']
    bad = [b'\xff\xfe{"iter": 1}\n', b"[1, 2]\n", b'{"kind": "train", "iter": "5"}\n', b'{"iter": true}\n']
    (tmp_path / "metrics.jsonl").write_bytes(b"".join([kept[0], *bad, kept[1], b'{"kind": "eval", "iter": 4}\n']))
    run_files.MetricsLog(str(tmp_path), True, resume_iter=4)
    assert (tmp_path / "metrics.jsonl").read_bytes() == b"".join(kept)
    os.remove(tmp_path / "metrics.jsonl")
    os.mkdir(tmp_path / "metrics.jsonl")
    with pytest.raises(train.ConfigError, match=r"cannot rewrite .*metrics.jsonl for the resumed run \(Is a dir"):
        run_files.MetricsLog(str(tmp_path), True, resume_iter=4)


@pytest.mark.parametrize("kill_at", ["rename", "final checksum"])
def test_a_kill_between_checkpoint_and_checksum_leaves_a_verifiable_pair(tmp_path, monkeypatch, kill_at):
    """The new digest is listed before the rename and the old one dropped after it: a kill at either step
    leaves ckpt.pt (old or new) with a matching checksum."""
    path = str(tmp_path / "ckpt.pt")
    old, new = ({"format": run_files.CHECKPOINT_FORMAT, "iter_num": i} for i in (4, 8))
    run_files.save_checkpoint(path, old)
    replace, write_checksums = os.replace, run_files._write_checksums
    calls = []

    def killed(*args):
        raise KeyboardInterrupt  # stands in for SIGKILL: nothing after this point runs

    def replace_unless_checkpoint(src, dst):
        return killed() if dst == path else replace(src, dst)

    def second_checksum_write_killed(*args):
        calls.append(args)
        return killed() if len(calls) == 2 else write_checksums(*args)

    if kill_at == "rename":
        monkeypatch.setattr(os, "replace", replace_unless_checkpoint)
    else:
        monkeypatch.setattr(run_files, "_write_checksums", second_checksum_write_killed)
    with pytest.raises(KeyboardInterrupt):
        run_files.save_checkpoint(path, new)
    monkeypatch.undo()
    expected = 4 if kill_at == "rename" else 8
    assert run_files.load_checkpoint(path, "cpu")["iter_num"] == expected
    assert len(run_files.recorded_checksums(path)) == 2  # both digests, until the next save
    run_files.save_checkpoint(path, old)
    assert len(run_files.recorded_checksums(path)) == 1


# ----------------------------------------------------------------------------- eval_only


def test_eval_only_evaluates_the_checkpoint_and_leaves_the_history_alone(monkeypatch, capsys, data_dir, finished_run):
    before = snapshot(finished_run)
    code, out, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(finished_run), init_from="eval"))
    assert code == 0, err
    last_eval = [r for r in strict_records(finished_run / "metrics.jsonl") if r["kind"] == "eval"][-1]
    # the same weights and eval windows as the run's final evaluation: the same losses
    assert f"iter 4: train_loss {last_eval['train_loss']:.4f}, val_loss {last_eval['val_loss']:.4f}" in out
    assert snapshot(finished_run) == before


def test_eval_only_without_a_checkpoint_exits_2_and_creates_nothing(monkeypatch, capsys, data_dir, tmp_path):
    code, _, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(tmp_path / "run"), init_from="eval"))
    assert code == 2 and "init_from='eval' evaluates out_dir's checkpoint, but there is no checkpoint at" in err
    assert not os.path.exists(tmp_path / "run")  # a mistyped out_dir is not created


# ----------------------------------------------------------------------------- skip_nonfinite


@pytest.fixture(scope="module")
def norm_free_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("norm_free") / "run"
    assert train.train(tiny_run_args(data_dir, str(out), norm_scheme="none", max_iters=8, eval_interval=4)) == 0
    return out


@pytest.mark.parametrize("max_iters, reason", [(16, "non-finite eval loss at the end of the run"),
                                               (20, "all 4 steps since the last evaluation skipped")])
def test_a_run_that_can_only_skip_ends_diverged_and_keeps_its_checkpoint(data_dir, norm_free_run, tmp_path,
                                                                        max_iters, reason):
    """A learning rate of 1e20 on a norm-free model: the step of iter 8 leaves finite weights whose every loss
    is NaN, so every later batch is skipped. The eval at 12 follows one real step and saves nothing; the run
    ends as diverged at the last eval (16), or at 16 because 12-15 were all skipped, and keeps ckpt.pt."""
    out = tmp_path / "run"
    shutil.copytree(norm_free_run, out)
    before = (out / "ckpt.pt").read_bytes()
    code = train.train(tiny_run_args(data_dir, str(out), norm_scheme="none", max_iters=max_iters, eval_interval=4,
                                     init_from="resume", learning_rate=1e20, lr_schedule="constant", skip_nonfinite=100,
                                     grad_clip=0))
    assert code == guards.EXIT_DIVERGED
    assert (out / "ckpt.pt").read_bytes() == before
    records = strict_records(out / "metrics.jsonl")
    assert records[-1]["kind"] == "status" and records[-1]["iter"] == 16 and reason in records[-1]["reason"]
    assert [r["val_loss"] for r in records if r["kind"] == "eval"][-1] is None  # NaN written as null
    assert torch.isfinite(run_files.load_checkpoint(str(out / "ckpt.pt"), "cpu")["model"]["wte.weight"]).all()


def test_strict_json_writes_null_for_non_finite_numbers():
    record = {"loss": float("nan"), "rms": [1.0, float("inf")], "grad": {"w": -float("inf")}, "iter": 3}
    assert run_files.strict_json(record) == {"loss": None, "rms": [1.0, None], "grad": {"w": None}, "iter": 3}


def test_a_late_refusal_leaves_no_folder_it_created(monkeypatch, capsys, data_dir, tmp_path):
    """A refusal after out_dir was claimed (a batch found too big for memory) removes the
    folder the run created, which holds only its .lock; a folder that was there before stays."""
    for existed in (False, True):
        out = tmp_path / f"run{existed}"
        if existed:
            out.mkdir()
        code, _, err = main(monkeypatch, capsys, tiny_run_args(data_dir, str(out), batch_size=10**12))
        assert code == 2 and "batch_size=1000000000000 needs at least" in err, err
        assert out.exists() == existed and (not existed or os.listdir(out) == [".lock"])


# ----------------------------------------------------------------------------- wandb, optional


def wandb_records(path: str) -> list:
    """The records of a wandb run file (run-<id>.wandb: a 7-byte header, then LevelDB's log format, blocks of
    32 KiB, each record's chunks behind a 7-byte header of checksum, length and type), as wandb's protobufs."""
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    block, pos, chunks, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def test_wandb_logs_every_line_the_config_and_the_commit_offline(data_dir, tmp_path):
    """train.py with --wandb_project in offline mode (no network): every train and eval line of metrics.jsonl is
    in the wandb run's history with the same values, the config holds the run's settings and its commit, and the
    group is the one given."""
    pytest.importorskip("wandb")
    out = str(tmp_path / "run")
    args = tiny_run_args(data_dir, out, max_iters=4, eval_interval=2, wandb_project="nanonorm-test",
                         wandb_group="sweep-a")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [r for r in map(json.loads, f) if r["kind"] in ("train", "eval")]
    files = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, os.listdir(out)
    records = wandb_records(files[0])
    history = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    logged = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history]
    assert logged == lines  # the same dicts, in order (JSON floats: exact)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in run.config.update}
    assert run.project == "nanonorm-test" and run.run_group == "sweep-a"
    assert config["n_layer"] == 2 and config["max_iters"] == 4 and config["commit"] == run_files.code_version()


def test_wandb_without_the_package_exits_2_saying_how_to_install_it(monkeypatch, capsys, tmp_path):
    """wandb is optional: asked for without it installed, the run stops before anything runs."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    code, _, err = main(monkeypatch, capsys, [f"--out_dir={tmp_path / 'run'}", "--wandb_project=p"])
    assert code == 2 and "pip install wandb" in err and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "run")

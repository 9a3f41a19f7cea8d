"""Crashes, bad checkpoints and divergence: a killed run resumes bitwise, a failed save or an
unreadable file changes nothing, a diverging run stops with exit code 3 on every rank."""

import contextlib
import datetime
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, tiny_run_args

import optim
import train
from nanonorm import diagnostics, guards, lm_task, run_files

pytestmark = pytest.mark.usefixtures("one_thread")


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(out_dir: str) -> dict[tuple[str, int], float]:
    """Every logged loss of a run, keyed by (name, iter)."""
    return {(k, r["iter"]): v for r in read_metrics(out_dir) if r["kind"] != "status"
            for k, v in r.items() if k.endswith("loss")}


def load(out_dir: str, name: str = "ckpt.pt") -> dict:
    return torch.load(os.path.join(out_dir, name), weights_only=True)


def assert_same_tensors(a, b) -> None:
    """Nested dicts/lists of tensors and numbers are bitwise equal."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_tensors(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tensors(x, y)
    elif torch.is_tensor(a):
        assert torch.equal(a, b)
    else:
        assert a == b


# ----------------------------------------------------------------------------- exact resume in-process


# every column taken from other codebases at once (tests/test_columns.py); QK-Clip's tau is low enough to clip heads
# in most steps of these tiny runs (their largest logits are 0.03 to 0.07), so its rescale and its record over ranks
# and micro-batches are exercised
COLUMNS = dict(z_loss=1e-4, logit_softcap=30.0, attn_softcap=50.0, qk_clip=0.05, value_residual=True, x0_mix=True,
               residual_streams=2, hyper_connections="mhc")


# plain float32 AdamW is left out: test_train.py's test_resume_continues_exactly and test_killed_run_resumes_exactly's
# AdamW cases check it (dropout 0.1, bitwise); the columns run with Muon (with QK-Clip: Kimi K2's MuonClip)
@pytest.mark.parametrize("optimizer, extra", [(name, {}) for name in optim.OPTIMIZERS if name != "adamw"]
                         + [("adamw", {"dtype": "float16", "max_iters": 6}), ("muon", COLUMNS)],
                         ids=[*(name for name in optim.OPTIMIZERS if name != "adamw"), "adamw-float16", "muon-columns"])
def test_resume_is_bitwise_for_every_optimizer(data_dir, tmp_path, optimizer, extra):
    """4 + 4 iterations (3 + 3 in float16, slow on a CPU) equal 8 straight; dropout 0.1 checks the RNG
    streams, float16 the GradScaler's growth tracker. Exact: the same float ops in the same order."""
    total = extra.get("max_iters", 8)
    args = dict(optimizer=optimizer, dropout=0.1, eval_interval=total // 2, **{**extra, "max_iters": total})
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    assert train.train(tiny_run_args(data_dir, full, **args)) == 0
    assert train.train(tiny_run_args(data_dir, part, **{**args, "max_iters": total // 2})) == 0
    assert train.train(tiny_run_args(data_dir, part, **args, init_from="resume")) == 0
    assert losses(part) == losses(full)
    a, b = load(full), load(part)
    for key in ("model", "optimizer", "scaler", "iter_num"):
        assert_same_tensors(a[key], b[key])


def test_resume_takes_the_new_learning_rate(data_dir, tmp_path):
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=4, lr_schedule="constant")) == 0
    assert train.train(tiny_run_args(data_dir, out, max_iters=6, lr_schedule="constant", learning_rate=2e-4,
                                     init_from="resume")) == 0
    lrs = {r["iter"]: r["lr"] for r in read_metrics(out) if r["kind"] == "train"}
    assert lrs[4] == 1e-3 and lrs[5] == lrs[6] == 2e-4


# ----------------------------------------------------------------------------- kill and resume


def launch(nproc: int, args: list[str], log_path: str) -> subprocess.Popen:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, *launcher, "train.py", *args], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                start_new_session=True)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def descendants(pid: int) -> list[int]:
    """Child processes, recursively (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_everything(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker at once, like a machine losing power."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def wait_for_train_iter(out_dir: str, proc: subprocess.Popen, log_path: str, iteration: int) -> None:
    path, deadline = os.path.join(out_dir, "metrics.jsonl"), time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, read(log_path)
        if os.path.exists(path):
            with open(path) as f:
                if any(f'"kind": "train", "iter": {iteration},' in line for line in f):
                    return
        time.sleep(0.02)
    raise AssertionError(f"no train line for iter {iteration} in time:\n{read(log_path)}")


def finish(procs: list[tuple[subprocess.Popen, str]]) -> None:
    for proc, log_path in procs:
        assert proc.wait(timeout=300) == 0, read(log_path)


def test_two_ranks_stop_together_on_an_input_error_only_rank_0_sees(straight_run, data_dir, tmp_path):
    """A resume whose metrics.jsonl is gone, which only rank 0 reads: both ranks stop with its message and
    exit 2, none with a traceback or waiting in a collective for a rank that has gone."""
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    os.remove(os.path.join(out, "metrics.jsonl"))
    args = tiny_run_args(data_dir, out, **{**STOP_SETTINGS, "max_iters": 12}, init_from="resume", dist_timeout=60,
                         gradient_accumulation_steps=2)
    proc = launch(2, args, f"{out}.resumed.log")
    assert proc.wait(timeout=120) != 0
    log = read(f"{out}.resumed.log")
    assert not re.search(r'File "[^"]*(train|run_files)\.py", line', log), log  # torchrun's own traceback only
    assert log.count("metrics.jsonl is missing") == 1, log
    assert "error: rank 0 could not continue metrics.jsonl (see its message)" in log, log
    # torchrun's summary of each worker: the one that stops first exits 2, and torchrun may end the other
    # with SIGTERM before it has (-15)
    assert "exitcode  : 2" in log and set(re.findall(r"exitcode  : (-?\d+)", log)) <= {"2", "-15"}, log
    assert "FutureWarning" not in log, log


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
@pytest.mark.parametrize("optimizer, nproc, delay, stop, columns", [
    # slow: a SIGKILLed single process resuming bitwise is the Manifold Muon case below, plain float32 AdamW
    # resuming bitwise (dropout 0.1) is test_train.py's test_resume_continues_exactly in-process and the
    # two-rank AdamW case below (SIGTERM, then the same bitwise comparison of every loss and the final state)
    pytest.param("adamw", 1, 0.0, "SIGKILL", {}, marks=pytest.mark.slow),
    ("manifold_muon", 1, 0.15, "SIGKILL", {}),
    # the two-rank AdamW run with every column from other codebases on (QK-Clip's maxima taken over the ranks); the
    # same run without them is slow: the guarantees it checks do not depend on the model (half a minute each)
    ("adamw", 2, 0.0, "SIGTERM", COLUMNS), pytest.param("adamw", 2, 0.0, "SIGTERM", {}, marks=pytest.mark.slow),
    # slow (half a minute on 2 cores): its parts are covered by the single-process Manifold Muon kill above,
    # the two-rank resume above and tests/test_optim.py's sharded Manifold Muon against one process
    pytest.param("manifold_muon", 2, 0.15, "SIGKILL", {}, marks=pytest.mark.slow)],
    ids=["adamw-1-0.0-SIGKILL", "manifold_muon-1-0.15-SIGKILL", "adamw-2-0.0-SIGTERM-columns", "adamw-2-0.0-SIGTERM",
         "manifold_muon-2-0.15-SIGKILL"])
def test_killed_run_resumes_exactly(data_dir, tmp_path, optimizer, nproc, delay, stop, columns):
    """SIGKILL a run somewhere after its first checkpoint (iter 4; where exactly depends on timing),
    resume it, and compare with an uninterrupted run to 6 iterations past the checkpoint: every loss
    and the final state are bitwise equal on the CPU, whatever iteration the kill landed on.
    SIGTERM to torchrun reaches both ranks, perhaps at different iterations: they agree at the next
    check (log_interval=1: the next iteration), rank 0 saves that iteration, and both exit cleanly.
    Two processes: resuming the killed run on one process (same global batch) agrees to 1e-5."""
    killed, straight, one = (str(tmp_path / name) for name in ("killed", "straight", "one"))
    # RoPE's tables are buffers, and with one eval batch rank 1 of two evaluates none: a buffer sync in rank
    # 0's eval forward would never be matched (a hang until dist_timeout)
    settings = dict(optimizer=optimizer, dropout=0.1, gradient_accumulation_steps=2, lr_decay_iters=40,
                    eval_interval=4, pos="rope", eval_iters=1, **columns)
    proc = launch(nproc, tiny_run_args(data_dir, killed, max_iters=10**6, **settings), f"{killed}.log")
    try:
        wait_for_train_iter(killed, proc, f"{killed}.log", 5)
        time.sleep(delay)  # vary where the kill lands: mid-step, mid-eval or mid-save
        if stop == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    finally:
        kill_everything(proc)
    resume_iter = load(killed)["iter_num"]
    if stop == "SIGTERM":  # the last completed iteration, not the last eval's
        assert read_metrics(killed)[-1] == {"kind": "status", "status": "stopped", "iter": resume_iter,
                                            "signal": "SIGTERM", "saved": True}
        log = read(f"{killed}.log")
        assert log.count("SIGTERM: stopped after iter") == 1 and "[rank" not in log, log  # no rank's traceback
    else:
        assert resume_iter >= 4 and resume_iter % 4 == 0
    end = resume_iter + 6
    if nproc > 1:
        shutil.copytree(killed, one)
    runs = [(launch(nproc, tiny_run_args(data_dir, straight, max_iters=end, **settings), f"{straight}.log"),
             f"{straight}.log"),
            (launch(nproc, tiny_run_args(data_dir, killed, max_iters=end, init_from="resume", **settings),
                    f"{killed}.resumed.log"), f"{killed}.resumed.log")]
    if nproc > 1:  # in this process while the two launches run (one thread: the one_thread fixture)
        assert train.train(tiny_run_args(data_dir, one, max_iters=end, init_from="resume", **settings)) == 0
    finish(runs)
    expected = losses(straight)
    assert ("loss", end) in expected and losses(killed) == expected
    a, b = load(straight), load(killed)
    for key in ("model", "optimizer"):
        assert_same_tensors(a[key], b[key])
    # rank 0 logs the speed, its MFU against the peak it measured times the ranks (the others measure none)
    mfus = [r["mfu"] for r in read_metrics(straight) if r["kind"] == "train" and "mfu" in r]
    assert mfus and all(0 < m < 1 for m in mfus)
    if nproc > 1:  # same batches and dropout masks; only float summation order differs
        after = {k: v for k, v in losses(one).items() if k[1] > resume_iter}
        assert after.keys() == {k for k in expected if k[1] > resume_iter}
        assert after == pytest.approx({k: expected[k] for k in after}, rel=1e-5)


# ----------------------------------------------------------------------------- checkpoints on disk


def test_failed_save_keeps_the_previous_checkpoint(data_dir, tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=4)) == 0
    before = (tmp_path / "run" / "ckpt.pt").read_bytes()

    def save_half_then_fail(obj, f, *args, **kwargs):
        f.write(before[: len(before) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        train.train(tiny_run_args(data_dir, out, max_iters=8, init_from="resume"))
    monkeypatch.undo()
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == before
    assert sorted(os.listdir(out)) == [".lock", "ckpt.pt", "ckpt.pt.sha256", "metrics.jsonl"]  # no stray temp file
    assert run_files.load_checkpoint(os.path.join(out, "ckpt.pt"), "cpu")["iter_num"] == 4


def test_keep_every_keeps_numbered_checkpoints(data_dir, tmp_path, monkeypatch):
    """ckpt_8.pt is written before ckpt.pt: a kill between the two saves keeps it, and resume completes the run."""
    out = str(tmp_path / "run")
    replace, renames = os.replace, []

    def killed_at_the_second_ckpt_pt(src, dst):
        renames.append(dst)
        if renames.count(os.path.join(out, "ckpt.pt")) == 2:
            raise KeyboardInterrupt  # stands in for SIGKILL: nothing after this point runs
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_the_second_ckpt_pt)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny_run_args(data_dir, out, max_iters=12, eval_interval=4, keep_every=8))
    monkeypatch.undo()
    assert load(out, "ckpt_8.pt")["iter_num"] == 8 and load(out)["iter_num"] == 4
    assert train.train(tiny_run_args(data_dir, out, max_iters=12, eval_interval=4, keep_every=8,
                                     init_from="resume")) == 0
    assert sorted(f for f in os.listdir(out) if f.endswith(".pt")) == ["ckpt.pt", "ckpt_8.pt"]
    assert load(out, "ckpt_8.pt")["iter_num"] == 8 and load(out)["iter_num"] == 12


def record_checksum(path) -> None:
    """What `sha256sum ckpt.pt > ckpt.pt.sha256` writes."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")


def write_truncated(path, good: bytes) -> None:
    path.write_bytes(good[: len(good) // 3])


def write_text(path, good: bytes) -> None:
    path.write_text("iter 4: loss 3.2\n")


def write_foreign_pickle(path, good: bytes) -> None:
    path.write_bytes(pickle.dumps(ValueError("not a checkpoint"), protocol=2))


def write_tensor(path, good: bytes) -> None:
    torch.save(torch.zeros(3), path)


def write_unmarked_dict(path, good: bytes) -> None:
    torch.save({"model": {}, "iter_num": 4}, path)


def write_without_config(path, good: bytes) -> None:
    """A marked checkpoint that lacks a field the resumed run reads (another version's, or one made by hand)."""
    state = torch.load(io.BytesIO(good), weights_only=True)
    del state["config"]
    torch.save(state, path)


# What the run guarantees for a file it cannot read: it names the file, says nothing was changed, and changes
# nothing. torch's own reason (in the parentheses) differs between releases, so it is not asserted.
UNREADABLE = r"checkpoint \S*ckpt\.pt cannot be read \(.*\); it may be truncated, or not a nanoNorm checkpoint. " \
             "Nothing was changed"


@pytest.mark.parametrize("write, message", [
    (write_truncated, UNREADABLE),
    (write_text, UNREADABLE),
    (write_foreign_pickle, UNREADABLE),
    (write_tensor, "is not a nanoNorm checkpoint .*nothing was changed"),
    (write_unmarked_dict, "is not a nanoNorm checkpoint .*nothing was changed"),
    (write_without_config, r"does not fit this version of nanoNorm \(KeyError: 'config missing or of another type'\)"),
])
def test_unreadable_checkpoint_is_refused_and_left_alone(data_dir, tmp_path, write, message):
    """Each bad file with a matching checksum, so that reading it is what refuses it."""
    out = tmp_path / "run"
    assert train.train(tiny_run_args(data_dir, str(out), max_iters=4)) == 0
    write(out / "ckpt.pt", (out / "ckpt.pt").read_bytes())
    record_checksum(out / "ckpt.pt")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(train.ConfigError, match=message):
        train.train(tiny_run_args(data_dir, str(out), max_iters=8, init_from="resume"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# ----------------------------------------------------------------------------- divergence


def status(out_dir: str) -> dict:
    last = read_metrics(out_dir)[-1]
    assert last["kind"] == "status" and last["status"] == "diverged"
    return last


def test_absurd_learning_rate_exits_3_and_keeps_the_last_checkpoint(data_dir, tmp_path, monkeypatch, capsys):
    """Resume a healthy run with lr 1e30: the first update sends the weights to ~1e30, the next
    forward overflows. train.py's main exits 3, says where, logs the status and keeps ckpt.pt. (In this
    process: a train.py process exiting 3 is tested by test_two_ranks_stop_together_on_divergence and by
    test_tools.py's diverged sweep run.)"""
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=4)) == 0
    before = (tmp_path / "run" / "ckpt.pt").read_bytes()
    monkeypatch.setattr(sys, "argv", ["train.py", *tiny_run_args(data_dir, out, max_iters=8, learning_rate=1e30,
                                                                 init_from="resume")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    result = capsys.readouterr()
    assert exit_info.value.code == guards.EXIT_DIVERGED, result.err
    record = status(out)
    # the non-finite loss of iter 6 poisoned every weight through its step: no block can be named
    assert record["iter"] == 6 and record["reason"] == "non-finite training loss" and record["block"] is None
    assert record["nonfinite"][0] == "wte.weight" and record["n_nonfinite"] > len(record["nonfinite"])
    assert "diverged at iter 6: non-finite training loss; non-finite: wte.weight, wpe.weight" in result.err
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == before
    assert run_files.load_checkpoint(os.path.join(out, "ckpt.pt"), "cpu")["iter_num"] == 4


def test_divergence_with_finite_weights_names_the_block(data_dir, tmp_path):
    """Weights of block 1's MLP scaled by 1e30 (finite) overflow its output: the eval at the resumed
    iteration is non-finite, the weights are not, so the report names block 1."""
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=4)) == 0
    ckpt = load(out)
    for name in ("blocks.1.mlp.sublayer.fc.weight", "blocks.1.mlp.sublayer.proj.weight"):
        ckpt["model"][name] *= 1e30
    run_files.save_checkpoint(os.path.join(out, "ckpt.pt"), ckpt)
    assert train.train(tiny_run_args(data_dir, out, max_iters=8, init_from="resume")) == guards.EXIT_DIVERGED
    record = status(out)
    assert (record["iter"], record["block"], record["n_nonfinite"]) == (4, 1, 0)
    assert record["reason"] == "non-finite eval loss or state"


def test_divergence_between_log_lines_is_caught_at_the_next_eval(data_dir, tmp_path):
    """With log_interval past the run, the device-side first non-finite iteration is read at the
    eval: the run stops there, names the same iteration as a run that checks every step, and no
    checkpoint is written from the diverged state."""
    every, rarely = str(tmp_path / "every"), str(tmp_path / "rarely")
    args = dict(learning_rate=1e30, warmup_iters=0, max_iters=8, eval_interval=4)
    assert train.train(tiny_run_args(data_dir, every, **args)) == guards.EXIT_DIVERGED
    assert train.train(tiny_run_args(data_dir, rarely, **args, log_interval=100)) == guards.EXIT_DIVERGED
    assert status(every)["iter"] == status(rarely)["iter"] == 2
    assert [r["kind"] for r in read_metrics(rarely)] == ["eval", "status"]
    assert not os.path.exists(os.path.join(rarely, "ckpt.pt"))


def test_two_ranks_stop_together_on_divergence(data_dir, tmp_path):
    """Only rank-local losses go non-finite between log lines; the all-reduced first bad iteration
    makes both ranks stop at the same eval with exit code 3, after rank 0 has logged the status.
    torchrun exits 1 and names exit code 3 as the root cause (it may SIGTERM the other rank while it
    exits); no rank crashes or hangs."""
    out = str(tmp_path / "run")
    args = tiny_run_args(data_dir, out, learning_rate=1e30, warmup_iters=0, max_iters=8, eval_interval=4,
                         log_interval=100, gradient_accumulation_steps=2)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1, result.stderr
    root_cause = result.stderr.split("Root Cause")[1]
    assert "exitcode  : 3" in root_cause and "exitcode  : 1 " not in result.stderr, result.stderr
    assert status(out)["iter"] == 2


# ----------------------------------------------------------------------------- diagnostics


def test_diagnostics_are_logged_at_evals_without_changing_training(data_dir, tmp_path):
    plain, logged = str(tmp_path / "plain"), str(tmp_path / "logged")
    args = dict(norm_scheme="geonorm", dropout=0.1, max_iters=4, eval_interval=2)
    assert train.train(tiny_run_args(data_dir, plain, **args)) == 0
    assert train.train(tiny_run_args(data_dir, logged, **args, log_diagnostics=True)) == 0
    # the extra forward/backward re-seeds dropout like the step it mirrors: training is unchanged
    assert {k: v for k, v in losses(logged).items() if k[0] != "block_skip_loss"} == losses(plain)
    evals = [r for r in read_metrics(logged) if r["kind"] == "eval"]
    assert [r["iter"] for r in evals] == [0, 2, 4]
    model = train.GPT(train.GPTConfig(**load(logged)["model_args"]))
    names, n_entries = [n for n, _ in model.named_parameters()], sum(p.numel() for p in model.parameters())
    for r in evals:
        assert list(r["grad_norms"]) == names and all(0 <= v < float("inf") for v in r["grad_norms"].values())
        assert r["grad_kurtosis"] >= 1 and r["grad_tail_ratio"] >= 1  # kurtosis >= 1 for any distribution
        assert len(r["grad_abs_hist"]) == len(r["grad_abs_hist_log10_edges"]) + 1
        assert sum(r["grad_abs_hist"]) == n_entries  # every gradient entry, the tied head counted once
        for key in ("attn_mean", "attn_max", "mlp_mean", "mlp_max"):
            theta = r[f"geonorm_theta_{key}"]
            assert len(theta) == 2 and all(0 <= t <= torch.pi / 4 for t in theta)  # the default clamp
        assert all(r[f"geonorm_theta_{u}_mean"][i] <= r[f"geonorm_theta_{u}_max"][i]
                   for u in ("attn", "mlp") for i in range(2))


def test_gradient_statistics_of_gaussian_gradients():
    """Gaussian entries: kurtosis 3 and q99.9/median of |g| = 3.29/0.674 = 4.88; with 27k entries the
    sampling error is ~0.03 and ~0.1, so 0.15 and 0.4 are safe bounds. Norms undo the loss scale."""
    model = train.GPT(train.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50))
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = 8 * torch.randn(p.shape, generator=generator)
    stats = diagnostics.gradient_statistics(model, grad_scale=8.0)
    assert stats["grad_kurtosis"] == pytest.approx(3.0, abs=0.15)
    assert stats["grad_tail_ratio"] == pytest.approx(4.88, abs=0.4)
    n = sum(p.numel() for p in model.parameters())
    assert sum(stats["grad_abs_hist"]) == n and stats["grad_abs_hist"][-1] > 0.3 * n  # |g| >= 1: 32% of N(0, 1)
    assert stats["grad_norms"]["wpe.weight"] == pytest.approx(model.wpe.weight.grad.norm().item() / 8)


# ----------------------------------------------------------------------------- stop signals


STOP_SETTINGS = dict(dropout=0.1, max_iters=10, eval_interval=4, lr_decay_iters=10)


@pytest.fixture(scope="module")
def straight_run(data_dir, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("straight") / "run")
    assert train.train(tiny_run_args(data_dir, out, **STOP_SETTINGS)) == 0
    return out


def signal_during(iteration: int, *signums: int):
    """A forward_backward that sends this process `signums` as iteration `iteration` begins (real delivery:
    the handlers run between two Python instructions, as they would for a signal from outside)."""
    forward_backward = train.forward_backward

    def send(model, task, ddp, accum, it, *args):
        if it == iteration:
            for signum in signums:
                os.kill(os.getpid(), signum)
        return forward_backward(model, task, ddp, accum, it, *args)

    return send


@pytest.mark.parametrize("signum, always_save", [(signal.SIGTERM, True), (signal.SIGINT, False)])
def test_a_stop_signal_saves_the_last_completed_iteration_and_resumes_exactly(data_dir, tmp_path, monkeypatch,
                                                                              straight_run, signum, always_save):
    """The signal comes during iteration 5; the run completes it, saves iter 6 (not only the eval at 4),
    exits 4, and the resumed run is bitwise the uninterrupted one. With always_save_checkpoint=False ckpt.pt
    is the best eval's (iter 4) and stays so: iter 6 goes to ckpt_last.pt, which resume starts from."""
    out = str(tmp_path / "run")
    settings = {**STOP_SETTINGS, "always_save_checkpoint": always_save}
    monkeypatch.setattr(train, "forward_backward", signal_during(5, signum))
    assert train.train(tiny_run_args(data_dir, out, **settings)) == guards.EXIT_STOPPED == 4
    monkeypatch.undo()
    assert read_metrics(out)[-1] == {"kind": "status", "status": "stopped", "iter": 6,
                                     "signal": signal.Signals(signum).name, "saved": True}
    assert load(out)["iter_num"] == (6 if always_save else 4)
    assert always_save or load(out, "ckpt_last.pt")["iter_num"] == 6
    assert train.train(tiny_run_args(data_dir, out, **settings, init_from="resume")) == 0
    assert losses(out) == losses(straight_run)
    if always_save:  # else ckpt.pt is the best eval's, which need not be the last
        a, b = load(straight_run), load(out)
        for key in ("model", "optimizer"):
            assert_same_tensors(a[key], b[key])


def test_a_stop_at_an_evaluation_iteration_resumes_into_its_saves(data_dir, tmp_path, monkeypatch):
    """The signal comes during iteration 3, so the run stops at 4 before evaluating it (ckpt_last.pt). The
    resumed run evaluates 4 and saves there as an uninterrupted run does: ckpt_4.pt, and ckpt.pt at the best
    evaluation, which replaces ckpt_last.pt. (That the losses are the uninterrupted run's is tested above.)"""
    settings = {**STOP_SETTINGS, "keep_every": 4, "always_save_checkpoint": False}
    out = str(tmp_path / "run")
    monkeypatch.setattr(train, "forward_backward", signal_during(3, signal.SIGTERM))
    assert train.train(tiny_run_args(data_dir, out, **settings)) == guards.EXIT_STOPPED
    monkeypatch.undo()
    assert load(out, "ckpt_last.pt")["iter_num"] == 4 and not os.path.exists(os.path.join(out, "ckpt_4.pt"))
    assert train.train(tiny_run_args(data_dir, out, **settings, init_from="resume")) == 0
    assert sorted(f for f in os.listdir(out) if f.endswith(".pt")) == ["ckpt.pt", "ckpt_4.pt", "ckpt_8.pt"]
    evals = {r["iter"]: r["val_loss"] for r in read_metrics(out) if r["kind"] == "eval" and r["iter"] > 0}
    assert load(out)["iter_num"] == min(evals, key=evals.get) and load(out, "ckpt_4.pt")["iter_num"] == 4


def test_a_stop_signal_cuts_the_final_sample_short(data_dir, tmp_path, monkeypatch, capsys):
    generate, calls = train.GPT.generate, []

    def signalled(self, idx, n, **kwargs):
        calls.append(n)
        os.kill(os.getpid(), signal.SIGTERM)
        return generate(self, idx, n, **kwargs)

    monkeypatch.setattr(train.GPT, "generate", signalled)
    assert train.train(tiny_run_args(data_dir, str(tmp_path / "run"), max_iters=0, sample_tokens=1000)) == 0
    assert calls == [lm_task.SAMPLE_CHUNK] and "(cut short by SIGTERM)" in capsys.readouterr().out


def test_a_second_sigint_stops_at_once(data_dir, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "run")
    handler = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(train, "forward_backward", signal_during(5, signal.SIGINT, signal.SIGINT))
    monkeypatch.setattr(sys, "argv", ["train.py", *tiny_run_args(data_dir, out, **STOP_SETTINGS)])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    assert exit_info.value.code == guards.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err.endswith("interrupted by SIGINT: stopped at once, without a checkpoint of the "
                                            "current iteration\n")
    assert load(out)["iter_num"] == 4  # the last evaluation's
    assert signal.getsignal(signal.SIGINT) is handler  # the run's handlers are gone with it


def with_extra_model_key(state: dict) -> None:
    state["model_args"]["norm_flavour"] = "new"  # a key of another version's GPTConfig


def without_a_weight(state: dict) -> None:
    del state["model"][next(iter(state["model"]))]


def without_its_vocabulary(state: dict) -> None:
    del state["data_meta"]["chars"]


@pytest.mark.parametrize("edit", [with_extra_model_key, without_a_weight, without_its_vocabulary])
def test_a_checkpoint_of_another_version_is_refused_by_train_and_sample(straight_run, data_dir, tmp_path, edit):
    """Saved with its checksum, so only its contents tell: exit 2 (ConfigError), the folder unchanged."""
    import sample

    out = tmp_path / "run"
    shutil.copytree(straight_run, out)
    state = run_files.load_checkpoint(str(out / "ckpt.pt"), "cpu")
    edit(state)
    run_files.save_checkpoint(str(out / "ckpt.pt"), state)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    if edit is not without_its_vocabulary:  # train.py checks the data's vocabulary against its own
        with pytest.raises(train.ConfigError, match="does not fit this version of nanoNorm"):
            train.train(tiny_run_args(data_dir, str(out), **{**STOP_SETTINGS, "max_iters": 12}, init_from="resume"))
    with pytest.raises(train.ConfigError, match="does not fit this version of nanoNorm"):
        sample.load_model(str(out), "cpu")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_eval_only_needs_no_optimizer_state(straight_run, data_dir, tmp_path):
    """A checkpoint kept without its optimizer state (to save space) still evaluates; resuming it is refused."""
    out = tmp_path / "run"
    shutil.copytree(straight_run, out)
    state = run_files.load_checkpoint(str(out / "ckpt.pt"), "cpu")
    del state["optimizer"]
    run_files.save_checkpoint(str(out / "ckpt.pt"), state)
    assert train.train(tiny_run_args(data_dir, str(out), **STOP_SETTINGS, init_from="eval")) == 0
    with pytest.raises(train.ConfigError, match="optimizer missing or of another type"):
        train.train(tiny_run_args(data_dir, str(out), **{**STOP_SETTINGS, "max_iters": 12}, init_from="resume"))


def test_resume_without_metrics_is_refused(straight_run, data_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight_run, out)
    os.remove(out / "metrics.jsonl")
    with pytest.raises(train.ConfigError, match="metrics.jsonl is missing.*touch"):
        train.train(tiny_run_args(data_dir, str(out), **{**STOP_SETTINGS, "max_iters": 12}, init_from="resume"))
    assert not (out / "metrics.jsonl").exists()


def test_resume_with_metrics_cut_short_is_refused_and_an_emptied_log_goes_on(straight_run, data_dir, tmp_path):
    """The checkpoint records how many lines the log had: one that lost lines since is refused, unchanged (the
    resumed log would miss iterations); one emptied by hand is the user's choice to go on without them."""
    out = tmp_path / "run"
    shutil.copytree(straight_run, out)
    lines = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (out / "metrics.jsonl").write_bytes(b"".join(lines[:2]))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    args = tiny_run_args(data_dir, str(out), **{**STOP_SETTINGS, "max_iters": 12}, init_from="resume")
    # the log's last line, iter 10's evaluation, was written after the checkpoint's save
    with pytest.raises(train.ConfigError, match=rf"holds 2 lines up to iter 10, but it held {len(lines) - 1} when "
                                                "the checkpoint was saved"):
        train.train(args)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / "metrics.jsonl").write_bytes(b"")
    assert train.train(args) == 0
    assert [r["iter"] for r in read_metrics(str(out)) if r["kind"] == "eval"] == [12]


def test_resume_past_a_final_evaluation_off_the_interval_keeps_it(straight_run, data_dir, tmp_path):
    """On from 10 to 12: 10 is no multiple of eval_interval, so the resumed run does not evaluate it again and
    its logged evaluation stays."""
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    assert train.train(tiny_run_args(data_dir, out, **{**STOP_SETTINGS, "max_iters": 12}, init_from="resume")) == 0
    assert [r["iter"] for r in read_metrics(out) if r["kind"] == "eval"] == [0, 4, 8, 10, 12]


# ----------------------------------------------------------------------------- stalled ranks


def test_dist_timeout_reaches_the_process_group(monkeypatch):
    seen = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train.dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    cfg, _ = train.load_config(["--dist_timeout=7", "--device=cpu"])
    assert guards.setup_distributed(cfg)[0].world_size == 2
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(seconds=7), "device_id": None}  # no GPU to bind


@pytest.mark.parametrize("gloo_says, told", [
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 7000ms for recv operation",
     "waited more than dist_timeout=7s for the other ranks: one of them stalled"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Application timeout caused pair closure",  # Muon's wait
     "waited more than dist_timeout=7s for the other ranks: one of them stalled"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:28561",
     "lost its connection to another rank, which ended"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer", "lost its connection"),
])
def test_a_lost_rank_is_told_in_one_line(monkeypatch, capsys, gloo_says, told):
    """What gloo raises when a peer stalls past the timeout or is gone, as main() reports it (exit 1)."""
    def lost(*args):
        raise RuntimeError(gloo_says)

    monkeypatch.setattr(train.guards, "setup_distributed", lambda cfg: (guards.Dist(1, 1, 2), "cpu"))
    monkeypatch.setattr(train.guards, "claim_out_dir", lambda *args: contextlib.nullcontext())
    monkeypatch.setattr(train, "run", lost)
    monkeypatch.setattr(sys, "argv", ["train.py", "--dist_timeout=7"])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1
    assert err.startswith(f"error: rank 1 {told}")


STALL_SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import train

forward_backward = train.forward_backward


def stall_rank_1(model, task, ddp, accum, it, *args):
    if ddp.rank == 1 and it == 2:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun may end it at once once rank 0 has stopped
        time.sleep(600)
    return forward_backward(model, task, ddp, accum, it, *args)


train.forward_backward = stall_rank_1
train.main()
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
def test_a_stalled_rank_stops_the_run_after_dist_timeout(data_dir, tmp_path):
    """Rank 1 hangs in iteration 2; rank 0 gives up waiting after 3 s instead of gloo's default 30 min and
    says why (the two unit tests above cover the wiring and the message in the default run)."""
    script = tmp_path / "stall.py"
    script.write_text(STALL_SCRIPT.format(root=ROOT))
    out = str(tmp_path / "run")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script), *tiny_run_args(data_dir, out, gradient_accumulation_steps=2,
                                                         dist_timeout=3)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1 and time.monotonic() - started < 120
    assert "error: rank 0 waited more than dist_timeout=3s for the other ranks" in result.stderr, result.stderr


# ----------------------------------------------------------------------------- stops that must keep the last checkpoint


def test_a_stop_after_skipped_batches_keeps_the_last_evaluated_checkpoint(data_dir, tmp_path, monkeypatch, capsys):
    """Resume a healthy run with lr 1e30 and skip_nonfinite: the weights reach ~1e30 (finite) and the next batches
    are skipped as non-finite. A stop then must not replace iter 4's checkpoint with that state."""
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=4)) == 0
    before = (tmp_path / "run" / "ckpt.pt").read_bytes()
    monkeypatch.setattr(train, "forward_backward", signal_during(7, signal.SIGTERM))
    assert train.train(tiny_run_args(data_dir, out, max_iters=12, learning_rate=1e30, min_lr=0, grad_clip=0,
                                     lr_decay_iters=100, skip_nonfinite=1000, init_from="resume")) == 4
    monkeypatch.undo()
    assert [r.get("skipped", 0) for r in read_metrics(out) if r["kind"] == "train"][-1] > 0
    assert read_metrics(out)[-1] == {"kind": "status", "status": "stopped", "iter": 8, "signal": "SIGTERM",
                                     "saved": False}
    assert "non-finite batches were skipped since the last evaluation" in capsys.readouterr().err
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == before


def test_a_stop_during_setup_exits_before_training(data_dir, tmp_path, monkeypatch, capsys):
    """SIGTERM while the task is built (the ICL task's eval sets can take minutes): exit 4 before the first
    iteration, with nothing written."""
    make_task = train.lm_task.make_task

    def signalled(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return make_task(*args)

    out = str(tmp_path / "run")
    monkeypatch.setattr(train.lm_task, "make_task", signalled)
    assert train.train(tiny_run_args(data_dir, out)) == guards.EXIT_STOPPED
    assert not os.path.exists(out)  # nothing written: the folder it created goes
    assert "SIGTERM: stopped during setup, before the first iteration" in capsys.readouterr().err


def test_a_resume_that_rewinds_keeps_the_later_history_aside(data_dir, tmp_path, capsys):
    """always_save_checkpoint=False: ckpt.pt is the best evaluation's. A run that got worse after it, resumed, goes
    back there: the log lines past it move to metrics.jsonl.dropped (nothing written is lost) and one line says so."""
    out = str(tmp_path / "run")
    settings = dict(always_save_checkpoint=False, lr_schedule="constant", eval_interval=4)
    assert train.train(tiny_run_args(data_dir, out, max_iters=4, **settings)) == 0
    assert train.train(tiny_run_args(data_dir, out, max_iters=12, learning_rate=5.0, init_from="resume",
                                     **settings)) == 0
    assert load(out)["iter_num"] == 4  # lr 5 made it worse
    later = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["iter"] > 4]
    capsys.readouterr()
    assert train.train(tiny_run_args(data_dir, out, max_iters=8, init_from="resume", **settings)) == 0
    assert f"moved {len(later)} lines past iter 4 (iters 5-12) to" in capsys.readouterr().out
    assert (tmp_path / "run" / "metrics.jsonl.dropped").read_text().splitlines() == later
    assert [r["iter"] for r in read_metrics(out) if r["kind"] == "eval"] == [0, 4, 8]


def test_a_dataset_prepared_again_with_other_characters_is_named_so(tmp_path):
    """The checkpoint's own dataset, prepared again from other characters: not 'use --dataset=<the same name>'."""
    from test_validation import char_dataset

    char_dataset(tmp_path, "first", "abcdefgh")
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(str(tmp_path), out, dataset="first", max_iters=2, eval_interval=2)) == 0
    char_dataset(tmp_path, "first", "ijklmnop", force=True)
    with pytest.raises(train.ConfigError, match=r"first was prepared again since this checkpoint was saved "
                                                r"\(chars differ\)") as error:
        train.train(tiny_run_args(str(tmp_path), out, dataset="first", max_iters=4, eval_interval=2,
                                  init_from="resume"))
    assert "--dataset=first" not in str(error.value)

"""What a run guarantees when its world misbehaves: a resume that goes back keeps the abandoned branch's kept
checkpoints aside, a new run deletes only names a run writes (named in the refusal first), a run whose out_dir
was deleted or replaced writes nothing more, a second Ctrl-C never cuts a save in half, a closed stdout does not
stop the training, a number float32 cannot hold is refused before anything runs, a full disk is named with what
was kept, and a checkpoint that reads is never blamed for an error of the device."""

import json
import os
import sys

import pytest
from conftest import tiny_run_args

import train
from nanonorm import run_files
from nanonorm.train_config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def main(monkeypatch, capsys, argv: list[str]) -> tuple[int, str, str]:
    """train.py's main in-process: exit code, stdout and stderr."""
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


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


# ----------------------------------------------------------------------------- errors that are not the file's


def test_a_run_on_cpu_0_resumes_and_samples(data_dir, tmp_path):
    """--device=cpu:0 is the CPU: its checkpoints resume and sample (they are not 'truncated')."""
    import sample

    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=4, device="cpu:0")) == 0
    assert train.train(tiny_run_args(data_dir, out, max_iters=8, device="cpu:0", init_from="resume")) == 0
    assert sample.main(["--out_dir", out, "--device=cpu:0", "--max_new_tokens=4"]) == 0

"""sweep.py, plot.py and prepare_data.py guarding what they count and keep: a run is counted only with the settings
and data its sweep planned, a key or a root is taken once, a run that cannot be launched or a stop signal ends the
sweep cleanly, and a preparation stopped by a full disk or Ctrl-C leaves the earlier data as it was."""

import os

import pytest
from conftest import ROOT

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


def test_the_swept_rate_given_by_set_too_is_refused(tmp_path, capsys):
    """--lr_grid sets the rate of every run: a --set value of it would be dropped without a word."""
    argv = [CONFIG, "--set", "learning_rate=1e-3", "--lr_grid", "1e-3,1e-2", "--out_root", str(tmp_path), "--dry_run"]
    assert sweep.main(argv) == 2
    one_line_error(capsys, "learning_rate", "--lr_grid")
    assert sweep.main([CONFIG, "--lr_keys", "learning_rate+learning_rate", *argv[3:]]) == 2  # a key twice
    one_line_error(capsys, "--lr_keys", "learning_rate")

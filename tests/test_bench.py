"""bench.py at a tiny shape: every table row is measured, ratios are taken against the right baseline,
and each ratio comes with the spread of its rounds."""

import math
import re
import sys

import pytest

import bench
from model import SCHEMES


@pytest.fixture(scope="module")
def tables():
    return bench.run_bench("tiny", schemes=["geonorm", "dnt"], optimizers=["sgdw", "muon"], dtype="float32",
                           rounds=3, warmup=0, profile=1)


def test_bench_times_every_requested_scheme_against_pre(tables):
    rows = {r["name"]: r for r in tables["schemes"]}
    assert list(rows) == ["pre", "geonorm", "dnt"]
    assert rows["pre"]["ratio"] == rows["pre"]["ratio_q1"] == rows["pre"]["ratio_q3"] == 1.0
    for r in rows.values():
        assert r["seconds"] > 0 and r["tokens_per_s"] > 0
        assert math.isfinite(r["mfu"]) and 0 < r["mfu"] < 1  # a measured CPU peak bounds a real step
        assert r["ratio_lo"] <= r["ratio_q1"] <= r["ratio"] <= r["ratio_q3"] <= r["ratio_hi"]


def test_bench_reports_optimizer_state_relative_to_adamw(tables):
    rows = {r["name"]: r for r in tables["optimizers"]}
    assert list(rows) == ["adamw", "sgdw", "muon"]
    adamw, sgdw, muon = (rows[n]["state_bytes"] for n in ("adamw", "sgdw", "muon"))
    # AdamW keeps two moments per entry (plus a 4-byte step per tensor), mSGDW one: half, up to the steps
    assert sgdw < adamw / 2 < sgdw * 1.05
    # Muon keeps one buffer for the hidden matrices and AdamW's two moments for the rest
    assert sgdw < muon < adamw


def test_bench_profile_attributes_each_scheme_its_own_ops(tables):
    ops = tables["profile_schemes"]
    assert set(ops) == {"pre", "geonorm", "dnt"}
    # the geodesic step's cos and sin run in GeoNorm only, the q/k RMSNorm's rsqrt in DNT only (Pre-Norm: LayerNorm)
    assert "aten::cos" in ops["geonorm"] and "aten::cos" not in ops["dnt"] and "aten::cos" not in ops["pre"]
    assert "aten::rsqrt" in ops["dnt"] and "aten::rsqrt" not in ops["pre"]
    assert set(tables["profile_optimizers"]) == {"adamw", "sgdw", "muon"}


def test_report_profile_ranks_ops_by_their_difference_from_the_baseline(capsys):
    ops = {"pre": {"mm": 10.0, "add": 1.0}, "case": {"mm": 10.5, "add": 1.0, "geodesic": 3.0}}
    bench.report_profile(ops, "pre")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert lines[0] == "| op | pre | case |"
    assert [line.split(" | ")[0] for line in lines[1:]] == ["| geodesic", "| mm", "| add", "| all ops"]
    assert lines[-1] == "| all ops | 11.00 | 14.50 (+3.50) |"


def test_bench_lists_every_scheme_and_dyt_and_derf_in_pre_norm():
    assert set(bench.SCHEME_CASES) == {*SCHEMES, "dyt", "derf"}
    dyt = bench.model_config("tiny", **bench.scheme_case("dyt"))
    assert (dyt.norm_scheme, dyt.norm) == ("pre", "dyt")
    assert bench.model_config("tiny", **bench.scheme_case("hybrid")).norm_scheme == "hybrid"


def test_ratio_within_a_round_cancels_a_slow_round():
    # the machine slows every case of rounds 2 and 4 threefold; the case is always 10% slower than pre
    pre = [1.0, 3.0, 1.0, 3.0, 1.0]
    times = {"pre": pre, "case": [1.1 * t for t in pre]}
    spread = bench.ratio_spread(times, "pre")["case"]
    for key in ("ratio", "ratio_q1", "ratio_q3", "ratio_lo", "ratio_hi"):
        assert spread[key] == pytest.approx(1.1)


def test_median_interval_uses_binomial_order_statistics():
    values = list(range(1, 21))  # n = 20: P(Bin(20, 1/2) <= 5) = 0.021 <= 0.025 < P(<= 6) = 0.058
    assert bench.median_interval(values) == (6, 15)
    assert bench.median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few values for 95%: the range


def test_too_few_rounds_for_the_median_interval_show_a_dash(capsys):
    assert not bench.has_median_interval(5) and bench.has_median_interval(6)  # the range covers the median 97%
    row = {"name": "case", "seconds": 0.01, "ratio": 1.1, "ratio_q1": 1.0, "ratio_q3": 1.2, "ratio_lo": 0.9,
           "ratio_hi": 1.3, "tokens_per_s": 100.0, "mfu": 0.1, "peak_gib": float("nan"), "state_bytes": 0}
    for rounds, cell in ((2, "| - |"), (6, "| 0.900–1.300 |")):
        bench.report("Schemes", [row], "pre", rounds)
        out = capsys.readouterr().out
        assert cell in out.splitlines()[-1] and ("give --rounds 6 or more" in out) == (rounds < 6)


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], r"--rounds 0 must be at least 1"),
    (["--warmup", "-1"], r"--warmup -1 must be at least 0"),
    (["--threads", "0"], r"--threads 0 must be at least 1"),
    (["--profile", "-2"], r"--profile -2 must be at least 0"),
    (["--schemes", "pre,prenorm"], r"unknown scheme\(s\) prenorm; choose from: post, pre,"),
    (["--optimizers", "adam"], r"unknown optimizer\(s\) adam; choose from: adamw, sgdw, muon, manifold_muon"),
    (["--device", "gpu"], r"--device gpu is not one the benchmarks time; give cpu, cuda or cuda:N"),
    (["--device", "cpu:1"], r"--device='cpu:1' is not valid; give cpu, cuda or cuda:N"),  # as train.py refuses it
    (["--device", "cpu", "--nanogpt", "EXITS"], r"--nanogpt .*model.py failed to import \(SystemExit: 0\)"),
    (["--device", "cpu", "--nanogpt", "OTHER_GPT", "--shape", "tiny", "--schemes", "none", "--optimizers", "none",
      "--rounds", "1", "--warmup", "0"],
     r"--nanogpt .*model.py: its GPT cannot be built as nanoGPT's is \(TypeError: .*'n_layer'\); give the path"),
    (["--device", "cpu", "--nanogpt", "no/such/model.py"], r"--nanogpt no/such/model.py is not a Python file"),
    (["--device", "cpu", "--nanogpt", "NOT_NANOGPT"], r"defines no GPT and GPTConfig; give the path of nanoGPT's"),
])
def test_bad_options_exit_2_with_one_line(monkeypatch, capsys, tmp_path, argv, message):
    files = {"NOT_NANOGPT": "import torch\n", "EXITS": "import sys\nsys.exit(0)\n",
             "OTHER_GPT": "class GPTConfig:\n    def __init__(self, layers=2): pass\n\n"
                          "class GPT:\n    def __init__(self, config): pass\n"}
    for name, text in files.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.py").write_text(text)
    argv = [str(tmp_path / a / "model.py") if a in files else a for a in argv]
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    err = capsys.readouterr().err
    last = err.rstrip("\n").splitlines()[-1]  # argparse prints the usage, then one error line
    assert exit_info.value.code == 2 and last.startswith("bench.py: error: ") and re.search(message, last), err

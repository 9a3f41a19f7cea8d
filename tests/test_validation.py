"""Bad config values stop a run before it trains, with a message naming the key, the valid choices
and the fix; train.py then exits with code 2."""

import os
import sys

import pytest
from conftest import tiny_run_args

import prepare_data
import train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arg, message", [
    ("--norm_scheme=geo", r"norm_scheme='geo' is not valid; choose one of: post, pre, .*geonorm, dnt, lipschitz"),
    ("--norm=batchnorm", r"norm='batchnorm' is not valid; choose one of: layernorm, rmsnorm, headwise"),
    ("--combine=mul", r"combine='mul' is not valid; choose one of: add, pre_alt, deepnorm, convex, geodesic"),
    ("--optimizer=adam", r"optimizer='adam' is not valid; choose one of: adamw, sgdw, muon, manifold_muon"),
    ("--task=lsq", r"task='lsq' is not valid; choose one of: lm, icl"),
])
def test_unknown_names_list_the_valid_ones(arg, message):
    with pytest.raises(train.ConfigError, match=message):
        train.load_config([arg])


@pytest.mark.parametrize("args, message", [
    (["--n_embd=30", "--n_head=4"], r"n_embd=30 must be divisible by n_head=4"),
    (["--pos=rope", "--n_embd=36", "--n_head=4"], r"pos='rope' needs an even head size, got 9"),
    (["--task=icl", "--icl_pairs=16", "--block_size=16"],
     r"block_size=16 is shorter than a least-squares sequence \(2 \* icl_pairs = 32 tokens\); raise --block_size"),
    (["--learning_rate=0"], r"learning_rate=0.0 must be positive"),
    (["--max_iters=-1"], r"max_iters=-1 must not be negative"),
    (["--eval_interval=0"], r"eval_interval=0 must be at least 1"),
    (["--dropout=1.0"], r"dropout=1.0 must lie in \[0, 1\)"),
])
def test_impossible_values_are_caught_when_the_config_is_read(args, message):
    with pytest.raises(train.ConfigError, match=message):
        train.load_config(args)


def test_accumulation_must_split_evenly_among_ranks():
    cfg, _ = train.load_config(["--gradient_accumulation_steps=3"])
    with pytest.raises(train.ConfigError, match=r"gradient_accumulation_steps=3 must be divisible by the number "
                                                r"of processes \(2\); it is the global count"):
        train.accumulation_per_rank(cfg, 2)
    assert train.accumulation_per_rank(cfg, 3) == 1 and train.accumulation_per_rank(cfg, 1) == 3


def test_block_size_larger_than_the_data_is_refused(tmp_path):
    tokenizer = prepare_data.get_tokenizer("char", sorted("abcdefgh \n"))
    prepare_data.write_dataset(tmp_path / "tiny", {"train": ["abcdefgh " * 20], "val": ["hgfedcba"]}, tokenizer, "test")
    with pytest.raises(train.ConfigError, match=r"block_size=32 is too large for .*val.bin \(10 tokens\); "
                                                r"use a smaller --block_size"):
        train.train(tiny_run_args(str(tmp_path), str(tmp_path / "run"), dataset="tiny"))
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_geonorm_angles_need_a_geodesic_model(data_dir, tmp_path):
    with pytest.raises(train.ConfigError, match=r"log_geonorm_angles needs GeoNorm's geodesic step "
                                                r"\(norm_scheme='geonorm' or combine='geodesic'\); .* by 'add'"):
        train.train(tiny_run_args(data_dir, str(tmp_path / "run"), log_geonorm_angles=True))


@pytest.mark.parametrize("change, message", [
    (dict(n_layer=3), r"cannot resume: the checkpoint's model has n_layer=2 \(this run: 3\)\. .*only dropout may"),
    (dict(optimizer="sgdw"), r"trained with optimizer='adamw', this run asks for 'sgdw'.*--optimizer=adamw"),
])
def test_resume_refuses_another_model_or_optimizer(data_dir, tmp_path, change, message):
    out = tmp_path / "run"
    assert train.train(tiny_run_args(data_dir, str(out), max_iters=2, eval_interval=2)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(train.ConfigError, match=message):
        train.train(tiny_run_args(data_dir, str(out), max_iters=4, init_from="resume", **change))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # dropout is not part of the weights, so it may change on resume
    assert train.train(tiny_run_args(data_dir, str(out), max_iters=4, init_from="resume", dropout=0.1)) == 0


def test_config_error_exits_with_code_2(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train.py", "--n_embd=30", "--n_head=4"])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    assert exit_info.value.code == train.EXIT_CONFIG == 2
    assert capsys.readouterr().err == "error: n_embd=30 must be divisible by n_head=4\n"

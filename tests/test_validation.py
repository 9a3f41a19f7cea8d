"""Bad config values stop a run before it trains, with a message naming the key, the valid choices
and the fix; train.py then exits with code 2."""

import json
import os
import sys

import pytest
from conftest import tiny_run_args

import prepare_data
import train
from nanonorm import guards, run_files, train_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arg, message", [
    ("--norm_scheme=geo", r"norm_scheme='geo' is not valid; choose one of: post, .*geonorm, dnt, dnt_s1.*lipschitz"),
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


def char_dataset(data_dir, name: str, chars: str, force: bool = False, repeats: int = 20) -> None:
    """data_dir/name: a char dataset over `chars` (letters, a space and a newline), long enough for block_size 32."""
    tokenizer = prepare_data.get_tokenizer("char", sorted(chars + " \n"))
    text = chars + " "
    prepare_data.write_dataset(data_dir / name, {"train": [text * repeats], "val": [text[::-1] * 8]}, tokenizer,
                               "test", force=force)


def empty_val_split(path) -> None:
    """What meta.json says for a val split of no tokens (write_dataset itself refuses one)."""
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "val_tokens": 0}))
    (path / "val.bin").write_bytes(b"")


@pytest.mark.parametrize("val, tokens", [("hgfedcba", 10), ("", 0)])
def test_block_size_larger_than_the_data_is_refused(tmp_path, val, tokens):
    tokenizer = prepare_data.get_tokenizer("char", sorted("abcdefgh \n"))
    prepare_data.write_dataset(tmp_path / "tiny", {"train": ["abcdefgh " * 20], "val": [val or "a"]}, tokenizer,
                               "test")
    if not val:
        empty_val_split(tmp_path / "tiny")
    with pytest.raises(train.ConfigError, match=rf"block_size=32 is too large for .*val.bin \({tokens} tokens\); "
                                                r"use a smaller --block_size"):
        train.train(tiny_run_args(str(tmp_path), str(tmp_path / "run"), dataset="tiny"))
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


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
    assert exit_info.value.code == guards.EXIT_CONFIG == 2
    assert capsys.readouterr().err == "error: n_embd=30 must be divisible by n_head=4\n"


def without(args: list[str], *keys: str) -> list[str]:
    return [a for a in args if not a.startswith(tuple(f"--{k}=" for k in keys))]


def test_resume_and_eval_only_keep_the_checkpoints_block_size_and_compact_vocab(data_dir, tmp_path):
    """Neither repeats --block_size (default 1024) nor --compact_vocab: both are the checkpoint's, so the
    eval and the resumed run see its windows and vocabulary and the resume is exact."""
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=2, eval_interval=2, compact_vocab=True)) == 0
    assert train.train(without(tiny_run_args(data_dir, out, init_from="eval"), "block_size")) == 0
    assert train.train(without(tiny_run_args(data_dir, out, max_iters=4, eval_interval=2, init_from="resume"),
                               "block_size")) == 0
    saved = run_files.load_checkpoint(os.path.join(out, "ckpt.pt"), "cpu")
    assert saved["iter_num"] == 4 and saved["model_args"]["block_size"] == 32 and saved["config"]["compact_vocab"]
    with pytest.raises(train.ConfigError, match=r"checkpoint's model has block_size=32 \(this run: 64\)"):
        train.train(tiny_run_args(data_dir, out, max_iters=6, init_from="resume", block_size=64))


def test_resume_refuses_a_dataset_whose_token_ids_mean_other_characters(tmp_path):
    """Two char datasets of 10 symbols each: the same vocab_size, other characters. Resume and eval_only
    refuse the other one and change nothing; the same dataset prepared again is fine."""
    char_dataset(tmp_path, "first", "abcdefgh")
    char_dataset(tmp_path, "other", "ijklmnop")
    out = tmp_path / "run"
    assert train.train(tiny_run_args(str(tmp_path), str(out), dataset="first", max_iters=2, eval_interval=2)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for change in (dict(init_from="resume", max_iters=4), dict(init_from="eval")):
        with pytest.raises(train.ConfigError, match=r"other does not encode text as the checkpoint's training data "
                                                    r"did \(chars differ\).*\(--dataset=first\)"):
            train.train(tiny_run_args(str(tmp_path), str(out), dataset="other", eval_interval=2, **change))
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    char_dataset(tmp_path, "first", "abcdefgh", force=True)
    assert train.train(tiny_run_args(str(tmp_path), str(out), dataset="first", max_iters=4, eval_interval=2,
                                     init_from="resume")) == 0
    meta_path = tmp_path / "first" / "meta.json"  # as a version that recorded no digests writes it: counts only
    meta_path.write_text(json.dumps({k: v for k, v in json.loads(meta_path.read_text()).items()
                                     if not k.endswith("_sha256")}))
    assert train.train(tiny_run_args(str(tmp_path), str(out), dataset="first", max_iters=6, eval_interval=2,
                                     init_from="resume")) == 0


@pytest.mark.parametrize("text, repeats, changed", [
    ("abcdefgh", 30, r"train_tokens 182 -> 272, train_sha256 [0-9a-f]{12}\.\.\. -> [0-9a-f]{12}\.\.\."),
    ("hgfedcba", 20, r"train_sha256 [0-9a-f]{12}\.\.\. -> [0-9a-f]{12}\.\.\., val_sha256 "),
], ids=["more text", "other text of the same length"])
def test_resume_refuses_its_dataset_prepared_again_from_other_text(tmp_path, text, repeats, changed):
    """The same name and characters, other training text (more of it, or as much in another order, which
    the token counts alone would miss): the run would go on with other data than it started on, so resume
    and eval_only stop and change nothing."""
    char_dataset(tmp_path, "first", "abcdefgh")
    out = tmp_path / "run"
    assert train.train(tiny_run_args(str(tmp_path), str(out), dataset="first", max_iters=2, eval_interval=2)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    char_dataset(tmp_path, "first", text, force=True, repeats=repeats)
    for change in (dict(init_from="resume", max_iters=4), dict(init_from="eval")):
        with pytest.raises(train.ConfigError, match=r"first was prepared again since this checkpoint was saved "
                                                    rf"\({changed}"):
            train.train(tiny_run_args(str(tmp_path), str(out), dataset="first", eval_interval=2, **change))
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_min_lr_above_learning_rate_is_fine_without_decay():
    """A constant schedule never reaches min_lr (the setting only prints its no-effect warning)."""
    cfg, _ = train.load_config(["--lr_schedule=constant", "--learning_rate=1e-3", "--min_lr=1e-2"])
    assert cfg.min_lr == 1e-2 and train_config.lr_multiplier(cfg, 10) == 1.0


@pytest.mark.parametrize("text", ["{[1]: 2}", "+" * 5000 + "1"], ids=["unhashable key", "too deep to parse"])
def test_a_value_python_cannot_build_is_read_as_a_string(text):
    assert train_config.parse_overrides([f"--out_dir={text}"]) == {"out_dir": text}

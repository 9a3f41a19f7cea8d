"""train.py end to end: runs, logs, checkpoints, resumes, rejects bad configs, and DDP."""

import contextlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, tiny_run_args

import sample
import train
from nanonorm import lm_task, run_files, train_config


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(out_dir: str) -> dict[int, float]:
    return {r["iter"]: r["loss"] for r in read_metrics(out_dir) if r["kind"] == "train"}


def test_tiny_run_writes_metrics_and_checkpoint(data_dir, tmp_path):
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out)) == 0
    records = read_metrics(out)
    assert [r["iter"] for r in records if r["kind"] == "eval"] == [0, 4, 8]
    assert sorted(train_losses(out)) == list(range(1, 9))
    # the first step (compile, warm-up) is not timed: its line has the loss alone, every later one the speed too
    train_lines = [r for r in records if r["kind"] == "train"]
    assert {"loss", "lr"} <= train_lines[0].keys() and "ms_per_iter" not in train_lines[0]
    assert all({"loss", "lr", "ms_per_iter", "tokens_per_s", "mfu"} <= r.keys() for r in train_lines[1:])
    assert all(0 < r["mfu"] < 1 for r in train_lines[1:])  # a measured CPU peak bounds a real step
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["iter_num"] == 8 and ckpt["model_args"]["vocab_size"] == ckpt["data_meta"]["vocab_size"]
    # the first eval sees the untrained model: loss ~ ln(vocab) within 0.3 nats
    assert abs(records[0]["val_loss"] - torch.log(torch.tensor(ckpt["data_meta"]["vocab_size"] * 1.0)).item()) < 0.3


def test_resume_continues_exactly(data_dir, tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    assert train.train(tiny_run_args(data_dir, full, max_iters=8, dropout=0.1)) == 0
    assert train.train(tiny_run_args(data_dir, part, max_iters=4, dropout=0.1)) == 0
    assert train.train(tiny_run_args(data_dir, part, max_iters=8, dropout=0.1, init_from="resume")) == 0
    # same data windows, dropout masks, optimizer state and schedule: bitwise equal on CPU
    assert train_losses(part) == train_losses(full)
    a = torch.load(os.path.join(full, "ckpt.pt"), weights_only=True)["model"]
    b = torch.load(os.path.join(part, "ckpt.pt"), weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_scratch_run_refuses_to_overwrite_a_checkpoint(data_dir, tmp_path):
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=4)) == 0
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    with pytest.raises(train.ConfigError, match="already exists.*init_from=resume.*overwrite=True"):
        train.train(tiny_run_args(data_dir, out, max_iters=4))
    assert ckpt.read_bytes() == before


def test_unknown_key_is_named_with_the_closest_valid_one(tmp_path):
    config = tmp_path / "typo.py"
    config.write_text("n_layers = 4\n")
    with pytest.raises(train.ConfigError, match="unknown config key 'n_layers'; did you mean 'n_layer'"):
        train.load_config([str(config)])
    with pytest.raises(train.ConfigError, match="unknown config key 'lerning_rate'; did you mean 'learning_rate'"):
        train.load_config(["--lerning_rate=0.1"])


def test_wrong_value_types_are_rejected():
    with pytest.raises(train.ConfigError, match="'n_layer' expects int, got 'four'"):
        train.load_config(["--n_layer=four"])
    with pytest.raises(train.ConfigError, match="'compile' expects bool"):
        train.load_config(["--compile=1"])
    cfg, model_args = train.load_config(["--learning_rate=1", "--norm_scheme=geonorm", "--gain_cap=None"])
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)
    assert model_args == {"norm_scheme": "geonorm", "gain_cap": None}


def test_bad_choices_list_the_valid_ones(data_dir, tmp_path):
    with pytest.raises(train.ConfigError, match="optimizer='adam' is not valid; choose one of: adamw"):
        train.load_config(["--optimizer=adam"])
    with pytest.raises(train.ConfigError, match="norm_scheme='geo' is not valid.*geonorm"):
        train.train(tiny_run_args(data_dir, str(tmp_path / "a"), norm_scheme="geo"))
    with pytest.raises(train.ConfigError, match="n_embd=30 must be divisible by n_head=4"):
        train.train(tiny_run_args(data_dir, str(tmp_path / "b"), n_embd=30, n_head=4))


def test_missing_dataset_names_the_command_that_makes_it(tmp_path):
    with pytest.raises(train.ConfigError, match="prepare_data.py openwebtext"):
        train.train(tiny_run_args(str(tmp_path), str(tmp_path / "run"), dataset="openwebtext"))


def test_embedded_dataset_is_prepared_when_missing(tmp_path):
    data = tmp_path / "fresh_data"
    assert train.train(tiny_run_args(str(data), str(tmp_path / "run"), max_iters=1, eval_interval=1)) == 0
    assert (data / "shakespeare_char" / "meta.json").exists()


def test_sample_script_prints_text_from_a_checkpoint(data_dir, tmp_path, capsys):
    """sample.py's main in this process; tests/test_tools.py runs the script as a process (a closed stdout)."""
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=2)) == 0
    capsys.readouterr()
    assert sample.main([f"--out_dir={out}", "--max_new_tokens=40", "--start=ROMEO:"]) == 0
    result = capsys.readouterr()
    assert result.err == ""
    assert result.out.startswith("ROMEO:") and len(result.out.splitlines()[0]) >= 6


def run_torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "train.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


# slow: the same property is checked in the default run by test_resume.py's
# test_killed_run_resumes_exactly[adamw-2-0.0-SIGTERM-columns], whose two-rank checkpoint, resumed on one process with
# 2 micro-batches, gives the two-rank run's losses to 1e-5 for 6 steps, and by test_optim.py's
# test_distributed_sharding_is_identical_on_ranks_and_to_one_process for the optimizers' sharded updates
@pytest.mark.slow
def test_two_processes_train_like_one_with_the_same_global_batch(data_dir, tmp_path):
    """2 ranks x 1 micro-batch vs 1 rank x 2 micro-batches: the same windows by construction,
    so losses differ only by float32 summation order (gloo's all-reduce vs local accumulation)."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    settings = dict(gradient_accumulation_steps=2, max_iters=6, eval_interval=6)
    single = run_torchrun(1, tiny_run_args(data_dir, one, **settings))
    assert single.returncode == 0, single.stderr
    double = run_torchrun(2, tiny_run_args(data_dir, two, **settings))
    assert double.returncode == 0, double.stderr
    a, b = train_losses(one), train_losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    # float32 rounding of a reordered sum (gloo's all-reduce vs local accumulation) compounds
    # over 6 Adam steps to ~1e-6 relative; 1e-5 leaves margin and still catches any data change
    assert [a[i] for i in sorted(a)] == pytest.approx([b[i] for i in sorted(b)], rel=1e-5)
    wa = torch.load(os.path.join(one, "ckpt.pt"), weights_only=True)["model"]
    wb = torch.load(os.path.join(two, "ckpt.pt"), weights_only=True)["model"]
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("optimizer, lr", [("adamw", 3e-3), ("sgdw", 0.3), ("muon", 3e-3), ("manifold_muon", 3e-3)])
def test_every_optimizer_trains_on_the_embedded_corpus(data_dir, tmp_path, optimizer, lr):
    out = str(tmp_path / optimizer)
    args = tiny_run_args(data_dir, out, optimizer=optimizer, learning_rate=lr, max_iters=30, lr_decay_iters=30,
                         eval_interval=30, eval_iters=4, weight_decay=0.0)
    assert train.train(args) == 0
    evals = [r["val_loss"] for r in read_metrics(out) if r["kind"] == "eval"]
    # from ln(80) = 4.38 nats at init; 30 steps of any of them reach the unigram level (~3.3)
    # or better, so a drop of 0.5 nats separates training from a broken update
    assert evals[-1] < evals[0] - 0.5, (optimizer, evals)


def test_cosine_schedule_warms_up_then_decays_to_min_lr():
    cfg = train.TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    mult = [train_config.lr_multiplier(cfg, it) for it in range(130)]
    assert mult[0] == pytest.approx(1 / 11) and mult[9] == pytest.approx(10 / 11)
    assert mult[10] == pytest.approx(1.0)  # the peak right after the warmup
    assert mult[60] == pytest.approx(0.55)  # halfway: floor + (1 - floor) / 2
    assert all(a >= b for a, b in zip(mult[10:], mult[11:], strict=False))
    assert mult[110:] == [pytest.approx(0.1)] * 20


def test_wsd_schedule_is_flat_then_decays_linearly_over_the_cooldown():
    # Bir et al.: 2% warmup, constant, linear decay to 0 over the last 10%
    cfg = train.TrainConfig(learning_rate=1.0, min_lr=0.0, lr_schedule="wsd", warmup_iters=20,
                            lr_decay_iters=1000, cooldown_iters=100)
    mult = [train_config.lr_multiplier(cfg, it) for it in range(1001)]
    assert mult[19] < 1 and all(m == 1.0 for m in mult[20:901])
    assert mult[950] == pytest.approx(0.5) and mult[1000] == 0.0
    steps = [a - b for a, b in zip(mult[900:], mult[901:], strict=False)]
    assert steps == [pytest.approx(0.01)] * 100  # linear: equal steps down to the floor


@pytest.fixture(scope="module")
def bpe_data_dir(tmp_path_factory) -> str:
    """A small GPT-2 BPE dataset (a few plays' worth of tokens out of GPT-2's 50257)."""
    import prepare_data

    plays = [text for _, text in prepare_data.shakespeare_plays()[:4]]
    path = tmp_path_factory.mktemp("bpe")
    prepare_data.write_dataset(path / "plays", {"train": plays[:3], "val": plays[3:]},
                               prepare_data.get_tokenizer("gpt2"), "test")
    return str(path)


def test_compact_vocab_trains_on_the_used_ids_and_samples_text(bpe_data_dir, tmp_path, capsys):
    args = dict(dataset="plays", compact_vocab=True, max_iters=2)
    full = lm_task.TextData(train.load_config(tiny_run_args(bpe_data_dir, "x", **{**args, "compact_vocab": False}))[0],
                          32, "cpu", True)
    compact = lm_task.TextData(train.load_config(tiny_run_args(bpe_data_dir, "x", **args))[0], 32, "cpu", True)
    used = compact.meta["token_ids"]
    assert used == sorted(set(full.arrays["train"]) | set(full.arrays["val"])) and 1024 < len(used) < 50257
    # the same window, renumbered: model id k is dataset id used[k]
    x_full, _ = full.batch("train", 3, 1)
    x_compact, _ = compact.batch("train", 3, 1)
    assert torch.equal(torch.tensor(used)[x_compact], x_full)

    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(bpe_data_dir, out, **args)) == 0
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["model_args"]["vocab_size"] == 64 * -(-len(used) // 64)  # padded to a multiple of 64
    # the untrained model spreads its probability over the used ids only: loss ~ ln(len(used))
    first_eval = read_metrics(out)[0]
    assert abs(first_eval["val_loss"] - math.log(len(used))) < 0.3
    # sample.py's main in this process (test_sample_script_prints_text_from_a_checkpoint runs it as a script)
    capsys.readouterr()
    sample_args = [f"--out_dir={out}", "--max_new_tokens=20"]
    assert sample.main([*sample_args, "--start=Enter"]) == 0
    result = capsys.readouterr()
    assert result.out.startswith("Enter") and len(result.out.splitlines()[0]) > len("Enter"), result.err
    # "KING" is one GPT-2 token that these plays never use (they write it in lower case)
    assert sample.main([*sample_args, "--start=KING"]) == 2
    assert "never occurs in the training data" in capsys.readouterr().err


def test_diagnostics_log_per_block_gradient_norms_and_at_the_end_each_blocks_skip_loss(data_dir, tmp_path):
    """The depth measures: each block's gradient norm (its parameters' norms combined) on every eval line, and
    at the last one the val loss increase when each block is left out, equal to a model built without it."""
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=4, eval_interval=2, log_diagnostics=True)) == 0
    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    for r in evals:
        for i, norm in enumerate(r["block_grad_norm"]):
            mine = [v for k, v in r["grad_norms"].items() if k.startswith(f"blocks.{i}.")]
            assert norm == pytest.approx(math.sqrt(sum(v * v for v in mine)), rel=1e-12)
    assert "block_skip_loss" not in evals[0] and len(evals[-1]["block_skip_loss"]) == 2
    for r in evals:  # the forward diagnostics, one value per block, on every eval line (values: tests/test_model.py)
        for key in ("attn_first_token_mass", "stream_max_over_median", "stream_excess_kurtosis"):
            assert len(r[key]) == 2 and all(math.isfinite(x) for x in r[key]), key
        assert all(0 < x < 1 for x in r["attn_first_token_mass"]) and all(x > 1 for x in r["stream_max_over_median"])
    model = run_files.load_checkpoint(os.path.join(out, "ckpt.pt"), "cpu")
    cfg, model_args = train.load_config(tiny_run_args(data_dir, out, max_iters=4))
    task = lm_task.make_task(cfg, model_args, "cpu", True)
    gpt = train.GPT(train.GPTConfig(**model["model_args"]))
    gpt.load_state_dict(model["model"])
    gpt.eval()
    base = train.split_loss(gpt, task, "val", train.Dist(), contextlib.nullcontext())
    for i, increase in enumerate(evals[-1]["block_skip_loss"]):
        kept = gpt.blocks
        gpt.blocks = torch.nn.ModuleList(b for j, b in enumerate(kept) if j != i)  # the model without block i
        torch.testing.assert_close(train.split_loss(gpt, task, "val", train.Dist(), contextlib.nullcontext()) - base,
                                   increase, rtol=0, atol=1e-6)  # float32 rounding of two means
        gpt.blocks = kept


def test_every_eval_line_carries_val_bpb_in_bits_per_byte_of_the_val_split(bpe_data_dir, tmp_path):
    """val_bpb = val_loss / ln 2 * the val split's tokens per byte: on ASCII text with the char tokenizer each token
    is one byte, so val_bpb = val_loss / ln 2 exactly (times 1.0); GPT-2 BPE has fewer tokens than bytes."""
    import prepare_data

    letters = "abcdefgh ijkl\n"
    rng = torch.Generator().manual_seed(0)
    text = {s: "".join(letters[i] for i in torch.randint(0, len(letters), (n,), generator=rng).tolist())
            for s, n in (("train", 3000), ("val", 600))}
    data = tmp_path / "data"
    meta = prepare_data.write_dataset(data / "ascii_char", {s: [t] for s, t in text.items()},
                                      prepare_data.get_tokenizer("char", sorted(set(letters))), "ascii")
    assert meta["val_bytes"] == meta["val_tokens"]  # ASCII: a character is a byte
    ascii_run = str(tmp_path / "ascii")
    assert train.train(tiny_run_args(str(data), ascii_run, dataset="ascii_char", max_iters=4, eval_interval=2)) == 0
    evals = [r for r in read_metrics(ascii_run) if r["kind"] == "eval"]
    assert len(evals) == 3 and all(r["val_bpb"] == r["val_loss"] / math.log(2) for r in evals)

    bpe_run = str(tmp_path / "bpe")
    assert train.train(tiny_run_args(bpe_data_dir, bpe_run, dataset="plays", max_iters=2, eval_interval=2)) == 0
    bpe = prepare_data.load_meta(os.path.join(bpe_data_dir, "plays"))
    per_byte = bpe["val_tokens"] / bpe["val_bytes"]
    assert 0.1 < per_byte < 0.5  # GPT-2 BPE on English: about four bytes a token
    for r in (r for r in read_metrics(bpe_run) if r["kind"] == "eval"):
        assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2) * per_byte, rel=1e-12)  # float64 rounding


def test_data_prepared_before_meta_recorded_bytes_counts_them_from_its_tokens(bpe_data_dir, tmp_path):
    """An older meta.json without <split>_bytes: the same tokens per byte, counted from the tokens, and meta.json
    is not rewritten."""
    import shutil

    old = tmp_path / "plays"
    shutil.copytree(os.path.join(bpe_data_dir, "plays"), old)
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if not k.endswith("_bytes")}))
    before = (old / "meta.json").read_bytes()
    settings = train.load_config(tiny_run_args(str(tmp_path), "x", dataset="plays"))[0]
    recorded = lm_task.TextData(train.load_config(tiny_run_args(bpe_data_dir, "x", dataset="plays"))[0], 32, "cpu",
                                True).tokens_per_byte
    assert lm_task.TextData(settings, 32, "cpu", True).tokens_per_byte == recorded
    assert (old / "meta.json").read_bytes() == before


def test_deterministic_run_sets_the_deterministic_kernels(data_dir, tmp_path, monkeypatch):
    """--deterministic=True: torch.use_deterministic_algorithms on, cuBLAS's fixed workspace in the environment
    before CUDA starts (a GPU resume is then bitwise), cuDNN's autotuning off; the default leaves them alone."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        assert train.train(tiny_run_args(data_dir, str(tmp_path / "plain"), max_iters=2)) == 0
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        assert train.train(tiny_run_args(data_dir, str(tmp_path / "run"), max_iters=2, deterministic=True)) == 0
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.backends.cudnn.benchmark is False
    finally:
        torch.use_deterministic_algorithms(before)

"""Every bad config value, data file or sampling option (and every bad option of optim.py's and icl_task.py's
command lines) ends with exit code 2 and one line saying what was wrong and how to fix it, never a traceback;
a setting with no effect prints one warning line."""

import json
import os
import re
import resource
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, tiny_run_args

import icl_task
import optim
import prepare_data
import sample
import train
from nanonorm import lm_task, train_config

pytestmark = pytest.mark.usefixtures("one_thread")


def exit_code_and_error(monkeypatch, capsys, argv: list[str]) -> tuple[int, str]:
    """Run train.py's main in-process: its exit code and stderr. Any other exception fails the test."""
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    return exit_info.value.code, capsys.readouterr().err


def config_file(tmp_path, text: str) -> str:
    path = tmp_path / "config.py"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("args, message", [
    (lambda tmp: [config_file(tmp, "n_layer = = 2\n")], r"config\.py, line 1: invalid syntax\. A config file holds"),
    (lambda tmp: [config_file(tmp, "n_layer = 2\nn_embd = width\n")],
     r"config\.py, line 2: NameError: name 'width' is not defined"),
    (lambda tmp: ["--n_layer=0"], r"n_layer=0 must be at least 1"),
    (lambda tmp: ["--n_embd=-8"], r"n_embd=-8 must be at least 1"),
    (lambda tmp: ["--n_head=0"], r"n_head=0 must be at least 1"),  # was a ZeroDivisionError
    (lambda tmp: ["--block_size=0"], r"block_size=0 must be at least 1"),
    (lambda tmp: ["--batch_size=0"], r"batch_size=0 must be at least 1"),
    (lambda tmp: ["--device=cpux"], r"device='cpux' is not valid; choose auto, cpu, cuda, cuda:N or mps"),
    (lambda tmp: ["--betas=(1.0, 0.95)"], r"betas=\(1\.0, 0\.95\) must be two numbers in \[0, 1\)"),
    (lambda tmp: ["--optimizer=muon", "--betas=(0.9,)"], r"betas=\(0\.9,\) must be two numbers in \[0, 1\)"),
    (lambda tmp: ["--optimizer=sgdw", "--momentum=1.0"], r"momentum=1\.0 must lie in \[0, 1\)"),
    (lambda tmp: ["--learning_rate=1e-3", "--min_lr=1e-2"], r"min_lr=0\.01 is above learning_rate=0\.001"),
    (lambda tmp: ["--norm_eps=-1e-5"], r"norm_eps=-1e-05 must be positive"),
    (lambda tmp: ["--dist_timeout=0"], r"dist_timeout=0\.0 must be a positive number of seconds"),
    (lambda tmp: ["--out_dir=''"], r"out_dir is empty; give the run a folder with --out_dir=PATH"),
    (lambda tmp: [config_file(tmp, "grad_clip = float('nan')\n")], r"'grad_clip' expects a finite number, got nan"),
    (lambda tmp: [config_file(tmp, "weight_decay = float('inf')\n")], r"'weight_decay' expects a finite number"),
    (lambda tmp: ["--learning_rate=1e999"], r"'learning_rate' expects a finite number, got inf"),
    (lambda tmp: [f"--dist_timeout={10**400}"], r"'dist_timeout' expects a finite number, got inf"),
    (lambda tmp: ["--optimizer=muon", "--matrix_lr=0"], r"matrix_lr=0\.0 must be positive, or None"),
    (lambda tmp: ["--optimizer=muon", "--ns_steps=0"], r"ns_steps=0 must be at least 1"),
    (lambda tmp: ["--optimizer=manifold_muon", "--dual_steps=0"], r"dual_steps=0 must be at least 1"),
    (lambda tmp: ["--optimizer=manifold_muon", "--ns_steps=0"], r"ns_steps=0 must be at least 1"),
    (lambda tmp: ["--optimizer=manifold_muon", "--dual_lr=-0.1"], r"dual_lr=-0\.1 must not be negative"),
    (lambda tmp: ["--seed=-1"], r"seed=-1 must lie in \[0, 2\*\*32\)"),
    (lambda tmp: [f"--seed={2**32}"], r"seed=4294967296 must lie in \[0, 2\*\*32\)"),  # 2**32 + 1 would alias 1
    (lambda tmp: [f"--gradient_accumulation_steps={2**63}"], r"'gradient_accumulation_steps' expects a number below"),
    (lambda tmp: ["--device=cpu:1"], r"device='cpu:1' is not valid; choose auto, cpu, cuda, cuda:N or mps"),
    (lambda tmp: ["--eval_interval=4", "--keep_every=3"], r"keep_every=3 must be a multiple of eval_interval=4"),
    (lambda tmp: ["--task=icl", "--icl_pairs=3"], r"icl_pairs=3 is below the task's dimension 5"),
    (lambda tmp: ["--norms=pre+qq"], r"norms='pre\+qq' is not valid: give places from input, pre"),
    (lambda tmp: ["--norm_alpha_init=(0.5, 0.2)"], r"norm_alpha_init=\(0\.5, 0\.2\) must be a positive"),
    (lambda tmp: ["--branch_scale=0"], r"branch_scale=0\.0 must be positive"),
    (lambda tmp: ["--task=icl", "--embed_fan_in=7"], r"key .embed_fan_in.; embed_fan_in is set by the task"),
    (lambda tmp: ["--in_features=3"], r"unknown config key 'in_features'; in_features is set by the task"),
    (lambda tmp: ["--vocab_size=3"], r"unknown config key 'vocab_size'; vocab_size is set by the task and its data"),
])
def test_bad_config_exits_2_with_one_line(monkeypatch, capsys, tmp_path, args, message):
    code, err = exit_code_and_error(monkeypatch, capsys, args(tmp_path))
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_a_text_key_keeps_its_text_as_written():
    cfg, model_args = train.load_config(["--out_dir=2024", "--dataset=1e-3", "--norms=pre+final"])
    assert (cfg.out_dir, cfg.dataset) == ("2024", "1e-3")  # not 2024 (int) refused, nor 0.001
    assert model_args["overrides"] == {"norms": "pre+final"}


def test_a_device_this_machine_lacks_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = exit_code_and_error(monkeypatch, capsys, ["--device=cuda"])
    assert (code, err) == (2, "error: device='cuda', but this machine has no cuda device; use --device=cpu or auto\n")


@pytest.mark.parametrize("below_a_file, message", [
    ("", r"is a file, not a folder; choose another --out_dir"),
    ("run", r"cannot write to out_dir .*run' \(Not a directory\); choose a writable --out_dir"),
])
def test_out_dir_that_cannot_hold_a_run_exits_2(monkeypatch, capsys, data_dir, tmp_path, below_a_file, message):
    (tmp_path / "file").write_text("not a folder")
    out = str(tmp_path / "file" / below_a_file)
    code, err = exit_code_and_error(monkeypatch, capsys, tiny_run_args(data_dir, out))
    assert code == 2 and re.search(message, err), err


def test_a_model_too_big_for_memory_exits_2(monkeypatch, capsys, data_dir, tmp_path):
    def allocator_fails(self, config):  # what torch's CPU allocator raises for --n_embd=100000
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(train.GPT, "__init__", allocator_fails)
    code, err = exit_code_and_error(monkeypatch, capsys, tiny_run_args(data_dir, str(tmp_path / "run")))
    assert code == 2 and "does not fit in cpu's memory; make it smaller" in err and err.count("\n") == 1


def test_norm_eps_0_is_refused():
    with pytest.raises(train.ConfigError, match=r"norm_eps=0\.0 must be positive"):  # was a division by 0 at RMS 0
        train.load_config(["--norm_eps=0"])


def test_a_batch_too_big_for_memory_exits_2(data_dir, tmp_path):
    """--batch_size=100000000: refused before anything is allocated, not an allocator traceback (nor the kernel's
    OOM kill); the address space is capped so that a regression fails here instead of filling the machine. The
    ICL task (whose fixed eval sets add to the need) as a train.py process; the language model's refusal by the
    same check, which train.run makes for both tasks before building either, is called here directly (nothing
    allocated in this process even if it failed to refuse)."""
    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    args = tiny_run_args(data_dir, str(tmp_path / "run"), batch_size=100_000_000, task="icl", icl_pairs=16)
    result = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, preexec_fn=cap_memory, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "batch_size=100000000 needs at least" in result.stderr and "lower --batch_size" in result.stderr
    cfg, model_args = train.load_config(tiny_run_args(data_dir, str(tmp_path / "run"), batch_size=100_000_000))
    with pytest.raises(train.ConfigError, match=r"^batch_size=100000000 needs at least .*lower --batch_size"):
        lm_task.check_batch_fits(cfg, model_args, "cpu")


def test_the_icl_demo_with_a_batch_too_big_for_memory_exits_2():
    """icl_task.py --batch_size=100000000 (128 GB of X): the allocator's refusal becomes one line and exit 2, with
    the address space capped as above."""
    result = subprocess.run([sys.executable, "icl_task.py", "--batch_size", "100000000"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)))
    last = result.stderr.rstrip("\n").splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--batch_size 100000000 of 64 pairs needs more memory than this machine has" in last, result.stderr


# ----------------------------------------------------------------------------- token data


@pytest.fixture
def tiny_dataset(tmp_path):
    """data_dir/tiny: 10 characters, long enough for block_size 32."""
    tokenizer = prepare_data.get_tokenizer("char", sorted("abcdefgh \n"))
    prepare_data.write_dataset(tmp_path / "tiny", {"train": ["abcdefgh " * 20], "val": ["hgfedcba " * 8]},
                               tokenizer, "test")
    return tmp_path / "tiny"


def poke_token(path, value: int) -> None:
    data = np.fromfile(path, dtype=np.uint16)
    data[3] = value
    data.tofile(path)


def shrink_vocab(path) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta["chars"] = meta["chars"][:-1]  # meta.json still says vocab_size 10
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt, message", [
    (lambda d: poke_token(d / "val.bin", 999), r"val\.bin holds token id 999, outside meta\.json's vocabulary of 10"),
    (lambda d: poke_token(d / "train.bin", 10), r"train\.bin holds token id 10, outside meta\.json's vocabulary of 10"),
    (shrink_vocab, r"meta\.json does not fit its tokenizer: meta\.json says vocab_size 10, but the char "
                   r"tokenizer has 9"),
])
def test_token_data_outside_its_vocabulary_exits_2_with_the_rebuild_command(monkeypatch, capsys, tiny_dataset,
                                                                             corrupt, message):
    corrupt(tiny_dataset)
    argv = tiny_run_args(str(tiny_dataset.parent), str(tiny_dataset.parent / "run"), dataset="tiny", max_iters=2)
    code, err = exit_code_and_error(monkeypatch, capsys, argv)
    assert code == 2 and re.search(message, err), err
    assert "Rebuild it with:\n  python prepare_data.py tiny --input PATH" in err and "--force" in err


def test_an_embedded_dataset_that_cannot_be_prepared_exits_2(monkeypatch, capsys, tmp_path):
    """A read-only --data_dir (simulated: root may write anywhere)."""
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(prepare_data, "prepare", read_only)
    code, err = exit_code_and_error(monkeypatch, capsys, tiny_run_args(str(tmp_path / "ro"), str(tmp_path / "run")))
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(r"cannot prepare shakespeare_char in .*ro/shakespeare_char \(Permission denied\); give a "
                     r"writable --data_dir", err), err


def test_the_final_sample_starts_without_a_newline_token(capsys):
    """A char vocabulary without "\\n" (and no end-of-text token): the sample starts from id 0."""
    meta = {"tokenizer": "char", "vocab_size": 3, "chars": ["a", "b", "c"]}
    model = train.GPT(train.GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=3))
    lm_task.print_sample(model, meta, 5, "cpu")
    text = capsys.readouterr().out.split("\n")[1]
    assert len(text) == 6 and text[0] == "a" and set(text) <= set("abc")


# ----------------------------------------------------------------------------- settings without effect


def test_a_setting_without_effect_prints_one_warning_line(capsys):
    train.load_config(["--optimizer=adamw", "--matrix_lr=0.1", "--geonorm_clamp=0.5", "--learning_rate=1e-3"])
    assert capsys.readouterr().err == ("warning: no effect in this run: matrix_lr (only with optimizer muon or "
                                       "manifold_muon), geonorm_clamp (only with the geodesic step "
                                       "(norm_scheme='geonorm'))\n")
    train.load_config(["--optimizer=muon", "--matrix_lr=0.1", "--norm_scheme=geonorm", "--geonorm_clamp=0.5"])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("args, unused", [
    (["--norm_scheme=none", "--norm=rmsnorm", "--norm_eps=1e-6"], ["norm", "norm_eps"]),  # no norm anywhere
    (["--norm_scheme=ngpt", "--norm=rmsnorm", "--norm_eps=1e-6"], ["norm", "norm_eps"]),  # its own unit norms
    (["--norm=dyt", "--norm_eps=1e-6"], ["norm_eps"]),  # DyT divides by nothing
    (["--norm_scheme=lipschitz", "--norm_affine=False"], ["norm_affine"]),
    (["--norm_scheme=none", "--first_blocks=post", "--n_layer=3", "--norm=rmsnorm"], ["norm"]),  # 0 Post-Norm blocks
    (["--norm_scheme=none", "--first_blocks=post", "--n_layer=4", "--norm=rmsnorm"], []),  # floor(0.25 * 4) = 1
    (["--norm_scheme=none", "--norm=dyt", "--embed_scale=True"], ["norm"]),  # embed_scale is its own key
    (["--norm_scheme=geonorm", "--pre_norm_scale=1/sqrt(l)"], []),  # scales the sub-layer input, norm or not
    (["--norm_scheme=dnt", "--norm=dyt", "--norm_eps=1e-6"], []),  # its q/k RMSNorms take the eps
    (["--norm_scheme=rezero", "--norms=qk", "--norm_eps=1e-6", "--norm_affine=False"], []),
    (["--norm_scheme=mixln", "--norm=rmsnorm", "--norms=pre+qk_all+final"], []),
    (["--norm=rmsnorm", "--norm_alpha_init=0.2"], ["norm_alpha_init"]),
])
def test_a_norm_setting_the_scheme_never_uses_is_named(capsys, args, unused):
    """And what the warning names indeed changes nothing: the model built without those flags has the same
    parameters and, from the same seed (weights perturbed, so a zero init hides nothing), the same output."""
    train.load_config(args)
    err = capsys.readouterr().err
    named = re.findall(r"(\w+) \(only with", err)
    assert named == unused, err

    def output(flags: list[str]) -> tuple[list, torch.Tensor]:
        _, chosen = train.load_config(flags)
        torch.manual_seed(0)
        small = dict(n_layer=chosen.get("n_layer", 2), n_head=2, n_embd=16, block_size=8, vocab_size=32)
        model = train.GPT(train.GPTConfig(**{**chosen, **small}))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
            logits, _ = model(torch.arange(16).view(2, 8) % 32)
        return [(k, v.shape) for k, v in model.state_dict().items()], logits

    if unused:
        kept = [a for a in args if a[2:].split("=")[0] not in unused]
        (params, logits), (params_without, logits_without) = output(args), output(kept)
        assert params == params_without and torch.equal(logits, logits_without)


def test_every_effect_condition_names_a_config_key_and_runs_on_defaults():
    """A row for a misspelt key would never fire; every condition must evaluate on the default configs."""
    keys = set(train_config.KEYS)
    assert set(train_config.TAKES_EFFECT) <= keys
    defaults = train_config.TrainConfig(), train.GPTConfig()
    for effective, words in train_config.TAKES_EFFECT.values():
        assert isinstance(effective(*defaults), bool) and words


# ----------------------------------------------------------------------------- optimizer param groups


def test_a_rejected_param_group_leaves_the_optimizer_as_it_was():
    matrix, gain = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.ones(4))
    muon = optim.Muon([matrix], adamw_params=[])
    manifold = optim.ManifoldMuon([torch.nn.Parameter(torch.randn(4, 4))], adamw_params=[])
    for optimizer, group, message in [
        (muon, {"params": [gain]}, "'matrix' groups take 2-D parameters only"),
        (muon, {"params": [torch.nn.Parameter(torch.randn(3, 3))], "adjust_lr": "match_rms_adam"},
         "adjust_lr must be one of"),
        (muon, {"params": [gain], "kind": "adamw", "betas": (0.9, 1.0)}, r"betas=\(0\.9, 1\.0\) of an 'adamw' group"),
        (manifold, {"params": [torch.nn.Parameter(torch.randn(3, 3))], "weight_decay": 0.1}, "take no weight decay"),
    ]:
        before = len(optimizer.param_groups)
        with pytest.raises(ValueError, match=message):
            optimizer.add_param_group(group)
        assert len(optimizer.param_groups) == before


def test_muon_adamw_side_refuses_betas_outside_0_1():
    with pytest.raises(ValueError, match=r"betas=\(1\.2, 0\.95\) of an 'adamw' group must lie in \[0, 1\)"):
        optim.Muon([torch.nn.Parameter(torch.randn(4, 4))], adamw_params=[torch.nn.Parameter(torch.ones(4))],
                   adamw_betas=(1.2, 0.95))


# ----------------------------------------------------------------------------- sample.py


@pytest.fixture(scope="module")
def trained_run(data_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sample") / "run")
    assert train.train(tiny_run_args(data_dir, out, max_iters=2, eval_interval=2)) == 0
    return out


@pytest.mark.parametrize("option, message", [
    ("--top_k=0", r"--top_k=0 must be at least 1"),
    ("--start=", r"the prompt is empty"),
    ("--start=FILE:no/such/prompt.txt", r"cannot read the prompt file 'no/such/prompt\.txt' \(No such file"),
    ("--temperature=-1", r"--temperature=-1\.0 must be a number >= 0"),
    ("--temperature=nan", r"--temperature=nan must be a number >= 0"),
    ("--max_new_tokens=-1", r"--max_new_tokens=-1 must not be negative"),
    ("--num_samples=0", r"--num_samples=0 must be at least 1"),
    ("--seed=-1", r"--seed=-1 must lie in \[0, 2\*\*64\)"),
    ("--device=foo", r"--device='foo' is not valid; choose auto, cpu, cuda, cuda:N or mps"),
    ("--device=cpu:1", r"--device='cpu:1' is not valid"),
    ("--device=cuda:99", r"--device='cuda:99', but this machine has (no cuda device|\d+ cuda device)"),
])
def test_bad_sampling_options_exit_2_with_one_line(capsys, trained_run, option, message):
    assert sample.main([f"--out_dir={trained_run}", "--max_new_tokens=2", "--device=cpu", option]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and re.search(message, out.err), out.err


def test_an_option_the_optimizer_refuses_exits_2(monkeypatch, capsys, data_dir, tmp_path):
    import optim

    def refuses(*args, **kwargs):  # every value the config lets through is valid today: stand in for a refusal
        raise ValueError("momentum=0.5 does not suit this optimizer")

    monkeypatch.setattr(optim, "build_optimizer", refuses)
    args = tiny_run_args(data_dir, str(tmp_path / "run"), optimizer="manifold_muon")
    code, err = exit_code_and_error(monkeypatch, capsys, args)
    assert code == 2 and err.startswith("error: optimizer manifold_muon:") and err.count("\n") == 1, err


@pytest.mark.parametrize("script, argv, message", [
    (optim, ["--steps", "0"], r"--steps 0 must be at least 1"),
    (optim, ["--warmup", "-1"], r"--warmup -1 must be at least 0"),
    (optim, ["--optimizers", "adamw,lion"], r"unknown optimizer\(s\) lion; choose from: adamw, sgdw, muon"),
    (optim, ["--device", "tpu"], r"--device tpu is not one the benchmarks time; give cpu, cuda or cuda:N"),
    (icl_task, ["--dim", "0"], r"--dim 0 must be at least 1"),
    (icl_task, ["--batch_size", "-4"], r"--batch_size -4 must be at least 1"),
    (icl_task, ["--n_pairs", "3"], r"--n_pairs 3 is below --dim 5: .* give --n_pairs of at least --dim"),
])
def test_benchmark_and_demo_options_exit_2_with_one_line(monkeypatch, capsys, script, argv, message):
    monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    out = capsys.readouterr()
    last = out.err.rstrip("\n").splitlines()[-1]  # argparse prints the usage, then one error line
    assert exit_info.value.code == 2 and out.out == "" and re.search(message, last), out.err

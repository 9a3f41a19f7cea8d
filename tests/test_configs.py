"""Every file in configs/ loads and trains for 2 iterations at a tiny size, so no config rots."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

import train
from nanonorm import train_config

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
TINY = dict(n_layer=2, n_head=2, n_embd=32, batch_size=2, gradient_accumulation_steps=1, max_iters=2,
            eval_interval=2, eval_iters=1, log_interval=1, compile=False, sample_tokens=0, warmup_iters=1,
            lr_decay_iters=2, block_size=16)


def overrides(settings: dict) -> list[str]:
    return [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in settings.items()]


def test_the_papers_main_configs_exist():
    names = {os.path.basename(c) for c in CONFIGS}
    assert {"quickstart.py", "geonorm_125m.py", "dnt_124m_adamw.py", "gpt2_124m_msgdw.py"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_trains_two_iterations_at_tiny_size(path, data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs import configs.<base> relative to the repository root
    cfg, model_args = train.load_config([path])
    tiny = dict(TINY, out_dir=str(tmp_path / "run"))
    if cfg.task == "icl":
        tiny.update(icl_pairs=6)
    else:  # the paper configs name corpora that need a download; the embedded one stands in
        tiny.update(dataset="shakespeare_char", data_dir=data_dir, block_size=16)
    assert train.train([path, *overrides(tiny)]) == 0


def test_help_lists_every_key_once_with_its_default_and_what_it_does(monkeypatch, capsys):
    """train.py's main in this process: the script's entry point itself runs in every subprocess test."""
    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    out = capsys.readouterr()
    assert exit_info.value.code == 0, out.err
    lines = [line for line in out.out.splitlines() if line.lstrip().startswith("--")]
    keys = [re.match(r"\s*--(\w+)=", line).group(1) for line in lines]
    assert sorted(keys) == sorted(train_config.KEYS) and len(keys) == len(set(keys))
    # nanoGPT has 33 keys; every one here must earn its place (78, then attn_gate, attn_sink and embed_proj;
    # wandb_project and wandb_group, nanoGPT's live view; deterministic, for a bitwise resume on a GPU)
    assert len(keys) <= 84
    for line in lines:  # --key=default, two spaces, then what it does
        assert re.match(r"\s*--\w+=\S.*?  \S.{10,}$", line), line


def test_a_new_scheme_is_one_line_appended_to_model_py(tmp_path, data_dir):
    """SCHEMES["my_norm"] = ... at the end of model.py trains with --norm_scheme=my_norm, no other edit."""
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    shutil.copytree(os.path.join(ROOT, "nanonorm"), tmp_path / "nanonorm")
    with open(tmp_path / "model.py", "a") as f:
        f.write('\nSCHEMES["my_norm"] = Scheme("pre+qk+final", init="xavier")\n')
    args = [f"--{k}={v}" for k, v in TINY.items()] + ["--norm_scheme=my_norm", "--dataset=shakespeare_char",
                                                      f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}"]
    out = subprocess.run([sys.executable, "train.py", *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("my_norm / layernorm:"), out.stdout

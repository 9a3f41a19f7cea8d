"""Every file in configs/ loads and trains for 2 iterations at a tiny size, so no config rots."""

import glob
import os

import pytest
from conftest import ROOT

import train

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
TINY = dict(n_layer=2, n_head=2, n_embd=32, batch_size=2, gradient_accumulation_steps=1, max_iters=2,
            eval_interval=2, eval_iters=1, log_interval=1, compile=False, sample_tokens=0, warmup_iters=1,
            lr_decay_iters=2)


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

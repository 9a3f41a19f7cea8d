"""Shared fixtures: the embedded corpus prepared once per test session, and tiny run settings."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
    """A data folder holding shakespeare_char, prepared from the embedded corpus."""
    import prepare_data

    path = str(tmp_path_factory.mktemp("data"))
    prepare_data.prepare("shakespeare", tokenizer="char", data_dir=path)
    return path


def tiny_run_args(data_dir: str, out_dir: str, **overrides) -> list[str]:
    """train.py arguments for a run of a few seconds on the char corpus."""
    settings = dict(dataset="shakespeare_char", data_dir=data_dir, out_dir=out_dir, n_layer=2, n_head=2,
                    n_embd=32, block_size=32, batch_size=4, max_iters=8, lr_decay_iters=8, warmup_iters=2,
                    eval_interval=4, eval_iters=2, log_interval=1, learning_rate=1e-3, dropout=0.0)
    settings.update(overrides)
    return [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in settings.items()]


@pytest.fixture(scope="session", autouse=True)
def cpu_peak_measured_once():
    """train.py measures the CPU's matmul peak (the MFU denominator: 2048^3 matmuls, about a second) at the start
    of every run; the in-process runs of a session reuse the first measurement per dtype and thread count, as
    the machine's peak does not change between them. Subprocess runs (and diagnostics.device_peak_flops itself,
    which tests call directly) still measure."""
    import torch

    import train

    measure, measured = train.device_peak_flops, {}

    def once(device: str, dtype: torch.dtype = torch.float32) -> float:
        if device != "cpu":
            return measure(device, dtype)
        key = (dtype, torch.get_num_threads())
        if key not in measured:
            measured[key] = measure(device, dtype)
        return measured[key]

    train.device_peak_flops = once
    yield
    train.device_peak_flops = measure


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and so do the subprocesses (OMP_NUM_THREADS=1): a second
    thread only spins against other work on a shared machine (a 30-step tiny run took 0.4 s on one thread and
    20-30 s on two with the other core busy). Every test of the session runs so; modules that name the fixture
    (pytest.mark.usefixtures) say that they rely on it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""The GPU paths: what can be checked on a CPU (the DDP and compile order, the peak table, bench's compiled
labels) runs in the default suite; what needs a GPU is marked `cuda` and skips without one.

    python -m pytest -m cuda            # on a machine with a CUDA GPU (python gpu_report.py runs it)
"""

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_run_args
from torch._dynamo.eval_frame import OptimizedModule
from torch.nn.parallel import DistributedDataParallel as DDP

import bench
import train
from model import GPT, GPTConfig
from nanonorm import diagnostics, guards

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny_config(**changes) -> GPTConfig:
    return GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, bias=False, **changes)


def test_ddp_is_wrapped_before_compile(monkeypatch):
    """torch.compile(DDP(model)), not DDP(torch.compile(model)): only a compiled DDP module lets dynamo split the
    graph at DDP's gradient buckets (its all-reduce overlapping the backward)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = GPT(tiny_config())
        wrapped = train.wrap_model(model, guards.Dist(rank=0, local_rank=0, world_size=2), "cpu", compiled=True)
        assert isinstance(wrapped, OptimizedModule) and isinstance(wrapped._orig_mod, DDP)
        assert wrapped._orig_mod.module is model and wrapped._orig_mod.gradient_as_bucket_view
        assert train.wrap_model(model, guards.Dist(), "cpu", compiled=False) is model  # one process, eager: as is
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name, dtype, tf32, tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, True, 989), ("NVIDIA H100 PCIe", torch.bfloat16, True, 756),
    ("NVIDIA H100 NVL", torch.float32, True, 418), ("NVIDIA H200", torch.float32, False, 67),
    ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156), ("NVIDIA A10", torch.bfloat16, True, 125)])
def test_peak_flops_by_device_and_dtype(monkeypatch, name, dtype, tf32, tflops):
    """MFU's denominator: the datasheet dense peak of this GPU for the run's dtype (float32 on TF32 tensor
    cores or not), never the bf16 peak for a float32 run or an SXM peak for a PCIe card."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        assert diagnostics.device_peak_flops("cuda", dtype) == tflops * 1e12
    finally:
        torch.set_float32_matmul_precision(precision)


def test_bench_labels_how_each_case_ran():
    """Eager says eager; compiled says how many graphs dynamo made (here from a stand-in function: one graph, then
    a graph break's two more)."""
    assert bench.how_it_ran(lambda: None, compiled=False) == "eager"

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    torch._dynamo.reset()
    one, two = torch.compile(lambda x: x + 1, backend="eager"), torch.compile(broken, backend="eager")
    x = torch.ones(3)
    assert bench.how_it_ran(lambda: one(x), compiled=True) == "compiled, 1 graph"
    assert bench.how_it_ran(lambda: one(x), compiled=True) == "compiled (reused)"
    assert bench.how_it_ran(lambda: two(x), compiled=True) == "compiled, 2 graphs, 1 break"


def test_bench_fails_rather_than_run_eager_past_the_recompile_limit():
    """Past dynamo's recompile limit a function silently runs eager; inside compiling_many that is an error."""
    torch._dynamo.reset()
    f = torch.compile(lambda x, k: x * k, backend="eager", dynamic=False)
    with bench.compiling_many(1), pytest.raises(Exception, match="recompile_limit|cache_size_limit"):
        for k in range(torch._dynamo.config.recompile_limit + 1):
            f(torch.ones(k + 1), k)  # a new shape and constant each call: a recompile each


@pytest.mark.compile
def test_two_compiled_ranks_match_one_process(data_dir, tmp_path):
    """torch.compile over DDP (two gloo ranks) trains as one compiled process does: the same global batches, so
    the same losses up to the order of float sums (1e-5 relative)."""
    from test_resume import finish, launch, losses

    settings = dict(gradient_accumulation_steps=2, compile=True, max_iters=4, eval_interval=4)
    runs = {n: str(tmp_path / f"ranks{n}") for n in (1, 2)}
    finish([(launch(n, tiny_run_args(data_dir, out, **settings), f"{out}.log"), f"{out}.log")
            for n, out in runs.items()])
    one, two = losses(runs[1]), losses(runs[2])
    assert one.keys() == two.keys() and ("loss", 4) in one
    assert two == pytest.approx(one, rel=1e-5)


def test_gpu_report_without_cuda_exits_2(monkeypatch, capsys, tmp_path):
    import gpu_report

    (tmp_path / "mine.md").write_text("a user's notes")
    with pytest.raises(SystemExit) as e:  # never written over, nor its logs' folder
        gpu_report.main(["--report", str(tmp_path / "mine.md")])
    assert e.value.code == 2 and "exists; give another --report" in capsys.readouterr().err
    assert (tmp_path / "mine.md").read_text() == "a user's notes"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_report.main(["--report", os.devnull + "-none.md"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert gpu_report.main(["--dry_run"]) == 0
    assert "torchrun" in capsys.readouterr().out


@pytest.mark.parametrize("budget", [540, 300, 900])
def test_gpu_report_parts_fit_the_budget(budget, capsys):
    """The phases run one after another: the limit of phase 1 (its parts side by side), 2 and 3 and the report's
    own start add up to the budget at most, and every part gets time; the dry run prints each part's estimate and
    limit. The resume check runs with deterministic kernels (a GPU resume can then be bitwise)."""
    import gpu_report

    limits = gpu_report.part_limits(budget)
    phase_limits = {phase: max(limits[part] for part, p, _ in gpu_report.PARTS if p == phase) for phase in (1, 2, 3)}
    assert sum(phase_limits.values()) + gpu_report.STARTUP_S <= budget + 1e-9  # 1e-9: the float sum of the shares
    assert all(limit > 0 for limit in limits.values()) and len(limits) == 5
    assert gpu_report.main(["--budget", str(budget), "--dry_run"]) == 0
    out = capsys.readouterr().out
    for part, phase, estimate in gpu_report.PARTS:
        assert f"{phase}. {part}" in out and f"~{estimate} s, limit {limits[part]:.0f} s" in out
    estimated = sum(gpu_report.phase_estimates().values()) + gpu_report.STARTUP_S
    assert ("within the budget" in out) == (estimated <= budget) and "--deterministic=True" in out


# ----------------------------------------------------------------------------- on a CUDA GPU


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["geonorm", "ngpt", "dnt"])
def test_compiled_step_matches_eager_on_cuda(scheme):
    """Inductor's CUDA kernels keep the math: float32 logits and gradients as eager's (TF32 off: both sides in
    full float32, so differences are summation order, ~1e-6 relative). (GeoNorm's and nGPT's
    updates among them)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        torch.manual_seed(0)
        model = GPT(tiny_config(norm_scheme=scheme)).cuda()
        idx = torch.randint(0, 64, (4, 16), device="cuda")
        logits, loss = torch.compile(model, dynamic=False)(idx, idx)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        eager_logits, eager_loss = model(idx, idx)
        eager_loss.backward()
        torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-5)
        for n, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-3, atol=1e-5)
    finally:
        torch.set_float32_matmul_precision(precision)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["pre", "dnt", "geonorm"])
def test_bf16_autocast_loss_is_near_float32_on_cuda(scheme):
    """bf16 autocast keeps 8 bits of mantissa: a 2-layer model's loss moves by well under 1%."""
    torch.manual_seed(0)
    model = GPT(tiny_config(norm_scheme=scheme)).cuda()
    idx = torch.randint(0, 64, (8, 16), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, low = model(idx, idx)
    _, full = model(idx, idx)
    assert abs(low.item() - full.item()) < 0.01 * full.item()


@cuda
@pytest.mark.cuda
def test_peak_flops_knows_this_gpu():
    """The GPU this runs on is in the peak table, so its MFU is a number (add a row for a new GPU)."""
    peak = diagnostics.device_peak_flops
    bf16, fp32 = peak("cuda", torch.bfloat16), peak("cuda", torch.float32)
    assert math.isfinite(bf16) and bf16 > fp32 > 0, torch.cuda.get_device_name()


@cuda
@pytest.mark.cuda
def test_a_run_on_cuda_compiles_by_default_and_logs_mfu(data_dir, tmp_path):
    """compile=None compiles on CUDA; the first step (the compile) is kept out of the timed lines."""
    out = str(tmp_path / "run")
    assert train.train(tiny_run_args(data_dir, out, device="cuda", dtype="bfloat16")) == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [r for r in map(json.loads, f) if r["kind"] == "train"]
    assert "mfu" not in lines[0] and all(0 < r["mfu"] < 1 for r in lines[1:])

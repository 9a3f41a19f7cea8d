"""
Measurements that leave the model as it was: a measuring forward runs in eval mode with its hooks removed
and the model's mode restored afterwards, whatever happens; gradient statistics only read the gradients.

Every evaluation logs residual_stream_metrics (block_activation_rms: the residual stream's RMS after each
block, Bir et al. Fig. 3; max_attention_logits: each block's largest attention logit, the growth QK-norm
bounds). With log_diagnostics, written to the eval lines as well: gradient_statistics (per-parameter
gradient norms and the tail of |g|, DNT Fig. 1, from the gradients that iteration's step applies) and
forward_diagnostics: per block the attention mass on the first token (the attention sink), the stream's largest
|activation| over its median (massive activations) and its excess kurtosis (outlier channels), and, on a
geodesic model, geonorm_angles (GeoNorm's theta' per layer); each costs one extra forward (and backward)
per evaluation. device_peak_flops gives the matmul peak that MFU is measured against.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from model import GPT, CausalSelfAttention, GeodesicStep, SphereAttention

GRAD_HIST_LOG10_EDGES = list(range(-12, 1))  # |g| histogram: <1e-12, [1e-12, 1e-11), ..., >=1


def forward_with_hooks(model: nn.Module, inputs: torch.Tensor, handles: list) -> None:
    """One forward pass in eval mode for the hooks just registered (`handles`), which are removed after it,
    whatever happens; the model's mode is restored."""
    training = model.training
    model.eval()
    try:
        model(inputs)
    finally:
        model.train(training)
        for h in handles:
            h.remove()


@torch.no_grad()
def max_attention_logits(model: GPT, inputs: torch.Tensor) -> list[float]:
    """Each block's largest attention logit, scale * <q_i, k_j> over heads and causal pairs j <= i, on one
    batch: the logit growth that precedes the attention collapse QK-norm is meant to prevent (Dehghani
    et al. 2023; Wortsman et al. 2023 follow it at small scale). Read from a hook on each attention's input."""
    found: list[torch.Tensor] = []

    def record(attn: nn.Module, args: tuple) -> None:
        q, k, _ = attn.heads(args[0])
        logits = (q.float() @ k.float().transpose(-2, -1)) * attn.scale
        T = logits.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool, device=logits.device).tril()
        found.append(logits.masked_fill(~causal, -math.inf).amax())

    forward_with_hooks(model, inputs, [m.register_forward_pre_hook(record) for m in model.modules()
                                       if isinstance(m, (CausalSelfAttention, SphereAttention))])
    return torch.stack(found).tolist() if found else []


@torch.no_grad()
def block_activation_rms(model: GPT, inputs: torch.Tensor) -> list[float]:
    """RMS of the residual stream after each block (Bir et al. Fig. 3), from one forward pass in eval mode."""
    rms: list[torch.Tensor] = []
    def record(block: nn.Module, args: tuple, out: torch.Tensor) -> None:
        rms.append(out.float().square().mean())

    forward_with_hooks(model, inputs, [b.register_forward_hook(record) for b in model.blocks])
    return torch.stack(rms).sqrt().tolist()


def residual_stream_metrics(model: GPT, inputs: torch.Tensor) -> dict[str, list[float]]:
    """The eval line's per-block metrics on one batch: the residual stream's RMS after each block (Bir et al.
    Fig. 3), and each block's largest attention logit (the growth QK-norm bounds)."""
    return {"block_rms": block_activation_rms(model, inputs), "attn_logit_max": max_attention_logits(model, inputs)}


def first_token_mass(weights: torch.Tensor) -> torch.Tensor:
    """The attention sink's measure: the mean over batch, heads and queries of the weight each query gives key 0, from
    causal attention weights (..., T, T). Query 0 is left out: its only key is itself, mass 1 in every model."""
    return weights[..., 1:, 0].float().mean()


def max_over_median(x: torch.Tensor) -> torch.Tensor:
    """Massive activations (Sun et al. 2024): the largest |x| over the median |x|, over every entry of x."""
    a = x.detach().float().abs().flatten()
    return a.max() / a.median()


def excess_kurtosis(x: torch.Tensor) -> torch.Tensor:
    """Outlier channels (OSP's measure): each vector's excess kurtosis over its channels (the last dim),
    E[(x - mean)^4] / Var^2 - 3 with population moments (0 for a Gaussian, 27 for one spike among 32 channels),
    averaged over the vectors. OSP's evaluate_kurtosis.py also takes the raw fourth moment over the (unbiased) std
    and clips each token's value at 0; neither here, so that a Gaussian stream reads 0."""
    centered = x.detach().float() - x.detach().float().mean(-1, keepdim=True)
    variance = centered.square().mean(-1)
    return (centered.pow(4).mean(-1) / variance.square() - 3).mean()


def attention_weights(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The weights (B, heads, T, T) an attention module gives each key on its input x, as its forward computes
    them (softcap and sink included; nGPT's: the plain causal softmax of its scaled unit q, k)."""
    q, k, _ = attn.heads(x)
    if isinstance(attn, CausalSelfAttention):
        return attn.attend.weights(q, k)
    scores = (q.float() @ k.float().transpose(-2, -1)) * attn.scale
    T = scores.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
    return torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)


@torch.no_grad()
def stream_statistics(model: GPT, inputs: torch.Tensor) -> dict[str, list[float]]:
    """From one forward pass in eval mode, per block: the attention mass on the first token (first_token_mass: the
    sink gated attention and learned sinks are claimed to remove), and of the block's output stream its largest
    |activation| over its median (max_over_median) and its excess kurtosis over the channels (excess_kurtosis).
    The stream is what each block hands on: nGPT's unit-norm h, GeoNorm's stream, hyper-connections' n streams,
    Attention Residuals' stacked sources."""
    mass: list[torch.Tensor] = []
    peaks: list[torch.Tensor] = []
    kurtosis: list[torch.Tensor] = []

    def attention(attn: nn.Module, args: tuple) -> None:
        mass.append(first_token_mass(attention_weights(attn, args[0])))

    def stream(block: nn.Module, args: tuple, out: torch.Tensor) -> None:
        peaks.append(max_over_median(out))
        kurtosis.append(excess_kurtosis(out))

    attns = [m for m in model.modules() if isinstance(m, (CausalSelfAttention, SphereAttention))]
    forward_with_hooks(model, inputs, [m.register_forward_pre_hook(attention) for m in attns]
                       + [b.register_forward_hook(stream) for b in model.blocks])
    return {"attn_first_token_mass": torch.stack(mass).tolist(), "stream_max_over_median": torch.stack(peaks).tolist(),
            "stream_excess_kurtosis": torch.stack(kurtosis).tolist()}


def forward_diagnostics(model: GPT, inputs: torch.Tensor) -> dict[str, list[float]]:
    """The eval line's forward diagnostics with log_diagnostics: stream_statistics, and GeoNorm's angles on a
    geodesic model."""
    out = stream_statistics(model, inputs)
    if model.config.scheme.combine == "geodesic":
        out.update(geonorm_angles(model, inputs))
    return out


@torch.no_grad()
def gradient_statistics(model: GPT, grad_scale: float = 1.0) -> dict:
    """Per-parameter gradient norms and the tail of |g| over all entries (DNT Fig. 1): kurtosis
    (3 for a Gaussian), the 99.9th percentile over the median (inf if most entries are 0), a
    log10-spaced histogram. Needs two float32 copies of the gradients, briefly."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    norms = (torch.stack([t.float().norm() for t in grads.values()]) / grad_scale).tolist()
    g = torch.cat([t.flatten().float() for t in grads.values()]).div_(grad_scale)
    centered = g - g.mean()
    variance = centered.square_().mean()
    kurtosis = centered.square_().mean() / variance.square()  # E[(g - mean)^4] / Var^2
    del centered
    a = g.abs_()
    median, q999 = (a.kthvalue(max(1, math.ceil(q * a.numel()))).values for q in (0.5, 0.999))
    below = [int((a < 10.0**e).sum()) for e in GRAD_HIST_LOG10_EDGES]
    hist = [hi - lo for lo, hi in zip([0, *below], [*below, a.numel()], strict=True)]
    per_block = [math.sqrt(sum(v * v for n, v in zip(grads, norms, strict=True) if n.startswith(f"blocks.{i}.")))
                 for i in range(len(model.blocks))]
    return {"grad_norms": dict(zip(grads, norms, strict=True)), "block_grad_norm": per_block,
            "grad_kurtosis": kurtosis.item(),
            "grad_tail_ratio": (q999 / median).item(), "grad_abs_hist": hist,
            "grad_abs_hist_log10_edges": GRAD_HIST_LOG10_EDGES}


@contextlib.contextmanager
def skipping(block: nn.Module):
    """Within it, `block` passes its input through unchanged: the model without that block (the "curse of
    depth" measure, Sun et al.: how much the loss rises when one block is left out)."""
    handle = block.register_forward_hook(lambda module, args, output: args[0])
    try:
        yield
    finally:
        handle.remove()


def block_skip_losses(model: GPT, loss_increase: Callable[[], float]) -> list[float]:
    """`loss_increase()` with each block of the model skipped in turn (see `skipping`)."""
    out = []
    for block in model.blocks:
        with skipping(block):
            out.append(loss_increase())
    return out


@torch.no_grad()
def geonorm_angles(model: GPT, inputs: torch.Tensor) -> dict[str, list[float]]:
    """GeoNorm's applied angle theta' (GeoNorm eq. 5) of each residual update on one batch, mean
    and max over tokens: geonorm_theta_{attn,mlp}_{mean,max}, one value per layer."""
    stats: dict[str, list] = {f"geonorm_theta_{u}_{s}": [] for u in ("attn", "mlp") for s in ("mean", "max")}

    def hook(name: str):
        def record(step: GeodesicStep, args: tuple, output: torch.Tensor) -> None:
            theta = step.angle(*args)[0].float()
            stats[f"geonorm_theta_{name}_mean"].append(theta.mean())
            stats[f"geonorm_theta_{name}_max"].append(theta.max())
        return record

    forward_with_hooks(model, inputs, [getattr(block, u).combine.register_forward_hook(hook(u))
                                       for block in model.blocks for u in ("attn", "mlp")])
    return {k: torch.stack(v).tolist() for k, v in stats.items()}


# Datasheet dense peaks in TFLOP/s (bf16/fp16, TF32, plain fp32), matched against the device name in this order
GPU_PEAKS = (("H100 NVL", (835, 418, 60)), ("H100 PCIe", (756, 378, 51)), ("H200 NVL", (835, 418, 60)),
             ("H100", (989, 495, 67)), ("H200", (989, 495, 67)), ("GH200", (989, 495, 67)), ("A100", (312, 156, 19.5)),
             ("L40S", (362, 183, 91.6)), ("A10", (125, 62.5, 31.2)), ("4090", (165, 82.6, 82.6)),
             ("3090", (71, 35.6, 35.6)), ("V100", (125, 15.7, 15.7)))


def device_peak_flops(device: str, dtype: torch.dtype = torch.float32) -> float:
    """The matmul peak the run's dtype can reach: on a known GPU the datasheet dense rate for bf16/fp16, for
    float32 on TF32 tensor cores (torch's float32 matmul precision "high" or "medium") or in plain float32;
    on a CPU, the matmul peak in `dtype` measured now. Half precision without native CPU support is emulated
    (seconds per matmul, no real peak): float32 then."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        peaks = next((p for key, p in GPU_PEAKS if key in name), None)
        if peaks is None:
            return float("nan")
        tf32 = torch.get_float32_matmul_precision() != "highest"
        return 1e12 * (peaks[0] if dtype in (torch.bfloat16, torch.float16) else peaks[1] if tf32 else peaks[2])
    if device != "cpu":
        return float("nan")
    if dtype != torch.bfloat16 or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtype = torch.float32
    n = 2048  # large enough to reach the peak (1024^2 reaches about half of it in float32 here)
    a = torch.randn(n, n, dtype=dtype)
    a @ a  # warm-up (a smaller one leaves the first timed product about 15% slow)
    best = float("inf")
    for _ in range(3):  # the fastest of a few repeats: the least disturbed by other processes
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best

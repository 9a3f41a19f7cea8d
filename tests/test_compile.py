"""torch.compile keeps every scheme's math (opt-in: a minute or more per scheme on a CPU).

    python -m pytest -m compile tests/test_compile.py
"""

import pytest
import torch

from model import GPT, SCHEMES, GPTConfig

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("scheme", list(SCHEMES) + ["dyt", "derf"])  # the last two: Pre-Norm with DyT/Derf
def test_compiled_model_matches_eager(scheme):
    torch.manual_seed(0)
    norm = scheme if scheme in ("dyt", "derf") else "rmsnorm"
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32,
                       norm_scheme="pre" if norm == scheme else scheme, norm=norm,
                       pos="rope" if scheme == "lipschitz" else "learned")
    model = GPT(config)
    compiled = torch.compile(model)
    idx = torch.randint(0, 64, (2, 16))
    eager_logits, eager_loss = model(idx, idx)
    logits, loss = compiled(idx, idx)
    # fused kernels reorder float32 sums: differences stay at the 1e-5 level
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-5)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    eager_loss.backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-3, atol=1e-5)

"""torch.compile traces every scheme into one graph and keeps its math. The compile-marked tests are
opt-in (the matrix of graph breaks takes minutes, a compiled model a minute or more per scheme on a CPU):

    python -m pytest -m compile tests/test_compile.py
"""

import itertools

import pytest
import torch

from model import GPT, NORM_TYPES, SCHEMES, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each case starts from an empty dynamo cache, and hitting the recompile limit fails it instead of
    silently running the model eagerly."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def tiny_config(scheme: str, norm: str = "layernorm", bias: bool = True, pos: str = "learned") -> GPTConfig:
    return GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, norm_scheme=scheme,
                     norm=norm, bias=bias, pos=pos)


def uses_norm(scheme: str) -> bool:
    """Whether the row normalizes anywhere with `config.norm` (QK-norm is always RMSNorm, nGPT's is L2)."""
    return SCHEMES[scheme].normalizes("input", "pre", "pre_attn", "pre_mlp", "mid", "post", "post_attn", "final")


def assert_one_graph(config: GPTConfig) -> None:
    """Dynamo traces one training forward pass (loss included) into a single graph."""
    torch.manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (2, config.block_size))
    explanation = torch._dynamo.explain(GPT(config))(idx, idx)
    reasons = [f"{b.reason.splitlines()[0]} ({b.user_stack[-1] if b.user_stack else '?'})"
               for b in explanation.break_reasons]
    assert explanation.graph_count == 1 and not reasons, f"{explanation.graph_count} graphs:\n" + "\n".join(reasons)


# every row with every norm type it uses (norm-free rows once), with and without biases, both positions;
# Pre-Norm's DyT and Derf rows are among them
MATRIX = [(scheme, norm, bias, pos)
          for scheme in SCHEMES for norm in (NORM_TYPES if uses_norm(scheme) else ("layernorm",))
          for bias, pos in itertools.product((True, False), ("learned", "rope"))]


def case_id(case: tuple) -> str:
    scheme, norm, bias, pos = case
    return f"{scheme}-{norm}-{'bias' if bias else 'nobias'}-{pos}"


@pytest.mark.parametrize("case", [("ngpt", "layernorm", False, "learned"), ("geonorm", "derf", True, "rope")],
                         ids=case_id)
def test_representative_models_trace_to_one_graph(case):
    # nGPT's unit norm and update; GeoNorm's geodesic step with Derf and RoPE
    assert_one_graph(tiny_config(*case))


# the columns taken from other codebases, all at once (tests/test_columns.py), with RoPE and the relu^2 MLP
COLUMNS = dict(z_loss=1e-4, logit_softcap=15.0, attn_softcap=50.0, qk_clip=100.0, value_residual=True, x0_mix=True,
               residual_streams=2)


def columns_config(kind: str) -> GPTConfig:
    return GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, pos="rope", mlp="relu2",
                     overrides={**COLUMNS, "hyper_connections": kind})


@pytest.mark.parametrize("kind", ["dynamic", pytest.param("static", marks=pytest.mark.compile),
                                  pytest.param("mhc", marks=pytest.mark.compile)])
def test_every_column_from_other_codebases_traces_to_one_graph(kind):
    # explicit softcapped attention recording QK-Clip's maxima, value residual and x0 mix through the forward's
    # ctx, two residual streams with hyper-connections, the logit softcap and the z-loss
    assert_one_graph(columns_config(kind))


# the 2025-26 columns (tests/test_columns.py): Qiu et al.'s gate with gpt-oss's sink (on the fused path and, with a
# softcap, the explicit one), key and value norms, OSP's SSNorm and embedding projections; Attention Residuals
NEW_COLUMNS = {
    "gate_sink_kv_ssnorm_embed_proj": dict(norm="ssnorm", embed_proj=True, overrides=dict(
        attn_gate="elementwise", attn_sink=True, norms="pre+k+v+final")),
    "attn_res_headwise_gate_softcapped_sink": dict(pos="rope", overrides=dict(
        combine="attn_res", attn_gate="headwise", attn_sink=True, attn_softcap=50.0, value_residual=True)),
}


def new_columns_config(case: str) -> GPTConfig:
    return GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, **NEW_COLUMNS[case])


@pytest.mark.parametrize("case", ["attn_res_headwise_gate_softcapped_sink",
                                  pytest.param("gate_sink_kv_ssnorm_embed_proj", marks=pytest.mark.compile)])
def test_gated_attention_sink_kv_norms_ssnorm_embed_proj_and_attn_res_trace_to_one_graph(case):
    assert_one_graph(new_columns_config(case))


@pytest.mark.compile
@pytest.mark.parametrize("case", list(NEW_COLUMNS))
def test_compiled_new_columns_match_eager(case):
    torch.manual_seed(0)
    model = GPT(new_columns_config(case))
    idx = torch.randint(0, 64, (2, 16))
    eager_logits, eager_loss = model(idx, idx)
    logits, loss = torch.compile(model)(idx, idx)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-5)  # as below: reordered float32 sums
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.compile
def test_compiled_columns_from_other_codebases_match_eager():
    torch.manual_seed(0)
    model = GPT(columns_config("mhc"))
    idx = torch.randint(0, 64, (2, 16))
    eager_logits, eager_loss = model(idx, idx)
    logits, loss = torch.compile(model)(idx, idx)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-5)  # as below: reordered float32 sums
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.compile
@pytest.mark.parametrize("case", MATRIX, ids=case_id)
def test_every_model_traces_to_one_graph(case):
    assert_one_graph(tiny_config(*case))


@pytest.mark.compile
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


# ----------------------------------------------------------------------------- regional compilation


@pytest.mark.parametrize("scheme", ["pre", "pre_alt", "geonorm", "lns"])
def test_blocks_of_one_structure_share_one_compiled_block(scheme):
    """GPT.compile_regions traces Block.forward once for all blocks of one structure, and the head once: 2 graphs
    at any depth. pre_alt's coefficients, GeoNorm's decay and LNS's scale differ per block; read as floats, each
    block would be compiled anew (dynamo guards on a float it reads)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32, norm_scheme=scheme))
    model.compile_regions(backend="eager")  # dynamo's tracing alone: the graphs it makes, without inductor
    counters = torch._dynamo.utils.counters
    counters.clear()
    idx = torch.randint(0, 64, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.compile
@pytest.mark.parametrize("scheme", list(SCHEMES) + ["dyt", "derf"])
def test_regionally_compiled_model_matches_eager(scheme):
    """What bench.py and gpu_report.py time: every block and the head compiled by inductor keep the math."""
    torch.manual_seed(0)
    norm = scheme if scheme in ("dyt", "derf") else "rmsnorm"
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=3, n_head=2, n_embd=32,
                       norm_scheme="pre" if norm == scheme else scheme, norm=norm)
    eager, regional = GPT(config), GPT(config)
    regional.load_state_dict(eager.state_dict())
    regional.compile_regions()
    idx = torch.randint(0, 64, (2, 16))
    (eager_logits, eager_loss), (logits, loss) = eager(idx, idx), regional(idx, idx)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-5)  # as above: reordered float32 sums
    loss.backward()
    eager_loss.backward()
    for (n, p), q in zip(eager.named_parameters(), regional.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=n)

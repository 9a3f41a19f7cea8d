"""nGPT (norm_scheme="ngpt"): the stream and every weight vector along the embedding axis stay on the
unit sphere, and each learned scaling sits where the paper's equations put it."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_run_args

import optim
import train
from model import GPT, GPTConfig, LearnedScale, SphereEmbedding, SphereLinear, apply_rope
from nanonorm import guards

pytestmark = pytest.mark.usefixtures("one_thread")

PAPER_ARCH = dict(mlp="swiglu", pos="rope", bias=False)  # nGPT's own architecture (§2.6, App. A)


def tiny_ngpt(**kw) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(**{**dict(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32,
                                 norm_scheme="ngpt"), **PAPER_ARCH, **kw})
    return GPT(config).double()


def unit_rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(2, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


def randomize_scalings(model: GPT) -> None:
    """Move every learned scaling away from its init, signs included (alpha enters as |alpha|)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LearnedScale):
                m.param.copy_(m.param * torch.randn(m.param.shape, generator=g, dtype=m.param.dtype) * 3)


def sphere_weights(model: GPT) -> dict[str, tuple[torch.Tensor, int]]:
    """Every constrained weight with the axis along which its vectors must be unit."""
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, SphereLinear):
            found[name] = (m.weight, m.unit_dim)
        elif isinstance(m, SphereEmbedding):
            found[name] = (m.weight, 1)
    return found


def assert_on_sphere(model: GPT, atol: float) -> None:
    weights = sphere_weights(model)
    matrices = {id(p) for p in model.parameters() if p.ndim == 2}
    assert matrices == {id(w) for w, _ in weights.values()}  # every matrix of the model is constrained
    for name, (w, dim) in weights.items():
        norms = w.detach().norm(dim=dim)
        torch.testing.assert_close(norms, torch.ones_like(norms), atol=atol, rtol=0, msg=name)


# ----------------------------------------------------------------------------- the sphere


@pytest.mark.parametrize("arch", [PAPER_ARCH, dict(mlp="gelu", pos="learned", bias=True)])
def test_every_block_output_has_unit_norm_per_token(arch):
    model = tiny_ngpt(**arch)
    randomize_scalings(model)
    with torch.no_grad():  # weights off the sphere too: the stream's norm must not depend on them
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = model.embed(torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(2)))
    for block in model.blocks:
        x = block(x)
        # float64 normalization: |norm - 1| is ~1e-16; 1e-6 leaves no doubt that it is exact, not approximate
        torch.testing.assert_close(x.norm(dim=-1), torch.ones(x.shape[:-1], dtype=x.dtype), atol=1e-6, rtol=0)


def test_model_starts_on_the_sphere_untied_and_without_final_norm():
    model = tiny_ngpt()
    assert_on_sphere(model, atol=1e-6)  # normalized in float32 at construction: |norm - 1| ~ 1e-7
    assert model.lm_head.weight is not model.wte.weight
    assert isinstance(model.final_norm, torch.nn.Identity)


def test_weights_stay_unit_after_train_steps_and_resume_exactly(data_dir, tmp_path):
    """2 + 2 train.py iterations equal 4 straight, bitwise; after a step and after the resume every
    matrix and embedding has unit vectors along its embedding axis."""
    args = dict(norm_scheme="ngpt", **PAPER_ARCH, dropout=0.1, max_iters=4, eval_interval=2, warmup_iters=0)
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    assert train.train(tiny_run_args(data_dir, full, **args)) == 0
    assert train.train(tiny_run_args(data_dir, part, **{**args, "max_iters": 2})) == 0

    def saved_model(out_dir: str) -> tuple[GPT, dict]:
        ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)
        model = GPT(GPTConfig(**ckpt["model_args"]))
        model.load_state_dict(ckpt["model"])
        return model, ckpt

    # float32 normalization leaves |norm - 1| at a few 1e-8; a missed step would be off by ~lr = 1e-3
    assert_on_sphere(saved_model(part)[0], atol=1e-6)
    assert train.train(tiny_run_args(data_dir, part, **args, init_from="resume")) == 0
    resumed, a = saved_model(part)
    assert_on_sphere(resumed, atol=1e-6)
    b = saved_model(full)[1]
    assert a["iter_num"] == b["iter_num"] == 4
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])


def test_divergence_is_still_caught(data_dir, tmp_path):
    """Renormalizing after each step must not hide a blow-up: lr 1e30 still stops the run with exit 3."""
    out = str(tmp_path / "run")
    args = tiny_run_args(data_dir, out, norm_scheme="ngpt", learning_rate=1e30, warmup_iters=0, max_iters=8,
                         eval_interval=4)
    assert train.train(args) == guards.EXIT_DIVERGED


def test_scalings_take_no_weight_decay():
    model = tiny_ngpt()
    scalings = {id(m.param) for m in model.modules() if isinstance(m, LearnedScale)}
    assert len(scalings) == 5 * 2 + 1  # alpha_A, alpha_M, s_qk, s_u, s_v per block, and s_z
    assert scalings <= {id(p) for p in optim.split_params(model)["no_decay"]}
    opt = optim.build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), device_type="cpu")
    assert all(g["weight_decay"] == 0 for g in opt.param_groups if scalings & {id(p) for p in g["params"]})


@pytest.mark.parametrize("changes, message", [
    (dict(in_features=3, out_features=1), "takes neither vector inputs"),
    (dict(gain_cap=2.0), "nor gain_cap"),
])
def test_impossible_ngpt_settings_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(norm_scheme="ngpt", **changes)


# ----------------------------------------------------------------------------- the scalings, one equation each


def test_alpha_steps_toward_the_normalized_sublayer_output_eq_10_11():
    model = tiny_ngpt()
    d = 32
    for update in (model.blocks[0].attn, model.blocks[0].mlp):
        # §2.6: alpha_init 0.05, alpha_scale 1/sqrt(d_model): stored 1/sqrt(d), read 0.05
        torch.testing.assert_close(update.combine.alpha.param, torch.full((d,), d**-0.5, dtype=torch.float64))
        torch.testing.assert_close(update.combine.alpha(), torch.full((d,), 0.05, dtype=torch.float64))
    randomize_scalings(model)
    h = unit_rows(16, d)
    for update in (model.blocks[0].attn, model.blocks[0].mlp):
        alpha = (update.combine.alpha.param * 0.05 * math.sqrt(d)).abs()
        h_sub = update.sublayer(h)
        h_sub = h_sub / h_sub.norm(dim=-1, keepdim=True)  # h_A = Norm(ATTN(h)), h_M = Norm(MLP(h))
        expected = h + alpha * (h_sub - h)  # eq. 10 / 11, then Norm
        expected = expected / expected.norm(dim=-1, keepdim=True)
        # float64, the same operations in another order: agreement to rounding
        torch.testing.assert_close(update(h), expected, atol=1e-12, rtol=0)


def test_s_qk_scales_unit_queries_and_keys_per_head_with_softmax_scale_sqrt_dk_eq_15_16():
    model = tiny_ngpt()
    attn = model.blocks[0].attn.sublayer
    d, n_head, d_k = 32, 2, 16
    torch.testing.assert_close(attn.s_qk(), torch.ones(d, dtype=torch.float64))  # s_qk,init 1
    torch.testing.assert_close(attn.s_qk.param, torch.full((d,), d**-0.5, dtype=torch.float64))  # scale 1/sqrt(d)
    randomize_scalings(model)
    h = unit_rows(16, d)
    s_qk = attn.s_qk.param * math.sqrt(d)
    T = h.shape[1]
    heads = []
    for i in range(n_head):
        cut = slice(i * d_k, (i + 1) * d_k)
        q = apply_rope(h @ attn.q_proj.weight[cut].T, attn.rope_cos, attn.rope_sin)
        k = apply_rope(h @ attn.k_proj.weight[cut].T, attn.rope_cos, attn.rope_sin)
        q = q / q.norm(dim=-1, keepdim=True) * s_qk[cut]  # eq. 15: q <- Norm(q) s_qk, per head
        k = k / k.norm(dim=-1, keepdim=True) * s_qk[cut]  # eq. 16
        scores = math.sqrt(d_k) * q @ k.transpose(-1, -2)  # softmax scale sqrt(d_k) (§2.3.2)
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), -math.inf)
        heads.append(scores.softmax(-1) @ (h @ attn.v_proj.weight[cut].T))
    expected = torch.cat(heads, dim=-1) @ attn.out_proj.weight.T
    torch.testing.assert_close(attn(h), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_s_u_and_s_v_scale_the_swiglu_inputs_with_sqrt_d_eq_20_21(bias):
    """u <- u s_u sqrt(d), v <- v s_v sqrt(d) (NVIDIA/ngpt; eq. 20 has no sqrt(d) on u, which without
    biases is the same model: see the next test). With biases, the output scale multiplies them too."""
    model = tiny_ngpt(bias=bias)
    mlp = model.blocks[0].mlp.sublayer
    d, hidden = 32, mlp.proj.in_features
    for s in (mlp.s_u, mlp.s_v):  # §2.6: init 1, scale 1
        torch.testing.assert_close(s(), torch.ones(hidden, dtype=torch.float64))
        torch.testing.assert_close(s.param, torch.ones(hidden, dtype=torch.float64))
    randomize_scalings(model)
    with torch.no_grad():  # biases away from their zero init, so that they enter
        for layer in (mlp.fc, mlp.gate, mlp.proj):
            if bias:
                layer.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(4))
    h = unit_rows(16, d)

    def affine(layer, x):
        return x @ layer.weight.T + (layer.bias if bias else 0)

    u = affine(mlp.fc, h) * mlp.s_u.param * math.sqrt(d)  # eq. 20, with the released code's sqrt(d)
    v = affine(mlp.gate, h) * mlp.s_v.param * math.sqrt(d)  # eq. 21: v <- v s_v sqrt(d_model)
    expected = affine(mlp.proj, u * F.silu(v))  # SwiGLU(u, v) = u * SiLU(v), then W_o
    # float64: rounding only (values of order sqrt(d) * 3)
    torch.testing.assert_close(mlp(h), expected, atol=1e-12, rtol=0)


def test_a_constant_on_u_leaves_the_mlp_update_unchanged():
    """Without biases the update normalizes the MLP's output, so a constant on u (eq. 20's u s_u against the
    released code's u s_u sqrt(d)) cannot matter."""
    model = tiny_ngpt()
    randomize_scalings(model)
    update, h = model.blocks[0].mlp, unit_rows(16, 32)
    before = update(h)
    with torch.no_grad():
        update.sublayer.s_u.param.mul_(math.sqrt(32))
    torch.testing.assert_close(update(h), before, atol=1e-12, rtol=0)


def test_s_z_scales_the_cosine_logits_eq_3():
    model = tiny_ngpt()
    head, d, vocab = model.lm_head, 32, 50
    torch.testing.assert_close(head.s_z(), torch.ones(vocab, dtype=torch.float64))  # s_z,init 1
    torch.testing.assert_close(head.s_z.param, torch.full((vocab,), d**-0.5, dtype=torch.float64))  # 1/sqrt(d)
    randomize_scalings(model)
    idx = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    h = model.embed(idx)
    for block in model.blocks:
        h = block(h)
    expected = (h @ head.weight.T) * (head.s_z.param * math.sqrt(d))  # z = E_output h, then z <- z s_z
    logits, _ = model(idx, idx)
    torch.testing.assert_close(logits, expected, atol=1e-12, rtol=0)


def test_output_scale_folded_into_the_weight_rows_has_the_gradients_of_scaling_the_output():
    """s_u, s_v and s_z multiply a SphereLinear's output; they are applied to W's rows and b instead (fewer
    products per step). (x W^T + b) s = x (s W)^T + s b, so every gradient must be the same."""
    g = torch.Generator().manual_seed(0)
    linear = SphereLinear(8, 6, bias=True, unit_dim=1).double()
    x = torch.randn(3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)
    inputs = (x, scale, linear.weight, linear.bias)
    folded = linear(x, scale)
    on_output = F.linear(x, linear.weight, linear.bias) * scale
    # float64, the same products grouped differently: rounding only
    torch.testing.assert_close(folded, on_output, rtol=1e-12, atol=1e-12)
    for ours, exact in zip(torch.autograd.grad(folded, inputs, upstream),
                           torch.autograd.grad(on_output, inputs, upstream), strict=True):
        torch.testing.assert_close(ours, exact, rtol=1e-12, atol=1e-12)


def test_each_matrix_has_unit_vectors_along_the_embedding_axis_by_name_at_init_and_after_a_step():
    """nGPT §2.6: a matrix that reads the stream (q, k, v, the MLP's u and v maps, the embeddings and the
    output head) has unit rows of length d; one that writes the stream (attention's W_o, the MLP's W_o)
    has unit columns of length d. The axis is stated here per matrix, not read from the model."""
    d = 32
    rows = ("q_proj", "k_proj", "v_proj", "fc", "gate")  # weight (out, d): each row a vector in R^d
    cols = ("out_proj", "proj")  # weight (d, in): each column a vector in R^d
    model = tiny_ngpt()

    def check(atol: float) -> None:
        seen = set()
        for name, w in model.named_parameters():
            if w.ndim != 2:
                continue
            leaf = name.split(".")[-2]
            if leaf in rows or name in ("wte.weight", "lm_head.weight"):
                assert w.shape[1] == d, name
                norms = w.detach().norm(dim=1)
            else:
                assert leaf in cols and w.shape[0] == d, name
                norms = w.detach().norm(dim=0)
            torch.testing.assert_close(norms, torch.ones_like(norms), atol=atol, rtol=0, msg=name)
            seen.add(leaf)
        assert seen == set(rows) | set(cols) | {"wte", "lm_head"}

    check(atol=1e-6)  # normalized in float32 at construction: |norm - 1| ~ 1e-7
    opt = optim.build_optimizer(model, "adamw", lr=0.1, weight_decay=0.0, betas=(0.9, 0.95), device_type="cpu")
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(5))
    model(idx, idx)[1].backward()
    opt.step()
    model.apply_parameter_constraints()
    # float64 weights renormalized: rounding ~1e-16; an lr-0.1 step off the sphere would be off by ~1e-1
    check(atol=1e-12)

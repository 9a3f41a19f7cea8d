# Bir et al. Table 2 (AdamW row, loss 0.16656): 15 norm-free Lipschitz blocks on in-context least squares, 3k steps; one GPU.
# Model (§4.2-4.3): d 256, 8 heads, SwiGLU, RoPE, no biases; convex residual, 1/d attention logits,
# 1/3 branch scalings, orthogonal init (all in norm_scheme "lipschitz"). SwiGLU width 2d = 512 as in
# the authors' code (the text's "MLP with hidden size 256" is the model width).
# Schedule (Bir et al.): 2% linear warmup, constant, linear decay to 0 over the last 10% ("wsd").
task = "icl"
out_dir = "out/icl_lipschitz_adamw"
# model
norm_scheme = "lipschitz"
n_layer = 15
n_embd = 256
n_head = 8
mlp = "swiglu"
mlp_hidden = 512
pos = "rope"
bias = False
dropout = 0.0
# task (§4.1): D 5, noise 0.01 on x, random order, bias feature; T 64 as in the released sweep
icl_pairs = 64
eval_iters = 8
batch_size = 256
gradient_accumulation_steps = 1
# optimizer (Tables 1-2): AdamW lr 1e-3, betas (0.9, 0.999), wd 0.01; no clipping (the
# released code clips only for Manifold Muon)
optimizer = "adamw"
learning_rate = 1e-3
betas = (0.9, 0.999)
weight_decay = 0.01
grad_clip = 0.0
# no skipping of non-finite batches: the paper says nothing of it and the released code's latest version
# has none (a run stops at the first non-finite loss). --skip_nonfinite=N is this project's option: drop
# the update of up to N batches whose loss or gradient is not finite, then count the run as diverged.
skip_nonfinite = 0
# schedule (§4.4: 3k steps for AdamW and Muon)
max_iters = 3000
lr_schedule = "wsd"
warmup_iters = 60
lr_decay_iters = 3000
cooldown_iters = 300
min_lr = 0.0
# logging
eval_interval = 250
log_interval = 10

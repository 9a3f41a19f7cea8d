# The depth study's model: char-level Shakespeare, d 64, 4 heads, context 128, batch 16, 500 steps; sweep n_layer
# (4, 8, 16, 32) and the scheme, each at its own rate, e.g.
#   python sweep.py configs/depth_base.py --grid norm_scheme=pre,post,lns --grid n_layer=4,32 \
#       --lr_grid 3e-4,1e-3,3e-3,1e-2,3e-2,1e-1 --select_seeds 0 --seeds 1,2,3,4,5 --baseline norm_scheme=pre
# Every run logs each block's residual RMS, gradient norm and largest attention logit at each evaluation, and
# at the end the val loss increase when each block is skipped (log_diagnostics).
dataset = "shakespeare_char"
out_dir = "out/depth_base"
n_layer = 4
n_head = 4
n_embd = 64
block_size = 128
batch_size = 16
dropout = 0.0
bias = False
max_iters = 500
lr_decay_iters = 500
warmup_iters = 25
learning_rate = 3e-3
min_lr = 3e-4
betas = (0.9, 0.99)
weight_decay = 0.1
eval_interval = 100
eval_iters = 20
log_interval = 50
log_diagnostics = True

# Shared settings of the cpu_*.py scheme comparison: char-level Shakespeare (embedded corpus),
# a 4-layer model that trains in a few minutes on a 2-core CPU. Each cpu_<scheme>.py imports
# this file and sets its scheme, so the runs differ only in the normalization.
dataset = "shakespeare_char"
out_dir = "out/cpu_base"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
dropout = 0.0
bias = False
max_iters = 1000
lr_decay_iters = 1000
eval_interval = 250
eval_iters = 20
log_interval = 50
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 50
betas = (0.9, 0.99)
weight_decay = 0.1

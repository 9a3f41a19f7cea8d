# nGPT 1B (Loshchilov et al., ICLR 2025; App. A): 36 layers, 20 heads, d 1280 (d_k 64); everything else as
# ngpt_0.5b.py (see there). The paper tunes the initial learning rate per size (App. A.7) and its released code
# gives none for 1B, so 3e-3 is the 0.5B value, a starting point for a sweep.
# Data: python prepare_data.py openwebtext. Expects 8 GPUs (bf16): torchrun --standalone --nproc_per_node=8
# train.py configs/ngpt_1b.py
dataset = "openwebtext"
out_dir = "out/ngpt_1b"
norm_scheme = "ngpt"
n_layer = 36
n_head = 20
n_embd = 1280
mlp = "swiglu"
mlp_hidden = 5120
pos = "rope"
bias = False
dropout = 0.0
block_size = 1024
# global batch 512 sequences x 1024 tokens = 8 per micro-batch x 64 micro-batches (8 per GPU on 8)
batch_size = 8
gradient_accumulation_steps = 64
max_iters = 10000
lr_decay_iters = 10000
optimizer = "adamw"
learning_rate = 3e-3
min_lr = 0.0
warmup_iters = 0
betas = (0.9, 0.95)
weight_decay = 0.0
grad_clip = 1.0
dtype = "bfloat16"
eval_interval = 1000
eval_iters = 200
log_interval = 10
compile = True

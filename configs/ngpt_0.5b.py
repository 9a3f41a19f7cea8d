# nGPT 0.5B (Loshchilov et al., ICLR 2025; App. A): 24 layers, 16 heads, d 1024, SwiGLU of width 4d, RoPE, no
# biases, context 1k, global batch 512; Adam without weight decay or warmup, cosine decay to 0. lr 3e-3 is
# NVIDIA/ngpt's launcher.sh for this size (its lr sweep put 10k-step runs best at 2.5e-3 to 3e-3, 50k-step runs at
# 1.5e-3 to 2e-3). The paper trains on OpenWebText with the LLaMA-2 tokenizer (32k); this uses GPT-2's, so losses
# are not comparable to the paper's. The paper's runs go from 10k to 200k steps: set max_iters and lr_decay_iters
# together; for the 4k context set block_size=4096, batch_size=2, gradient_accumulation_steps=256.
# Data: python prepare_data.py openwebtext. Expects 8 GPUs (bf16): torchrun --standalone --nproc_per_node=8
# train.py configs/ngpt_0.5b.py
dataset = "openwebtext"
out_dir = "out/ngpt_0.5b"
norm_scheme = "ngpt"
n_layer = 24
n_head = 16
n_embd = 1024
mlp = "swiglu"
mlp_hidden = 4096
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

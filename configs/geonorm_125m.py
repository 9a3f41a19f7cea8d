# GeoNorm 125M (App. A): harmonic decay, clamp pi/4, 12 layers, d 768, seq 512.
# The paper trained on Arxiv and Books3 (losses 1.8792 / 3.4040) and on FineWeb-Edu for its
# larger runs; Arxiv/Books3 are not openly distributable, so the default here is FineWeb-Edu
# (python prepare_data.py fineweb_edu). Expects 8 GPUs: torchrun --nproc_per_node=8.
dataset = "fineweb_edu"
out_dir = "out/geonorm_125m"
norm_scheme = "geonorm"
geonorm_decay = "harmonic"
norm = "layernorm"
n_layer = 12
n_head = 12
n_embd = 768
block_size = 512
dropout = 0.0
bias = True
# global batch of 32 sequences (App. A) = 4 per micro-batch x 8 micro-batches (1 per GPU on 8)
batch_size = 4
gradient_accumulation_steps = 8
max_iters = 50000
lr_decay_iters = 50000
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 1000
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 1000
eval_iters = 100
log_interval = 10
compile = True

# GeoNorm 125M (App. A): harmonic decay, clamp pi/4, 12 layers, d 768, seq 512.
# The paper trained on Arxiv and Books3 (losses 1.8792 / 3.4040) and on FineWeb-Edu for its
# larger runs; Arxiv/Books3 are not openly distributable, so the default here is FineWeb-Edu
# (python prepare_data.py fineweb_edu). Runs on any of 1, 2, 4 or 8 GPUs: torchrun --nproc_per_node=8.
import os

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
# Global batch of 32 sequences (App. A), one micro-batch per GPU: 32 x 512 tokens on one GPU (micro-batches
# of 4 would leave it waiting on kernel launches), 4 x 512 on each of eight. The same number of sequences
# either way, but not the same ones: each micro-batch draws its own, so runs on other GPU counts differ.
_gpus = int(os.environ.get("WORLD_SIZE", "1"))
if 32 % _gpus:
    raise ValueError(f"the global batch of 32 sequences does not split over {_gpus} GPUs: use 1, 2, 4, 8, 16 or 32")
batch_size = 32 // _gpus
gradient_accumulation_steps = _gpus
max_iters = 50000
lr_decay_iters = 50000
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 1000
betas = (0.9, 0.95)
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 1000
eval_iters = 100
log_interval = 10
compile = True

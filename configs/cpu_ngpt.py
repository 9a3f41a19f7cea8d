# nGPT (Loshchilov et al., ICLR 2025; §2.6, App. A) on char-level Shakespeare; 2-core CPU, a few minutes. Its own
# block (SwiGLU of width 4d, RoPE, no biases) and training (no weight decay, no warmup); the rest as cpu_base.py.
# Pre-Norm on the same block, for a like-for-like comparison (the paper's GPT baseline is SwiGLU + RoPE too):
#   python train.py configs/cpu_pre.py --mlp=swiglu --pos=rope --mlp_hidden=512
from configs.cpu_base import *  # noqa: F403

norm_scheme = "ngpt"
out_dir = "out/cpu_ngpt"
mlp = "swiglu"
pos = "rope"
mlp_hidden = 512  # 4 * n_embd, the paper's d_MLP (NVIDIA/ngpt: c_fc 2 x 4d)
weight_decay = 0.0
warmup_iters = 0
# 200-step trials: val loss 2.48 / 2.18 / 2.04 / 2.05 at 2e-3 / 4e-3 / 8e-3 / 1.6e-2; 8e-3 is also the 0.5B rate 3e-3
# times sqrt(1024/128), the same relative step on unit rows of 128 entries. A full sweep may move it.
learning_rate = 8e-3
# min_lr lr/10 and betas (0.9, 0.99) are cpu_base's, shared with the Pre-Norm arm; NVIDIA/ngpt uses min_lr 0 and
# beta2 0.95 for nGPT and its GPT baseline alike (configs/ngpt_*.py take those; docs/schemes.md, "nGPT").
min_lr = 8e-4

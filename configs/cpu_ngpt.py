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
learning_rate = 2e-3
min_lr = 2e-4

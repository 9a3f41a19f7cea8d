# DyT (gamma * tanh(alpha x) + beta, alpha init 0.5) in place of every LayerNorm of Pre-Norm, embedding scaled by a learnable sqrt(d), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm = "dyt"
out_dir = "out/cpu_dyt"
embed_scale = True  # the learnable sqrt(d) embedding gain of DyT's and Derf's LLM recipes
# cpu_base.py has bias=False: no beta, as in DyT's LLaMA code (DyT's and Derf's modules have one: docs/schemes.md)

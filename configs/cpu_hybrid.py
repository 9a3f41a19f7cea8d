# HybridNorm (QKV-norm in attention, Post-Norm FFN; --first_blocks=pre for HybridNorm*), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "hybrid"
out_dir = "out/cpu_hybrid"

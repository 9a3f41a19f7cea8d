# LayerNorm Scaling (Pre-Norm whose norm output in block l is times 1/sqrt(l), N(0, 0.02) init), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "lns"
out_dir = "out/cpu_lns"

# Pre-Norm (x <- x + f(N(x))), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "pre"
out_dir = "out/cpu_pre"

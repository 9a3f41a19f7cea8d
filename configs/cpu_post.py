# Post-Norm (x <- N(x + f(x))), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "post"
out_dir = "out/cpu_post"

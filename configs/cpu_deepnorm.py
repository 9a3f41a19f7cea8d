# DeepNorm (x <- N(alpha x + f(x)), alpha = (2L)^(1/4), beta-gain Xavier init), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "deepnorm"
out_dir = "out/cpu_deepnorm"

# OLMo 2's reordered norm (x <- x + N(f(x)), QK-norm over the whole projection, N(0, 0.02) init), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "olmo2"
out_dir = "out/cpu_olmo2"

# Mix-LN (Post-Norm in the first floor(0.25 L) blocks = 1 of 4, Pre-Norm after), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "mixln"
out_dir = "out/cpu_mixln"

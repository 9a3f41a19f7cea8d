# SandwichNorm (x <- x + N2(f(N1(x)))), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "sandwich"
out_dir = "out/cpu_sandwich"

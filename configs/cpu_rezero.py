# ReZero (x <- x + alpha f(x), alpha learnable from 0, no norms), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "rezero"
out_dir = "out/cpu_rezero"

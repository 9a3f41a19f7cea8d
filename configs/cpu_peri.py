# Peri-LN (x <- x + N_out(f(N_in(x))), normalized embedding, final norm), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "peri"
out_dir = "out/cpu_peri"

# the Lipschitz norm-free block (Bir et al. §4.3): convex residual, 1/3 scalings, orthogonal init, on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "lipschitz"
out_dir = "out/cpu_lipschitz"

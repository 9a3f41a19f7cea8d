# plain residual without any norm and orthogonal init (expected to blow up; Bir et al. §5.1), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "none"
out_dir = "out/cpu_none"

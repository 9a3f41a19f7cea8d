# plain residual without any norm and orthogonal init (Bir et al. §5.1: it overflows at 15 SwiGLU blocks; these 4 GELU blocks train), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "none"
out_dir = "out/cpu_none"

# CPU version of icl_nonorm_adamw.py (Bir et al. §5.1): 15 plain residual blocks without any norm, d 64; expected to stop at the first evaluation with exit code 3; 2-core CPU, seconds.
from configs.icl_small_lipschitz_adamw import *  # noqa: F403

out_dir = "out/icl_small_nonorm_adamw"
norm_scheme = "none"

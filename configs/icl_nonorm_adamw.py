# Bir et al. §5.1, the norm-free barrier: plain residual x + f(x), no norm, orthogonal init, AdamW as in Table 2; expected to diverge at once (exit code 3); one GPU.
# Same model, task and optimizer as icl_lipschitz_adamw.py; only the residual scheme differs.
from configs.icl_lipschitz_adamw import *  # noqa: F403

out_dir = "out/icl_nonorm_adamw"
norm_scheme = "none"

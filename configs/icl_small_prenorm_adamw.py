# CPU version of icl_prenorm_adamw.py: RMSNorm Pre-Norm reference with the same 15 blocks, d 64, T 16, batch 64, AdamW lr 4e-3, 900 steps; 2-core CPU, about 4 minutes.
from configs.icl_small_lipschitz_adamw import *  # noqa: F403

out_dir = "out/icl_small_prenorm_adamw"
norm_scheme = "pre"
norm = "rmsnorm"

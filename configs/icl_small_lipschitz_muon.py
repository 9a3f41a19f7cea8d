# CPU version of icl_lipschitz_muon.py (Bir et al. Table 2, Muon row): 15 Lipschitz blocks, d 64, T 16, batch 64, 900 steps; 2-core CPU, about 5 minutes.
# Muon's lr is a spectral-norm step, meant to carry over across widths, so the paper's values
# are kept: matrices lr 1e-3 (wd 0.01, momentum 0.95), embedding and head AdamW lr 1e-3.
# Measured at this size (REPRODUCING.md, claim 4, one seed): both lrs at 1e-3 / 1e-2 / 3e-2 give val
# 4.31 / 0.74 / 0.50 in 900 steps; 1e-1 and 3e-1 diverge. x10 robustness run, from the best 3e-2:
# --matrix_lr=0.3 --learning_rate=0.3
from configs.icl_small_lipschitz_adamw import *  # noqa: F403

out_dir = "out/icl_small_lipschitz_muon"
optimizer = "muon"
matrix_lr = 1e-3
momentum = 0.95
ns_steps = 5
adjust_lr = "original"
learning_rate = 1e-3
betas = (0.9, 0.999)
weight_decay = 0.01
grad_clip = 0.0

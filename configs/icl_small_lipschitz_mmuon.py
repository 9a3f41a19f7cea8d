# CPU version of icl_lipschitz_mmuon.py (Bir et al. Table 2, Manifold Muon row): 15 Lipschitz blocks, d 64, T 16, batch 64, 900 steps; 2-core CPU, about 5 minutes.
# The paper's settings are kept (spectral steps carry over across widths): matrices lr 0.1 on the
# Stiefel manifold, momentum 0.95, grad clip 1.0; embedding and head AdamW lr 0.01, betas
# (0.9, 0.98), wd 0.01. The paper trains this optimizer 20k steps (a long plateau, §5.3);
# 900 steps show only the start of it.
# x10 robustness run (Fig. 2): --matrix_lr=1.0
from configs.icl_small_lipschitz_adamw import *  # noqa: F403

out_dir = "out/icl_small_lipschitz_mmuon"
optimizer = "manifold_muon"
matrix_lr = 0.1
momentum = 0.95
dual_steps = 1
dual_lr = 0.01
ns_steps = 10
learning_rate = 0.01
betas = (0.9, 0.98)
weight_decay = 0.01
grad_clip = 1.0
gain_cap = None

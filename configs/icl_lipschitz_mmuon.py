# Bir et al. Table 2 (Manifold Muon row, loss 1.96396): 15 norm-free Lipschitz blocks on in-context least squares, 20k steps; one GPU.
# Manifold Muon on the hidden matrices (Stiefel manifold, online dual ascent, §3.1/App. 8.1):
# lr 0.1, momentum 0.95, no weight decay on matrices (Table 2 "N/A"), grad clip 1.0. The other
# parameters (embedding, head) use AdamW lr 0.01, betas (0.9, 0.98), wd 0.01 (released code).
# No diagonal gains (gain_cap None): Table 2's result; --gain_cap=5.0 is §6.2's faster variant.
# x10 robustness run (Fig. 2, "stable even at learning rate 1"): --matrix_lr=1.0
from configs.icl_lipschitz_adamw import *  # noqa: F403

out_dir = "out/icl_lipschitz_mmuon"
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
# §4.4 / §5.3: trained longer than AdamW and Muon because of its long plateau
max_iters = 20000
warmup_iters = 400
lr_decay_iters = 20000
cooldown_iters = 2000
eval_interval = 1000

# Bir et al. Table 2 (Muon row, loss 0.75127): 15 norm-free Lipschitz blocks on in-context least squares, 3k steps; one GPU.
# Muon on the hidden matrices: lr 1e-3, wd 0.01, momentum 0.95 (Nesterov), 5 Newton-Schulz steps,
# torch.optim.Muon's "original" update scale (what the released code runs). The AdamW side
# (embedding, head) uses lr 1e-3, betas (0.9, 0.999) as in the released code; its weight decay
# there is 1e-3, here the shared weight_decay 0.01 (train.py has one weight_decay key).
# x10 robustness run: --matrix_lr=0.01 --learning_rate=0.01
from configs.icl_lipschitz_adamw import *  # noqa: F403

out_dir = "out/icl_lipschitz_muon"
optimizer = "muon"
matrix_lr = 1e-3
momentum = 0.95
ns_steps = 5
adjust_lr = "original"
learning_rate = 1e-3
betas = (0.9, 0.999)
weight_decay = 0.01
grad_clip = 0.0

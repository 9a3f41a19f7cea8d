# GPT-2 124M trained with mSGDW, DNT App. C Table 5 (val loss 2.906 on OpenWebText).
# mSGDW: lr 1.0, weight decay 1e-4, momentum 0.9, no warmup, cosine to 6e-5, clip 1.0.
from configs.gpt2_124m_adamw import *  # noqa: F403

out_dir = "out/gpt2_124m_msgdw"
optimizer = "sgdw"
learning_rate = 1.0
min_lr = 6e-5
weight_decay = 1e-4
momentum = 0.9
warmup_iters = 0

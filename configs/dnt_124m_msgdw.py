# DNT 124M (S5) trained with mSGDW, DNT App. C Table 5 (val loss 2.849 on OpenWebText):
# the paper's claim is that DNT lets momentum SGD match AdamW.
from configs.gpt2_124m_msgdw import *  # noqa: F403

out_dir = "out/dnt_124m_msgdw"
norm_scheme = "dnt"

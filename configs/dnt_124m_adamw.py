# DNT 124M (setting S5) with AdamW, DNT App. C / Table 1 (val loss 2.863 on OpenWebText).
# Same data, size and schedule as gpt2_124m_adamw.py; only the normalization differs.
from configs.gpt2_124m_adamw import *  # noqa: F403

out_dir = "out/dnt_124m_adamw"
norm_scheme = "dnt"

# Reference for Bir et al.'s Type1 (LLaMA-like) model: RMSNorm Pre-Norm, same SwiGLU/RoPE/no-bias model, task and AdamW as icl_lipschitz_adamw.py; one GPU.
from configs.icl_lipschitz_adamw import *  # noqa: F403

out_dir = "out/icl_prenorm_adamw"
norm_scheme = "pre"
norm = "rmsnorm"

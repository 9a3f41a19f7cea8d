# nanochat's block (karpathy/nanochat gpt.py: parameter-free RMSNorm on the embedding, the sub-layer inputs, q/k per head and before the head; relu^2 MLP; RoPE; x0 mix; logit softcap 15; untied head), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "nanochat"
norm = "rmsnorm"
mlp = "relu2"
pos = "rope"
out_dir = "out/cpu_nanochat"

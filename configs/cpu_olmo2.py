# OLMo 2's reordered norm (x <- x + N(f(x)), QK-norm over the whole projection, N(0, 0.02) init) with its RMSNorm, on char-level Shakespeare; 2-core CPU, a few minutes.
# RMSNorm is part of OLMo 2's recipe (allenai/OLMo-core builds every norm as RMSNorm); its untied head and undecayed
# embeddings are not taken: the leaderboard's tying and decay groups (docs/schemes.md, "OLMo 2").
from configs.cpu_base import *  # noqa: F403

norm_scheme = "olmo2"
norm = "rmsnorm"
out_dir = "out/cpu_olmo2"

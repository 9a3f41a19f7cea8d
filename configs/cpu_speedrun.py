# the modded-nanogpt speedrun's norms (parameter-free RMSNorm on the embedding, sub-layer inputs, q/k per head and before the head; zero output projections), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "speedrun"
norm = "rmsnorm"
out_dir = "out/cpu_speedrun"

# Pre-Norm's rescaled form, GeoNorm App. B eq. 13 (same logits as pre), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "pre_alt"
out_dir = "out/cpu_pre_alt"

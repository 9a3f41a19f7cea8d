# GeoNorm, harmonic decay, clamp pi/4 (eq. 5), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "geonorm"
out_dir = "out/cpu_geonorm"

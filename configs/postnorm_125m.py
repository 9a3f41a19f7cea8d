# Post-Norm (3.4855 on Books3) baseline of GeoNorm's 125M comparison (GeoNorm §4.1, App. A): the same
# model, data and schedule as geonorm_125m.py with only the normalization changed.
# Default data: FineWeb-Edu (see geonorm_125m.py). Expects 8 GPUs.
from configs.geonorm_125m import *  # noqa: F403

norm_scheme = "post"
out_dir = "out/postnorm_125m"

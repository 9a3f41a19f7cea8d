# GeoNorm 350M (App. A): 24 layers, 16 heads, d 1024, lr 3e-4, otherwise as 125M.
# Default data: FineWeb-Edu (python prepare_data.py fineweb_edu). On 1 to 8 GPUs, as 125M.
from configs.geonorm_125m import *  # noqa: F403

out_dir = "out/geonorm_350m"
n_layer = 24
n_head = 16
n_embd = 1024
learning_rate = 3e-4
min_lr = 3e-5

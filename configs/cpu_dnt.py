# DNT setting S5 (InputNorm, PreNorm before attention, MidNorm, QKNorm), on char-level Shakespeare; 2-core CPU, a few minutes.
from configs.cpu_base import *  # noqa: F403

norm_scheme = "dnt"
out_dir = "out/cpu_dnt"

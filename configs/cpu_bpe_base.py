# Shared settings of the GPT-2 BPE scheme comparison (GeoNorm §4 at laptop scale): the embedded
# Shakespeare corpus with GPT-2's tokenizer, a 6-layer d-192 model, AdamW (0.9, 0.95) as in GeoNorm
# App. A; about 5 minutes per run on a 2-core CPU. Set norm_scheme (and its flags) per run:
#   python sweep.py configs/cpu_bpe_base.py --grid norm_scheme=geonorm,pre,post --seeds 1,2,3
# compact_vocab: the plays use 19k of GPT-2's 50k tokens; an output layer over those alone makes a
# step 2.7x faster (the loss is then over the 19k, a little below a full-vocabulary model's).
dataset = "shakespeare"
compact_vocab = True
out_dir = "out/cpu_bpe_base"
norm_scheme = "pre"
n_layer = 6
n_head = 6
n_embd = 192
block_size = 128
batch_size = 16
dropout = 0.0
bias = False
max_iters = 400
lr_decay_iters = 400
warmup_iters = 40
learning_rate = 1e-3
min_lr = 1e-4
betas = (0.9, 0.95)
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 100
eval_iters = 20
log_interval = 20

"""
The language-modelling task: next-token prediction on a dataset prepared by prepare_data.py (the
embedded Shakespeare corpus is prepared on first use). Parallel to icl_task.py; make_task picks one.

Guarantees: window k of iteration i is a pure function of (seed, split, i, k) (stream_seed), and so are
the dropout masks of micro-batch k (dropout_seed), never of which rank or how many ranks draw them; every
token id in the data lies in meta.json's vocabulary; a block_size or batch_size that cannot fit stops with
a message (exit 2) before anything is allocated. Every evaluation also reports val_bpb, the val loss in bits per
byte of the split's UTF-8 text, comparable across tokenizers. print_sample shows text from the trained model.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import torch

import prepare_data
from model import GPT
from nanonorm.guards import Dist, StopSignals, agreed
from nanonorm.train_config import MODEL_KEYS, ConfigError, TrainConfig

if TYPE_CHECKING:
    from icl_task import LeastSquaresTask

TRAIN_STREAM, VAL_STREAM, DROPOUT_STREAM = 0, 1, 2  # first part of every stream_seed
SAMPLE_CHUNK = 64  # tokens of the final sample drawn between checks for a stop signal


def stream_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (numpy's SeedSequence hashing)."""
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def dropout_seed(seed: int, iteration: int, index: int) -> int:
    """The global RNG's seed before micro-batch `index` (counted over all ranks) of `iteration`: its dropout
    masks are the same whichever rank draws it."""
    return stream_seed(seed, DROPOUT_STREAM, iteration, index)


class TextData:
    """Random windows of a tokenized dataset; window k of iteration i is a pure function of
    (seed, split, i, k), never of which rank draws it."""

    SPLITS = {"train": TRAIN_STREAM, "val": VAL_STREAM}

    def __init__(self, cfg: TrainConfig, block_size: int, device: str, master: bool):
        self.path = path = os.path.join(cfg.data_dir, cfg.dataset)
        if cfg.dataset in prepare_data.EMBEDDED_DATASETS:  # made on first use by rank 0, while the others wait
            missing = not os.path.exists(os.path.join(path, "meta.json"))
            agreed(lambda: prepare_embedded(cfg.dataset, cfg.data_dir) if master and missing else None, device,
                   f"prepare {cfg.dataset}")
        try:
            self.meta = prepare_data.load_meta(path)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(str(e)) from None
        for split in self.SPLITS:  # load_meta checked that the files have these lengths; mmap refuses empty ones
            if self.meta[f"{split}_tokens"] <= block_size + 1:
                raise ConfigError(f"block_size={block_size} is too large for {path}/{split}.bin "
                                  f"({self.meta[f'{split}_tokens']} tokens); use a smaller --block_size")
        self.arrays = {s: np.memmap(os.path.join(path, f"{s}.bin"), dtype=self.meta["dtype"], mode="r")
                       for s in self.SPLITS}
        self.block_size, self.batch_size, self.seed, self.device = block_size, cfg.batch_size, cfg.seed, device
        check_token_ids(self.meta, self.arrays, path)
        self.tokens_per_byte = {s: tokens_per_byte(self.meta, s, self.arrays[s]) for s in self.SPLITS}
        self.to_compact = None
        if cfg.compact_vocab:  # model id k stands for dataset id token_ids[k]; one pass over the data
            used = np.unique(np.concatenate([np.unique(data) for data in self.arrays.values()]))
            self.meta = {**self.meta, "token_ids": used.tolist()}
            self.to_compact = np.zeros(self.meta["vocab_size"], dtype=np.int64)
            self.to_compact[used] = np.arange(len(used))

    @property
    def vocab_size(self) -> int:
        return len(self.meta["token_ids"]) if self.to_compact is not None else self.meta["vocab_size"]

    def batch(self, split: str, iteration: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.arrays[split]
        rng = np.random.default_rng(stream_seed(self.seed, self.SPLITS[split], iteration, index))
        starts = rng.integers(0, len(data) - self.block_size - 1, size=self.batch_size)
        window = np.stack([data[s: s + self.block_size + 1] for s in starts]).astype(np.int64)
        if self.to_compact is not None:
            window = self.to_compact[window]
        xy = torch.from_numpy(window)
        if self.device.startswith("cuda"):
            xy = xy.pin_memory().to(self.device, non_blocking=True)
        else:
            xy = xy.to(self.device)
        return xy[:, :-1], xy[:, 1:]


def tokens_per_byte(meta: dict, split: str, tokens: np.ndarray) -> float:
    """A split's tokens over the UTF-8 bytes of its text (prepare_data.split_bytes): 1 for a char dataset of ASCII
    text, about 1/4 for GPT-2 BPE on English; NaN for a split that holds no text."""
    n_bytes = prepare_data.split_bytes(meta, split, tokens)
    return meta[f"{split}_tokens"] / n_bytes if n_bytes else math.nan


def prepare_embedded(dataset: str, data_dir: str) -> None:
    """The embedded corpus is small and needs no network: make it now."""
    path = os.path.join(data_dir, dataset)
    print(f"preparing the embedded dataset {dataset} in {path} ...")
    tokenizer = "char" if dataset.endswith("_char") else "gpt2"
    try:
        prepare_data.prepare("shakespeare", tokenizer=tokenizer, data_dir=data_dir)
    except FileExistsError:  # a run started alongside made it meanwhile, or a file stands on the way
        if not os.path.isdir(path):
            raise ConfigError(f"cannot prepare {dataset} in {path}: {data_dir} or a folder above it is a file; "
                              "give a --data_dir that is a folder") from None
    except OSError as e:
        raise ConfigError(f"cannot prepare {dataset} in {path} ({e.strerror or e}); give a writable --data_dir "
                          "(the embedded dataset is prepared there on first use)") from None


def check_token_ids(meta: dict, arrays: dict[str, np.ndarray], path: str) -> None:
    """meta.json's vocab_size is its tokenizer's and every id in the data lies below it; else training would
    crash on an IndexError, or train to the end and fail at sampling."""
    rebuild = prepare_data.prepare_command(os.path.basename(path), os.path.dirname(path), force=True)
    try:
        prepare_data.tokenizer_from_meta(meta)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"{path}/meta.json does not fit its tokenizer: {e}. Rebuild it with:\n  {rebuild}") from None
    for split, data in arrays.items():
        top = int(data.max())  # one pass over the memmapped file
        if top >= meta["vocab_size"]:
            raise ConfigError(f"{path}/{split}.bin holds token id {top}, outside meta.json's vocabulary of "
                              f"{meta['vocab_size']}. Rebuild it with:\n  {rebuild}")


class LanguageModelTask:
    """Next-token prediction on a prepared dataset."""

    def __init__(self, cfg: TrainConfig, model_args: dict, device: str, master: bool):
        block_size = model_args.get("block_size", MODEL_KEYS["block_size"].default)
        self.data = TextData(cfg, block_size, device, master)
        vocab = self.data.vocab_size
        # pad big vocabularies to a multiple of 64 for fast matmuls (GPT-2: 50257 -> 50304)
        self.model_defaults = {"vocab_size": 64 * math.ceil(vocab / 64) if vocab > 1024 else vocab}
        self.tokens_per_batch = cfg.batch_size * block_size
        self.eval_iters = cfg.eval_iters

    def train_batch(self, iteration: int, index: int):
        return self.data.batch("train", iteration, index)

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return model(x, y)[1]

    def eval_batches(self, split: str, ddp: Dist):
        # the same windows at every evaluation (iteration -1), shared out among the ranks
        return (self.data.batch(split, -1, k) for k in range(ddp.rank, self.eval_iters, ddp.world_size))

    def eval_splits(self) -> tuple[str, ...]:
        return ("train", "val")

    def extra_metrics(self, model, autocast, losses: dict) -> dict:
        """val_bpb: bits per byte, the val loss (nats per token) / ln 2 * the val split's tokens per byte."""
        return {"val_bpb": losses["val_loss"] / math.log(2) * self.data.tokens_per_byte["val"]}


def check_batch_fits(cfg: TrainConfig, model_args: dict, device: str) -> None:
    """Refuse a batch_size that cannot fit before anything is allocated (else an allocator error, or the kernel's
    OOM kill). A lower bound: one micro-batch's input to the first block in 2-byte floats, and the ICL task's
    fixed eval sets in float32."""
    from icl_task import token_dim

    seq = 2 * cfg.icl_pairs if cfg.task == "icl" else model_args.get("block_size", MODEL_KEYS["block_size"].default)
    need = cfg.batch_size * seq * model_args.get("n_embd", MODEL_KEYS["n_embd"].default) * 2
    if cfg.task == "icl":
        need += 2 * cfg.eval_iters * cfg.batch_size * seq * token_dim() * 4
    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(device).total_memory
    elif device == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        return
    if need > total:
        raise ConfigError(f"batch_size={cfg.batch_size} needs at least {need / 2**30:,.0f} GiB, more than {device}'s "
                          f"{total / 2**30:,.0f} GiB of memory; lower --batch_size (and raise "
                          "--gradient_accumulation_steps to keep the tokens per iteration)")


Task: TypeAlias = "LanguageModelTask | LeastSquaresTask"  # what train.py trains on: cfg.task "lm" or "icl"


def make_task(cfg: TrainConfig, model_args: dict, device: str, master: bool) -> Task:
    if cfg.task == "icl":
        from icl_task import LeastSquaresTask

        return LeastSquaresTask(cfg, model_args, device)
    return LanguageModelTask(cfg, model_args, device, master)


def model_inputs(batch) -> torch.Tensor:
    """The model's input in a batch of either task."""
    return batch[0] if isinstance(batch, tuple) else batch.tokens


def val_inputs(task) -> torch.Tensor:
    """The inputs of the first val batch: the fixed batch of the per-block diagnostics."""
    return model_inputs(next(iter(task.eval_batches("val", Dist()))))


def print_sample(model: GPT, meta: dict, n_tokens: int, device: str, stop: StopSignals | None = None) -> None:
    """n_tokens of text after a newline, drawn in chunks: a stop signal ends it early (the training is saved)."""
    tokenizer = prepare_data.tokenizer_from_meta(meta)
    try:
        start = tokenizer.encode("\n")
    except ValueError:  # a vocabulary without a newline: the end-of-text token, or else id 0
        start = [tokenizer.eot_token if tokenizer.eot_token is not None else 0]
    out = torch.tensor([start], device=device)
    generator, end = torch.Generator(device).manual_seed(0), out.shape[1] + n_tokens
    while out.shape[1] < end and not (stop and stop.received):  # the same tokens as one call: one generator
        out = model.generate(out, min(SAMPLE_CHUNK, end - out.shape[1]), temperature=0.8, top_k=200,
                             generator=generator, vocab_limit=tokenizer.vocab_size)
    cut = f" (cut short by {stop.received})" if stop and stop.received else ""
    print("-" * 40 + " sample\n" + tokenizer.decode(out[0].tolist()) + "\n" + "-" * 40 + cut)

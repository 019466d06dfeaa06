"""Byte tokenizer, corpus specs and their errors, and the TokenLoader determinism rule."""

from __future__ import annotations

import builtins
import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.data import (
    DEFAULT_STDLIB_MAX_BYTES, ByteTokenizer, CorpusError, CorpusKind, TokenLoader, check_length, check_vocab,
    load_corpus, parse_spec, stdlib_root,
)
from shardwise.data import corpora
from shardwise.testing import shard_global_batch


# -- tokenizer -------------------------------------------------------------------------------------

def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # naïve → ✓ 🚀"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert all(isinstance(i, int) and 0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)      # multi-byte characters
    assert tok.decode(ids) == text
    arr = tok.encode_array(text)
    assert arr.dtype == np.uint16 and arr.tolist() == ids
    assert tok.decode(arr) == text and tok.decode(torch.tensor(ids)) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")                 # a cut character does not raise


def test_tokenizer_rejects_foreign_ids() -> None:
    with pytest.raises(ValueError, match="token id 300 is outside 0..255"):
        ByteTokenizer().decode([65, 300])


# -- corpora ---------------------------------------------------------------------------------------

class _Reads:
    """What a load_corpus call walks and opens: directories visited and (path, size) of every file opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dirs: list[str] = []
        self.files: list[tuple[str, int]] = []
        walk, real_open = os.walk, builtins.open

        def counting_walk(top, *args, **kwargs):
            for dirpath, dirnames, filenames in walk(top, *args, **kwargs):
                self.dirs.append(dirpath)
                yield dirpath, dirnames, filenames

        def counting_open(path, *args, **kwargs):
            self.files.append((str(path), os.path.getsize(path)))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(corpora.os, "walk", counting_walk)
        monkeypatch.setattr(corpora, "open", counting_open, raising=False)   # found before the builtin

    def clear(self) -> None:
        self.dirs.clear()
        self.files.clear()


def test_stdlib_corpus_is_deterministic_bounded_and_cheap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the stdlib stays cheap on any machine: it never walks into site-packages, test suites or caches
    (which can hold far more than the stdlib), opens only .py files, and stops reading at the byte cap."""
    reads = _Reads(monkeypatch)
    full = load_corpus("stdlib")
    assert full.dtype == np.uint16 and full.ndim == 1
    assert 1_000_000 < len(full) <= 16 * 2**20
    assert int(full.max()) < 256
    text = ByteTokenizer().decode(full[:200_000])
    assert "def " in text and "import " in text
    root, skipped = stdlib_root(), {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    for d in reads.dirs:
        parts = Path(d).relative_to(root).parts
        assert not skipped & set(parts) and not any(p.startswith(".") for p in parts), d
    assert reads.files and all(path.endswith(".py") for path, _ in reads.files)
    sizes = [size for _, size in reads.files]
    # What is kept was read (a newline added per file at most); what was read beyond it is at most the file
    # that crossed the cap.
    assert len(full) <= sum(sizes) + len(sizes) and sum(sizes) <= DEFAULT_STDLIB_MAX_BYTES + max(sizes)
    reads.clear()
    again = load_corpus("stdlib")
    assert np.array_equal(full, again)
    reads.clear()
    capped = load_corpus("stdlib", max_bytes=100_000)
    assert len(capped) == 100_000 and np.array_equal(capped, full[:100_000])
    sizes = [size for _, size in reads.files]
    assert sum(sizes[:-1]) < 100_000 <= sum(sizes) + len(sizes), f"read {sum(sizes)} bytes for a 100 kB cap"


def test_text_file(tmp_path: Path) -> None:
    text = "héllo wörld\n" * 50
    path = tmp_path / "a.txt"
    path.write_text(text, encoding="utf-8")
    tokens = load_corpus(str(path))
    assert tokens.dtype == np.uint16 and ByteTokenizer().decode(tokens) == text
    assert len(load_corpus(str(path), max_bytes=2)) == 2   # cuts inside "é": still accepted as text


def test_directory_sorted_recursive_text_only(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zed\n")
    (tmp_path / "a.md").write_text("alpha")                              # no trailing newline: one is added
    (tmp_path / "c.py").write_text("print(1)\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")           # NUL bytes: skipped
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))      # not UTF-8: kept, byte by byte
    (tmp_path / ".hidden.txt").write_text("secret\n")
    (tmp_path / ".git" / "HEAD").write_text("ref\n")
    tokens = load_corpus(str(tmp_path))
    # os.walk visits root files (sorted) before descending into sorted subdirectories.
    assert bytes(tokens.astype(np.uint8)) == b"alpha\nprint(1)\ncaf\xe9\nzed\n"
    assert ByteTokenizer().decode(load_corpus(str(tmp_path), max_bytes=8)) == "alpha\npr"


def test_any_bytes_are_tokens(tmp_path: Path) -> None:
    """A byte-level tokenizer has a token for every byte: a file that is not UTF-8 (cut multi-byte characters,
    latin-1, random bytes) loads whole, byte for byte."""
    data = bytes(range(1, 256)) * 40 + "ünïcödé".encode("utf-8")[:-1] + b"\x00tail"
    (tmp_path / "mixed.txt").write_bytes(data)
    tokens = load_corpus(str(tmp_path / "mixed.txt"))
    assert tokens.dtype == np.uint16 and bytes(tokens.astype(np.uint8)) == data
    assert ByteTokenizer().encode_bytes(data) == list(data)


def test_glob_of_text_files(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.md").write_text("xx\n")
    (tmp_path / "b.md").write_text("bb")
    (tmp_path / "c.txt").write_text("not matched\n")
    (tmp_path / "d.md").write_bytes(b"\x00binary")                          # binary-looking: skipped
    tokens = load_corpus(str(tmp_path / "**" / "*.md"))
    assert ByteTokenizer().decode(tokens) == "xx\nbb\n"                       # sorted by path: a/x.md, b.md
    assert parse_spec(str(tmp_path / "*.md")).kind is CorpusKind.GLOB
    with pytest.raises(CorpusError, match="the glob matches no file"):
        load_corpus(str(tmp_path / "*.rst"))


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int32, np.int64, np.uint8])
def test_memmap_spec(tmp_path: Path, dtype: type) -> None:
    ids = (np.arange(5000, dtype=np.int64) * 7919 % min(60000, np.iinfo(dtype).max)).astype(dtype)
    path = tmp_path / "train.bin"
    ids.tofile(path)
    tokens = load_corpus(f"memmap:{path}:{np.dtype(dtype).name}")
    assert isinstance(tokens, np.memmap) and tokens.dtype == dtype
    assert np.array_equal(tokens, ids)
    capped = load_corpus(f"memmap:{path}:{np.dtype(dtype).name}", max_bytes=1000)
    assert len(capped) == 1000 // np.dtype(dtype).itemsize


@pytest.mark.parametrize("dtype", [np.uint32, np.int64, np.int16])
def test_npy_spec(tmp_path: Path, dtype: type) -> None:
    ids = np.arange(1000, dtype=dtype)
    np.save(tmp_path / "t.npy", ids)
    tokens = load_corpus(str(tmp_path / "t.npy"), vocab_size=1000)
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, ids)
    with pytest.raises(CorpusError, match="token id 999.*--vocab-size 1000 or more"):
        load_corpus(str(tmp_path / "t.npy"), vocab_size=256)
    np.save(tmp_path / "m.npy", ids.reshape(10, 100))
    with pytest.raises(CorpusError, match="must be a 1-D integer array.*shape \\(10, 100\\)"):
        load_corpus(str(tmp_path / "m.npy"))


def test_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="no such file or directory.*valid specs: 'stdlib'"):
        load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(CorpusError, match="no such file or directory"):
        load_corpus(f"memmap:{tmp_path / 'missing.bin'}:uint16")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CorpusError, match="empty.txt.*contains no text"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(CorpusError, match="directory at .* contains no text"):
        load_corpus(str(tmp_path / "emptydir"))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(CorpusError, match="has no tokens"):
        load_corpus(f"memmap:{tmp_path / 'empty.bin'}:uint16")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(CorpusError, match="file size 3 bytes is not a multiple of 2"):
        load_corpus(f"memmap:{tmp_path / 'odd.bin'}:uint16")
    with pytest.raises(CorpusError, match="memmap dtype 'float32' is not one of \\['uint8', 'uint16'"):
        load_corpus(f"memmap:{tmp_path / 'odd.bin'}:float32")
    with pytest.raises(CorpusError, match="a memmap spec is 'memmap:PATH:DTYPE'"):
        load_corpus("memmap:nodtype")
    with pytest.raises(CorpusError, match="max_bytes=0 must be a positive int"):
        load_corpus("stdlib", max_bytes=0)


def test_vocab_and_length_checks(tmp_path: Path) -> None:
    ids = np.array([1, 2, 70000, 3], dtype=np.uint32)
    ids.tofile(tmp_path / "big.bin")
    with pytest.raises(CorpusError, match="contains token id 70000, but the model's vocab_size is 50257"):
        load_corpus(f"memmap:{tmp_path / 'big.bin'}:uint32", vocab_size=50257)
    with pytest.raises(CorpusError, match="negative token id -4"):
        check_vocab(np.array([0, -4, 3]), 256)
    check_vocab(np.array([0, 255]), 256)
    check_length(np.zeros(9, np.uint16), 8)
    with pytest.raises(CorpusError, match="corpus has 8 tokens, but seq_len=8 needs at least 9"):
        check_length(np.zeros(8, np.uint16), 8)
    with pytest.raises(CorpusError, match="needs at least 9"):
        TokenLoader(np.zeros(8, np.uint16), seq_len=8, micro_batch=1)
    assert issubclass(CorpusError, ValueError)


# -- loader ----------------------------------------------------------------------------------------

TOKENS = (np.arange(10_000) % 60_000).astype(np.uint16)   # token i == position i: windows are easy to read


def loader(**kw) -> TokenLoader:
    args = dict(seq_len=16, micro_batch=4, grad_accum=2, dp_size=1, dp_rank=0, seed=0)
    return TokenLoader(TOKENS, **{**args, **kw})


def test_labels_are_inputs_shifted_by_one() -> None:
    x, y = next(loader())
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 16)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, x + 1)                              # consecutive tokens of the corpus
    assert torch.equal(x - x[:, :1], torch.arange(16).expand(4, 16))


@pytest.mark.parametrize("dp_size, grad_accum, micro_batch", [(1, 1, 16), (1, 2, 8), (2, 2, 4), (4, 2, 2), (4, 4, 1)])
def test_union_over_ranks_is_the_global_batch(dp_size: int, grad_accum: int, micro_batch: int) -> None:
    reference = loader(micro_batch=16, grad_accum=1)            # global batch 16 on one rank
    for step in (0, 3):
        want_x, want_y = reference.global_batch(step)
        ranks = [loader(dp_size=dp_size, dp_rank=r, grad_accum=grad_accum, micro_batch=micro_batch)
                 for r in range(dp_size)]
        assert torch.equal(ranks[0].global_batch(step)[0], want_x)   # independent of the split
        per_rank = [rk.micro_batches(step) for rk in ranks]
        for r in range(dp_size):                                 # the shared slicing rule of shardwise.testing
            expected = shard_global_batch(want_x, dp_size=dp_size, dp_rank=r, grad_accum=grad_accum)
            assert all(torch.equal(mb[0], e) for mb, e in zip(per_rank[r], expected))
        # Row order of the global batch is micro-step major, then rank.
        rows = [per_rank[r][k] for k in range(grad_accum) for r in range(dp_size)]
        assert torch.equal(torch.cat([x for x, _ in rows]), want_x)
        assert torch.equal(torch.cat([y for _, y in rows]), want_y)


def test_iteration_order_and_resume() -> None:
    a = loader(dp_size=2, dp_rank=1, grad_accum=3, micro_batch=2)
    expected = [mb for step in range(3) for mb in a.micro_batches(step)]
    got = list(itertools.islice(a, 9))
    assert all(torch.equal(g[0], e[0]) and torch.equal(g[1], e[1]) for g, e in zip(got, expected))
    assert a.state_dict() == {"step": 3, "micro_step": 0, "seed": 0}
    b = loader(dp_size=2, dp_rank=1, grad_accum=3, micro_batch=2)
    next(b), next(b), next(b), next(b)
    state = b.state_dict()
    assert state == {"step": 1, "micro_step": 1, "seed": 0}
    c = loader(dp_size=2, dp_rank=1, grad_accum=3, micro_batch=2)
    c.load_state_dict(state)
    assert torch.equal(next(c)[0], next(b)[0])
    with pytest.raises(ValueError, match="saved with seed=0 but this loader has seed=5"):
        loader(seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="micro_step=7 is not a position"):
        c.load_state_dict({"step": 0, "micro_step": 7})


def test_seed_controls_batches() -> None:
    assert torch.equal(loader(seed=1).global_batch(2)[0], loader(seed=1).global_batch(2)[0])
    assert not torch.equal(loader(seed=1).global_batch(2)[0], loader(seed=2).global_batch(2)[0])
    assert not torch.equal(loader(seed=1).global_batch(2)[0], loader(seed=1).global_batch(3)[0])


def test_windows_stay_inside_a_minimal_corpus() -> None:
    tokens = np.arange(17, dtype=np.uint16)                      # exactly seq_len + 1: one possible window
    x, y = TokenLoader(tokens, seq_len=16, micro_batch=3).global_batch(0)
    assert torch.equal(x, torch.arange(16).expand(3, 16)) and torch.equal(y, x + 1)
    offsets = loader(micro_batch=512, grad_accum=4).offsets(0)
    assert offsets.min() >= 0 and offsets.max() <= len(TOKENS) - 17


@pytest.mark.parametrize("kw, message", [
    (dict(dp_rank=2, dp_size=2), "dp_rank=2 must be in 0..1"),
    (dict(micro_batch=0), "micro_batch=0 must be a positive integer"),
    (dict(seed=-1), "seed=-1 must be a non-negative integer"),
])
def test_loader_argument_errors(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        loader(**kw)

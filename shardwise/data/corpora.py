"""Offline corpora as flat token arrays: the Python standard library, text files, directories and globs of
text, and pre-tokenized memmaps.

    load_corpus("stdlib")                      the installed stdlib's .py files, bytes as tokens
    load_corpus("notes.txt")                   one file, every byte a token (any encoding, any bytes)
    load_corpus("docs/")                       every text file under a directory, sorted
    load_corpus("books/*.txt")                 the files a glob matches (`**` recurses), sorted
    load_corpus("memmap:train.bin:uint16")     raw token ids on disk, any integer dtype; not read into RAM
    load_corpus("train.npy")                   a 1-D integer .npy file, memory-mapped

Every failure is a `CorpusError` naming the spec, what is wrong and what to do.
"""

from __future__ import annotations

import enum
import glob
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

DEFAULT_STDLIB_MAX_BYTES = 16 * 2**20
"""Default cap for the "stdlib" spec (the stdlib without tests is ~12 MiB, so this takes all of it)."""

MEMMAP_DTYPES: dict[str, type[np.integer]] = {np.dtype(t).name: t for t in (
    np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64)}
"""Integer dtypes a token file may hold (ids must still be >= 0 and below the model's vocab_size)."""
_BINARY_SNIFF = 8192

_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_SPEC_HELP = ("valid specs: 'stdlib', a text file, a directory of text files, a glob such as 'docs/**/*.md', "
              "'memmap:PATH:DTYPE' (DTYPE: uint16, uint32, int32, ...), or a 1-D integer .npy file")


class CorpusError(ValueError):
    """A corpus spec that cannot be loaded or a token array unfit for training."""


class CorpusKind(enum.Enum):
    STDLIB = "stdlib"
    TEXT_FILE = "text file"
    DIRECTORY = "directory"
    GLOB = "glob"
    MEMMAP = "memmap"
    NPY = "npy"


@dataclass(frozen=True)
class CorpusSpec:
    """A parsed corpus spec string."""
    kind: CorpusKind
    path: Path | None = None
    dtype: type[np.integer] | None = None   # MEMMAP only
    pattern: str | None = None              # GLOB only


def parse_spec(spec: str) -> CorpusSpec:
    """Classify a spec string; checks that the path exists, reads nothing."""
    if spec == CorpusKind.STDLIB.value:
        return CorpusSpec(CorpusKind.STDLIB, stdlib_root())
    if spec.startswith("memmap:"):
        path_str, sep, dtype_name = spec[len("memmap:"):].rpartition(":")
        if not sep or not path_str:
            raise CorpusError(f"corpus spec {spec!r}: a memmap spec is 'memmap:PATH:DTYPE', e.g. "
                              f"'memmap:train.bin:uint16'; {_SPEC_HELP}.")
        if dtype_name not in MEMMAP_DTYPES:
            raise CorpusError(f"corpus spec {spec!r}: memmap dtype {dtype_name!r} is not one of "
                              f"{list(MEMMAP_DTYPES)}; name the integer dtype the token file was written with.")
        return CorpusSpec(CorpusKind.MEMMAP, _existing(spec, path_str), MEMMAP_DTYPES[dtype_name])
    if glob.has_magic(spec) and not Path(spec).exists():
        matches = _glob_files(spec)
        if not matches:
            raise CorpusError(f"corpus spec {spec!r}: the glob matches no file; {_SPEC_HELP}.")
        return CorpusSpec(CorpusKind.GLOB, Path(os.path.commonpath([str(m.parent) for m in matches])),
                          pattern=spec)
    path = _existing(spec, spec)
    if path.is_dir():
        return CorpusSpec(CorpusKind.DIRECTORY, path)
    if path.suffix == ".npy":
        return CorpusSpec(CorpusKind.NPY, path)
    return CorpusSpec(CorpusKind.TEXT_FILE, path)


def load_corpus(spec: str, *, max_bytes: int | None = None, vocab_size: int | None = None) -> np.ndarray:
    """Load a corpus as a 1-D array of token ids (uint16 for text; the stored dtype for memmap/.npy,
    which come back memory-mapped, not read into RAM).

    Text is tokenized by bytes (`ByteTokenizer`): byte-level needs no decoding, so a file in any encoding (or
    none) is read whole, and text corpora are uint16 ids < 256. In directories and globs, files that look binary
    (`_looks_binary`) are skipped.

    max_bytes caps the corpus: text is cut after that many bytes (= tokens), memmap/.npy after
    max_bytes // itemsize tokens. None means the spec's default: DEFAULT_STDLIB_MAX_BYTES for
    "stdlib", everything for the others. Loading is deterministic: files are read in sorted order.
    vocab_size, if given, checks every id is below it (a full pass over the tokens)."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise CorpusError(f"load_corpus({spec!r}): max_bytes={max_bytes!r} must be a positive int or None.")
    parsed = parse_spec(spec)
    assert parsed.path is not None
    if parsed.kind is CorpusKind.STDLIB:
        limit = DEFAULT_STDLIB_MAX_BYTES if max_bytes is None else max_bytes
        tokens = _bytes_to_tokens(_read_text_tree(parsed.path, limit, suffix=".py", skip_dirs=_STDLIB_SKIP_DIRS))
    elif parsed.kind is CorpusKind.DIRECTORY:
        tokens = _bytes_to_tokens(_read_text_tree(parsed.path, max_bytes, suffix=None, skip_dirs=frozenset()))
    elif parsed.kind is CorpusKind.GLOB:
        assert parsed.pattern is not None
        tokens = _bytes_to_tokens(_read_files(_glob_files(parsed.pattern), max_bytes))
    elif parsed.kind is CorpusKind.TEXT_FILE:
        tokens = _bytes_to_tokens(_read_text_file(spec, parsed.path, max_bytes))
    elif parsed.kind is CorpusKind.MEMMAP:
        assert parsed.dtype is not None
        tokens = _open_memmap(spec, parsed.path, parsed.dtype)
    else:
        tokens = _open_npy(spec, parsed.path)
    if max_bytes is not None and parsed.kind in (CorpusKind.MEMMAP, CorpusKind.NPY):
        tokens = tokens[: max_bytes // tokens.itemsize]
    if tokens.size == 0:
        what = "has no tokens" if parsed.kind in (CorpusKind.MEMMAP, CorpusKind.NPY) else "contains no text"
        raise CorpusError(f"corpus {spec!r} ({parsed.kind.value} at {parsed.path}) {what}; "
                          f"point it at a non-empty corpus.")
    if vocab_size is not None:
        check_vocab(tokens, vocab_size, spec=spec)
    return tokens


def check_length(tokens: np.ndarray, seq_len: int) -> None:
    """A training window is seq_len inputs plus the next token as the last label: seq_len + 1 tokens."""
    if len(tokens) < seq_len + 1:
        raise CorpusError(f"corpus has {len(tokens)} tokens, but seq_len={seq_len} needs at least "
                          f"{seq_len + 1} (seq_len inputs plus one more token for the shifted labels); "
                          f"use a larger corpus or a smaller seq_len.")


def check_vocab(tokens: np.ndarray, vocab_size: int, *, spec: str = "tokens") -> None:
    """Every id must index the embedding table: 0 <= id < vocab_size."""
    if tokens.size == 0:
        return
    hi, lo = int(tokens.max()), int(tokens.min())
    if hi >= vocab_size:
        raise CorpusError(f"corpus {spec!r} contains token id {hi}, but the model's vocab_size is {vocab_size} "
                          f"(ids must be < vocab_size); declare the tokenizer's vocabulary: --vocab-size "
                          f"{hi + 1} or more (shardwise train), vocab_size > {hi} in the model config.")
    if lo < 0:
        raise CorpusError(f"corpus {spec!r} contains negative token id {lo}; ids must be >= 0.")


def stdlib_root() -> Path:
    """The installed Python standard library (where its .py files are)."""
    return Path(sysconfig.get_paths()["stdlib"])


# -- readers ---------------------------------------------------------------------------------------

def _existing(spec: str, path_str: str) -> Path:
    path = Path(path_str).expanduser()
    if not path.exists():
        raise CorpusError(f"corpus {spec!r}: no such file or directory {str(path)!r}; {_SPEC_HELP}.")
    return path


def _bytes_to_tokens(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def _looks_binary(data: bytes) -> bool:
    """A NUL byte near the start (git's rule): images, archives, token files. Text in any encoding has none."""
    return b"\x00" in data[:_BINARY_SNIFF]


def _read_text_file(spec: str, path: Path, max_bytes: int | None) -> bytes:
    """The file's bytes, whatever they are: a byte-level tokenizer has a token for every byte, so nothing is
    decoded and nothing stops at a byte that is not UTF-8."""
    with open(path, "rb") as f:
        return f.read() if max_bytes is None else f.read(max_bytes)


def _glob_files(pattern: str) -> list[Path]:
    """The regular files a glob matches (`**` recursive), sorted, hidden names skipped."""
    found = glob.glob(os.path.expanduser(pattern), recursive=True)
    return sorted(Path(p) for p in found if os.path.isfile(p) and not os.path.basename(p).startswith("."))


def _read_files(paths: Iterable[Path], max_bytes: int | None) -> bytes:
    """Concatenate files in the given order, a newline between files, stopping at max_bytes; unreadable and
    binary-looking files are skipped."""
    parts: list[bytes] = []
    total = 0
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:   # unreadable or vanished (e.g. a broken symlink): not part of the corpus
            continue
        if not data or _looks_binary(data):
            continue
        if not data.endswith(b"\n"):
            data += b"\n"
        parts.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            return b"".join(parts)[:max_bytes]
    return b"".join(parts)


def _read_text_tree(root: Path, max_bytes: int | None, *, suffix: str | None, skip_dirs: frozenset[str]) -> bytes:
    """Concatenate the text files under root in sorted walk order, a newline between files, stopping
    at max_bytes. Hidden entries, `skip_dirs` and binary-looking files are skipped."""
    def paths() -> Iterator[Path]:    # lazily: reading stops at max_bytes, so does the walk
        for dirpath, dirnames, filenames in os.walk(root):
            # Sorting in place fixes the walk order (os.walk follows dirnames), hence the corpus bytes.
            dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
            yield from (Path(dirpath, name) for name in sorted(filenames)
                        if not name.startswith(".") and (suffix is None or name.endswith(suffix)))
    return _read_files(paths(), max_bytes)


def _open_memmap(spec: str, path: Path, dtype: type[np.integer]) -> np.ndarray:
    if not path.is_file():
        raise CorpusError(f"corpus {spec!r}: {str(path)!r} is not a file.")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise CorpusError(f"corpus {spec!r}: file size {size} bytes is not a multiple of {itemsize} "
                          f"({np.dtype(dtype).name}); is the dtype right? uint16 files have even sizes, "
                          f"uint32/int32 sizes divisible by 4.")
    if size == 0:   # np.memmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _open_npy(spec: str, path: Path) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise CorpusError(f"corpus {spec!r}: {str(path)!r} is not a readable .npy array ({e}).") from e
    if arr.ndim != 1 or arr.dtype.kind not in "ui":
        raise CorpusError(f"corpus {spec!r}: a .npy corpus must be a 1-D integer array of token ids, got "
                          f"shape {arr.shape} dtype {arr.dtype}; save it with np.save(path, ids.reshape(-1)).")
    return arr

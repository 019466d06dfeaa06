"""Byte-level tokenizer: a token is one byte, so the vocabulary is 256 and nothing is unknown. Text is encoded
as UTF-8; raw bytes (any encoding, or none) are tokens as they are, with no decoding."""

from __future__ import annotations

from typing import Iterable

import numpy as np


class ByteTokenizer:
    """encode: str -> UTF-8 byte values (ints 0..255); decode: the inverse. No special tokens."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        """Every byte is its own token: nothing is decoded, so no byte sequence is an error."""
        return list(data)

    def encode_array(self, text: str) -> np.ndarray:
        """Bulk form of `encode`: a uint16 array (the corpus dtype), without a Python int per byte."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Bytes back to text. Accepts a list, numpy array or torch tensor of ids. A window cut in the
        middle of a multi-byte character decodes with U+FFFD replacement characters, not an error."""
        if hasattr(ids, "detach"):   # a torch tensor; avoid importing torch here
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = arr[(arr < 0) | (arr >= self.vocab_size)][0]
            raise ValueError(f"ByteTokenizer.decode: token id {int(bad)} is outside 0..{self.vocab_size - 1}; "
                             f"these ids did not come from the byte tokenizer (is the model's vocab_size 256?).")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

"""Offline data: byte tokenizer, corpora (stdlib, text, memmap) and the distributed token loader.

    from shardwise.data import load_corpus, TokenLoader
    tokens = load_corpus("stdlib")
    loader = TokenLoader(tokens, seq_len=128, micro_batch=8, grad_accum=2, dp_size=2, dp_rank=0, seed=0)
    input_ids, labels = next(loader)
"""

from shardwise.data.corpora import (DEFAULT_STDLIB_MAX_BYTES, CorpusError, CorpusKind, CorpusSpec, check_length,
                                    check_vocab, load_corpus, parse_spec, stdlib_root)
from shardwise.data.loader import Batch, TokenLoader
from shardwise.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer", "load_corpus", "CorpusError", "TokenLoader", "Batch", "check_length", "check_vocab",
    "CorpusKind", "CorpusSpec", "parse_spec", "stdlib_root", "DEFAULT_STDLIB_MAX_BYTES",
]

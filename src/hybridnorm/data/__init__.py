"""The offline data layer: corpora (the embedded KJV by default), tokenizers, memory-mapped token files and
deterministic, resumable batches. ``prepare_data()`` is the one-call entry point."""

from hybridnorm.data.corpus import (
    KJV_VAL_BOOKS,
    Corpus,
    SourceDigest,
    kjv_path,
    load_corpus,
    source_digest,
    source_fingerprint,
)
from hybridnorm.data.loader import TokenBatches, val_batch_count, val_batches
from hybridnorm.data.prepare import DataStats, PreparedData, prepare_data
from hybridnorm.data.tokenizer import (
                                       EOT,
                                       BPETokenizer,
                                       ByteTokenizer,
                                       Tokenizer,
                                       get_tokenizer,
                                       load_tokenizer,
                                       resolve_cache_dir,
                                       train_bpe,
)
from hybridnorm.data.tokens import (
    bigram_entropy,
    open_tokens,
    read_meta,
    scored_references,
    tokenize_to_memmap,
    unigram_entropy,
)

__all__ = [
    "EOT", "KJV_VAL_BOOKS", "BPETokenizer", "ByteTokenizer", "Corpus", "DataStats", "PreparedData", "SourceDigest",
    "TokenBatches", "Tokenizer", "bigram_entropy", "get_tokenizer", "kjv_path", "load_corpus", "load_tokenizer",
    "open_tokens", "prepare_data", "read_meta", "resolve_cache_dir", "scored_references", "source_digest",
    "source_fingerprint",
    "tokenize_to_memmap", "train_bpe", "unigram_entropy", "val_batch_count", "val_batches",
]

#!/usr/bin/env python3
"""Real-text Engram trace: the row ids DeepSeek-V4.1-Flash's two Engram layers would look up.

The same prose and tokens as ``bench/sim/text_trace.py`` (the Python reference
topics, git's release notes; the Qwen3.5/3.6 tokenizer), hashed with vLLM
0.33's Engram hash (``pleclient.engram``, tested bit-equal to vLLM's
``_hash_ids_kernel``) at DeepSeek-V4.1-Flash's geometry: Engram on decoder
layers 1 and 14, n-grams of 2, 3 and 4 tokens, 8 heads each (24 ids a token
a layer, 48 in all), head vocabularies of the primes after 16 000 000 drawn
in (layer, order, head) order, so 384 006 168 and 384 016 682 rows of 256
FP8 values (and 8 UE8M0 scales) a layer.

No DeepSeek-V4.1 tokenizer ships here. The compressed token map (vLLM's
``build_compressed_token_map``: every token decoded alone and normalized, the
tokens that normalize alike sharing an id) is built from the Qwen vocabulary
with the same rule (``pleclient.engram.compressed_map_of``), and the pad id
is Qwen's end of text. What the trace keeps of real text is what a cache
sees: which n-grams repeat, and how often. Qwen's token 129 264 is vLLM's
image sentinel for the Engram hash (``DEAD_TOKEN_ID``): where the text has
it, its n-grams stop there, as at an image.

The file (``--out``, default ``bench/traces/engram-text.npz``, about 4 MB)
holds the tokens, the documents' starts, the compressed map and the
geometry, not the ids (48 a token would make it 100 MB, more than a device
call carries): ``bench.sim.text_trace.load_trace`` hashes them when it loads
the file, each document from the start of a request as the PLE trace's are,
and each layer's ids offset past the rows of the layers before it, so that
the ids of both layers index one table of both layers' rows (``Trace.rows``).

    python -m bench.sim.engram_trace                  # bench/traces/engram-text.npz
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import time

import numpy as np

from bench.harness.checkout import ENGRAM_TRACE
from bench.harness.scaffold import parser
from bench.sim.text_trace import (
    ENGRAM_FORMAT,
    SOURCES,
    add_text_args,
    sha256_bytes,
    tokenized,
    write_npz,
)
from pleclient.engram import EngramConfig, EngramHasher, compressed_map_of

log = logging.getLogger("bench.sim.engram_trace")

FORMAT = ENGRAM_FORMAT
LAYER_IDS = (1, 14)  # DeepSeek-V4.1-Flash's Engram layers (0-based decoder layers)
MAX_NGRAM = 4
N_HEADS = 8
ENGRAM_VOCAB = 16_000_000  # gives the real model's 384 006 168 and 384 016 682 rows


def qwen_compressed_map(tok) -> tuple[np.ndarray, int]:
    """The compressed map of the Qwen vocabulary (a tiktoken encoding and its
    special tokens), each token decoded alone; a token whose bytes are not
    whole UTF-8 keyed by its bytes."""
    encoding = tok._tokenizer
    specials = {i: name for name, i in tok._special_tokens.items()}

    def spelled(token: int) -> tuple[str, str]:
        if token in specials:
            return specials[token], specials[token]
        raw = encoding.decode_single_token_bytes(token)
        return raw.decode("utf-8", errors="replace"), "bytes:" + raw.hex()

    return compressed_map_of(spelled(t) for t in range(encoding.n_vocab))


def config_of(meta: dict) -> EngramConfig:
    g = meta["geometry"]
    return EngramConfig(
        layer_ids=tuple(g["layer_ids"]),
        max_ngram_size=g["max_ngram_size"],
        n_heads=g["n_heads"],
        compressed_vocab_size=g["compressed_vocab_size"],
        pad_token_id=g["pad_token_id"],
        vocab_size=g["engram_vocab_size"],
    )


def engram_ids(tokens: np.ndarray, doc_starts: np.ndarray, token_map: np.ndarray, meta: dict):
    """int64 [tokens, 24 · layers]: every layer's ids of every token, each
    document hashed as a request of its own, layer k's offset by the rows of
    layers 0..k-1 (the trace's ``rows`` are all layers' together)."""
    hasher = EngramHasher(config_of(meta), token_map.astype(np.int64))
    columns, offset = [], 0
    for layer in hasher.layers:
        ids = np.concatenate(
            [layer.row_ids(tokens[a:b]) for a, b in itertools.pairwise(doc_starts)]
        )
        columns.append(ids + offset)
        offset += layer.rows
    return np.concatenate(columns, axis=1)


def build(args) -> dict:
    docs = tokenized(args)
    t0 = time.monotonic()
    token_map, size = qwen_compressed_map(docs.tokenizer)
    took = time.monotonic() - t0
    log.info("compressed %d tokens to %d ids in %.1f s", len(token_map), size, took)
    config = EngramConfig(
        layer_ids=LAYER_IDS,
        max_ngram_size=MAX_NGRAM,
        n_heads=N_HEADS,
        compressed_vocab_size=size,
        pad_token_id=int(docs.eos),
        vocab_size=ENGRAM_VOCAB,
    )
    hasher = EngramHasher(config, token_map)
    tokens = np.concatenate(docs.tokens)
    meta = {
        "format": FORMAT,
        "sources": docs.sources,
        "documents": docs.names,
        "tokens": len(tokens),
        "tokenizer": docs.tokenizer_meta,
        "hasher": {
            "module": "pleclient.engram.EngramHasher (bit-equal to vLLM 0.33's "
            "vllm.models.deepseek_v41.common.engram._hash_ids_kernel)",
            "token_map": "pleclient.engram.compressed_map_of over the Qwen vocabulary",
            "context": "each document one request",
        },
        "geometry": {
            "model": "DeepSeek-V4.1-Flash",
            "layer_ids": list(LAYER_IDS),
            "max_ngram_size": MAX_NGRAM,
            "n_heads": N_HEADS,
            "compressed_vocab_size": size,
            "pad_token_id": int(docs.eos),
            "engram_vocab_size": ENGRAM_VOCAB,
            "heads": config.hash_cols * len(LAYER_IDS),
            "ids_per_layer": config.hash_cols,
            "layer_rows": [layer.rows for layer in hasher.layers],
            "rows": sum(layer.rows for layer in hasher.layers),
        },
        "args": {"max_tokens": args.max_tokens, "min_doc_tokens": args.min_doc_tokens},
    }
    doc_starts = np.cumsum([0, *(len(t) for t in docs.tokens)]).astype(np.int64)
    write_npz(
        args.out,
        {
            "tokens": tokens,
            "doc_starts": doc_starts,
            "token_map": token_map.astype(np.int32),
            "meta": np.array(json.dumps(meta, sort_keys=True)),
        },
    )
    return meta


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__, work_dir=False)
    ap.add_argument("--out", default=ENGRAM_TRACE, help="where the trace goes")
    add_text_args(ap)
    args = ap.parse_args(argv)
    args.source = args.source or list(SOURCES)
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    meta = build(args)
    with open(args.out, "rb") as f:
        digest = sha256_bytes(f.read())
    print(
        f"{args.out}: {meta['tokens']} tokens, {len(meta['documents'])} documents, "
        f"{meta['geometry']['rows']:,} rows over layers {meta['geometry']['layer_ids']}, "
        f"{os.path.getsize(args.out) / 2**20:.1f} MiB, sha256 {digest}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

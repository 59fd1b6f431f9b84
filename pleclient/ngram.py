"""The row ids a Qwen4Exp PLE layer looks up, computed from token ids alone.

vLLM 0.33's ``Qwen4ExpNGramEmbedding.compute_ngram_ids`` hashes the n-grams
ending at every token into one row id per n-gram head. Its inputs are token ids
and a few constants, so a process that has no model — the server, or vLLM's
engine-core process — can compute the same ids as soon as a prompt's tokens are
known, and ask for the rows before any worker needs them. This module does, with
numpy, from the checkpoint directory:

    hasher = NgramHasher.from_checkpoint("/models/Qwen3.8-Flash-Next")
    for layer in hasher.layers:                        # one per PLE table
        ids = layer.row_ids(prompt)                    # int64 [tokens, heads]
        later = layer.row_ids(chunk, context=prompt[:start])  # a later chunk
        client.lookup(layer.table, ids)                # server rows, as vLLM reads them

The hash, for a token ``x[t]`` of one request (``N = ngram_size``, heads of
order ``n = 2..N`` are the ``heads_per_ngram`` heads of block ``n - 2``)::

    p_k    = the token k places before x[t] (k = 1..N-1), from the request's
             previous tokens (the n-gram context) where the chunk has none;
             EOS once an EOS was passed on the way back (p_1..p_{k-1}), and EOS
             before the start of the request
    mixed  = x[t]·m[0] ^ p_1·m[1] ^ … ^ p_{n-1}·m[n-1]     (int64, wrapping)
    id[h]  = floor_mod(mixed, size[h]) + offset[h]        (h a head of order n)

Where the constants come from — exactly as vLLM's module gets them:

* ``m`` (``layer_multipliers``), ``size`` (``ngram_heads_vocab_sizes``) and
  ``offset`` (``ngram_heads_offsets``) are persistent buffers of the module.
  vLLM's constructor derives them from the config (``_make_layer_multipliers``:
  splitmix64 of ``seed + 10007·dense_id``; ``_make_vocab_layout``: the primes
  after ``ngram_vocab_size_base``, ``heads`` per layer, consecutive over the
  layers); its ``load_weights`` then replaces each one the checkpoint holds
  (``<…>.ple.ple_embedding.layer_multipliers`` etc., as transformers writes
  them). ``NgramLayer.sources`` says which one each buffer came from.
* ``dense_id`` is the layer's index among the sorted ``ple_layer_ids`` of the
  config (1-based decoder layer numbers; tables are named by the 0-based one).
* EOS, the vocabulary size, ``seed``, ``ngram_size``, ``heads_per_ngram``,
  ``ngram_vocab_size_base`` and ``make_ngram_vocab_size_divisible_by`` come from
  ``config.json`` (its ``text_config`` when it has one, as vLLM's
  ``hf_text_config``), with transformers' ``Qwen4ExpTextConfig`` defaults for
  keys it leaves out.

The ids are the rows of the served table as they are: the plugin's storage
sends ``compute_ngram_ids``' output to the server unchanged (global ids, head
offsets included, the same on every tensor-parallel rank; only vLLM's own
storage shards the vocabulary), and the server's table holds every row of the
checkpoint (``rows`` = the padded n-gram vocabulary).

Context follows vLLM's ``query_start_loc`` / ``ngram_context``: a chunk that
starts a request has ``N - 1`` EOS before it (``context=None``); a later chunk
has the request's previous tokens (its model runner copies the last ``N - 1``
of them, EOS where there are fewer). ``row_ids(tokens, context)`` takes the
previous tokens, any number of them; ``batch_ids`` takes vLLM's batch layout
itself. Both are tested equal, bit for bit, to ``compute_ngram_ids``.

Speed (``bench/micro/ngram_hash.py``): numpy, whose loops over the arrays (the
products, the modulo) run with the GIL released; a 32 768-token prompt at
Qwen3.8-Flash-Next geometry (524 288 ids per PLE layer) in about 2 ms on one
x86-64 core, ≈ 0.55 × the speed of its one unavoidable step, a 64-bit modulo
per id, and ≈ 14 × vLLM's own CPU path on one thread.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from pleclient.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    TableSpec,
    TensorEntry,
    discover_tables,
    read_header,
)

log = logging.getLogger("pleclient.ngram")

CONFIG_FILE = "config.json"
TABLE_SUFFIX = ".ngram_embedding"
"""A table is named ``<module>.ngram_embedding``; its hash buffers ``<module>.<buffer>``."""
BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
"""The module's persistent hash buffers, as vLLM's ``load_weights`` names them."""

# vLLM's Qwen4ExpNGramEmbedding constants (splitmix64 and the per-layer seed step).
_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_PLE_LAYER_PRIME = 10007

_INT_DTYPES = {
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
}
"""Buffer dtypes converted exactly to int64 (vLLM copies buffers in with ``.to(long)``)."""


class NgramConfigError(ValueError):
    """The checkpoint's config or hash buffers cannot give vLLM's row ids."""


# ------------------------------------------------------------------ config
@dataclass(frozen=True)
class NgramConfig:
    """The config keys the hashing reads; defaults are transformers'
    ``Qwen4ExpTextConfig`` defaults (a saved config leaves them out)."""

    eos_token_id: int
    vocab_size: int = 248_320
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    ple_layer_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            values = value if f.name == "ple_layer_ids" else (value,)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise NgramConfigError(
                    f"config {f.name} = {value!r}: vLLM 0.33 reads "
                    f"{'a list of integers' if f.name == 'ple_layer_ids' else 'one integer'}"
                )
        checks = (
            (self.ngram_size >= 2, "ngram_size must be >= 2"),
            (self.heads_per_ngram > 0, "heads_per_ngram must be > 0"),
            (self.vocab_size > 0, "vocab_size must be > 0"),
            (self.make_ngram_vocab_size_divisible_by > 0, "make_ngram_vocab_size_divisible_by > 0"),
            (self.ngram_vocab_size_base >= 1, "ngram_vocab_size_base must be >= 1"),
        )
        for ok, what in checks:
            if not ok:
                raise NgramConfigError(f"config: {what} ({self})")

    @property
    def heads(self) -> int:
        """Row ids per token and PLE layer: (ngram_size - 1) × heads_per_ngram."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    def dense_id(self, layer: int) -> int:
        """The index among PLE layers of decoder layer ``layer`` (0-based, as in
        tensor names), which vLLM's layout and multipliers are built from."""
        ordered = sorted(set(self.ple_layer_ids))
        if layer + 1 not in ordered:
            raise NgramConfigError(
                f"decoder layer {layer} (ple_layer_ids counts from 1: {layer + 1}) is not "
                f"a PLE layer of the config (ple_layer_ids = {ordered}); vLLM builds no "
                "PLE embedding there. The checkpoint's tables and config.json disagree"
            )
        return ordered.index(layer + 1)

    @classmethod
    def from_dict(cls, config: dict, *, where: str = "config") -> NgramConfig:
        """From a ``config.json`` dict: its ``text_config`` if it has one."""
        text = config.get("text_config")
        if isinstance(text, dict):
            config = text
            where += " text_config"
        eos = config.get("eos_token_id")
        if eos is None:
            raise NgramConfigError(
                f"{where}: no eos_token_id; vLLM's PLE hashing needs one (n-grams "
                "restart after it, and a request starts from it)"
            )
        if isinstance(eos, list):
            raise NgramConfigError(
                f"{where}: eos_token_id is a list {eos}; vLLM 0.33's PLE hashing takes "
                "one integer (int(config.eos_token_id)) and would refuse this config"
            )
        kwargs = {
            f.name: config[f.name]
            for f in fields(cls)
            if f.name != "eos_token_id" and config.get(f.name) is not None
        }
        if "ple_layer_ids" in kwargs:
            layer_ids = kwargs["ple_layer_ids"]
            if not isinstance(layer_ids, list):
                raise NgramConfigError(f"{where}: ple_layer_ids = {layer_ids!r}, not a list")
            kwargs["ple_layer_ids"] = tuple(layer_ids)
        try:
            return cls(eos_token_id=eos, **kwargs)
        except NgramConfigError as exc:
            raise NgramConfigError(f"{where}: {exc}") from None

    @classmethod
    def from_checkpoint(cls, model_dir: str) -> NgramConfig:
        path = os.path.join(model_dir, CONFIG_FILE)
        try:
            with open(path) as f:
                config = json.load(f)
        except FileNotFoundError:
            raise NgramConfigError(
                f"{path} not found: the PLE hashing constants come from the model's "
                "config; pass the model's snapshot directory (the one vLLM loads)"
            ) from None
        except (OSError, ValueError) as exc:
            raise NgramConfigError(f"{path}: unreadable ({exc})") from None
        if not isinstance(config, dict):
            raise NgramConfigError(f"{path}: not a JSON object")
        return cls.from_dict(config, where=path)


# --------------------------------------------------- vLLM's derived buffers
def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def is_prime(value: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit integers (the bases vLLM's PLE
    code uses; its Engram code's, 2, 7 and 61, are exact below 4.7·10⁹, far
    past any ``engram_vocab_size``'s primes, so both give the same primes)."""
    if value < 2:
        return False
    for prime in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if value % prime == 0:
            return value == prime
    odd, shifts = value - 1, 0
    while odd % 2 == 0:
        odd //= 2
        shifts += 1
    for base in (2, 325, 9375, 28178, 450775, 9780504, 1795265022):
        if base % value == 0:
            continue
        witness = pow(base, odd, value)
        if witness in (1, value - 1):
            continue
        for _ in range(shifts - 1):
            witness = pow(witness, 2, value)
            if witness == value - 1:
                break
        else:
            return False
    return True


def _primes_after(start: int, count: int) -> list[int]:
    """The first ``count`` primes greater than ``start``."""
    primes: list[int] = []
    prime = start
    while len(primes) < count:
        candidate = prime + 1
        if candidate <= 2:
            prime = 2
        else:
            candidate |= 1
            while not is_prime(candidate):
                candidate += 2
            prime = candidate
        primes.append(prime)
    return primes


def derived_multipliers(config: NgramConfig, dense_id: int) -> list[int]:
    """vLLM's ``_make_layer_multipliers``: odd, below 2**63 / vocab_size."""
    half_bound = max(1, ((1 << 63) - 1) // config.vocab_size // 2)
    seed = config.seed + _PLE_LAYER_PRIME * dense_id
    return [
        2 * (_splitmix64(seed + _SPLITMIX_GAMMA * (index + 1)) % half_bound) + 1
        for index in range(config.ngram_size)
    ]


def derived_vocab_layout(config: NgramConfig, dense_id: int) -> tuple[list[int], list[int]]:
    """vLLM's ``_make_vocab_layout``: per head the next prime after
    ``ngram_vocab_size_base - 1`` (counted over the heads of every earlier PLE
    layer too), and each head's offset in the layer's table."""
    first = dense_id * config.heads
    sizes = _primes_after(config.ngram_vocab_size_base - 1, first + config.heads)[first:]
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    return sizes, offsets


def padded_rows(config: NgramConfig, sizes: Sequence[int]) -> int:
    """The table's rows: the layer's heads, rounded up to the divisor."""
    divisor = config.make_ngram_vocab_size_divisible_by
    return -(-sum(sizes) // divisor) * divisor


# ------------------------------------------------------------------- layer
@dataclass(frozen=True, eq=False)
class NgramLayer:
    """One PLE layer's hashing: its constants and the ids of any tokens.

    ``table`` is the checkpoint's (and the server's catalog's) table name, empty
    when built from a config alone; ``layer`` the 0-based decoder layer of its
    name; ``rows`` the table's rows (every id is below it)."""

    config: NgramConfig
    dense_id: int
    multipliers: np.ndarray  # int64 [ngram_size]
    vocab_sizes: np.ndarray  # int64 [heads]
    offsets: np.ndarray  # int64 [heads]
    rows: int
    table: str = ""
    layer: int = -1
    sources: dict[str, str] = field(default_factory=dict)  # buffer -> "checkpoint" | "config"

    def __post_init__(self) -> None:
        heads, n = self.config.heads, self.config.ngram_size
        for name, array, length in (
            ("layer_multipliers", self.multipliers, n),
            ("ngram_heads_vocab_sizes", self.vocab_sizes, heads),
            ("ngram_heads_offsets", self.offsets, heads),
        ):
            if array.dtype != np.int64 or array.shape != (length,):
                raise NgramConfigError(
                    f"{self._name}: {name} must be int64 [{length}], not "
                    f"{array.dtype} {list(array.shape)}"
                )
            array.setflags(write=False)
        if (self.vocab_sizes <= 0).any():
            raise NgramConfigError(
                f"{self._name}: ngram_heads_vocab_sizes {self.vocab_sizes.tolist()} must all "
                "be positive (each is the modulus of a head)"
            )
        low = int(self.offsets.min())
        high = int((self.offsets + self.vocab_sizes).max())
        if low < 0 or high > self.rows:
            raise NgramConfigError(
                f"{self._name}: heads reach rows [{low}, {high}) (offsets "
                f"{self.offsets.tolist()}, sizes {self.vocab_sizes.tolist()}), outside "
                f"the table's {self.rows} rows; the hash buffers do not belong to this table"
            )

    @property
    def _name(self) -> str:
        return self.table or f"PLE layer (dense id {self.dense_id})"

    @property
    def heads(self) -> int:
        return self.config.heads

    @property
    def eos_token_id(self) -> int:
        return self.config.eos_token_id

    @classmethod
    def from_config(
        cls, config: NgramConfig, dense_id: int, *, table: str = "", layer: int = -1
    ) -> NgramLayer:
        """The constants vLLM's constructor derives (no checkpoint buffers)."""
        sizes, offsets = derived_vocab_layout(config, dense_id)
        return cls(
            config=config,
            dense_id=dense_id,
            multipliers=np.array(derived_multipliers(config, dense_id), dtype=np.int64),
            vocab_sizes=np.array(sizes, dtype=np.int64),
            offsets=np.array(offsets, dtype=np.int64),
            rows=padded_rows(config, sizes),
            table=table,
            layer=layer,
            sources=dict.fromkeys(BUFFERS, "config"),
        )

    # ---------------------------------------------------------------- ids
    def row_ids(self, tokens, context=None, *, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[len(tokens), heads]``: the rows each token of one request looks up.

        ``context``: the request's tokens before ``tokens`` (any number; the last
        ``ngram_size - 1`` count), or None when ``tokens`` start the request."""
        tokens = _tokens(tokens, "tokens")
        span = self.config.ngram_size - 1
        seq = np.concatenate([self._context(context), tokens])
        n = len(tokens)
        previous = [seq[span - k : span - k + n] for k in range(1, span + 1)]
        return self._hash(tokens, previous, out)

    def batch_ids(self, input_ids, query_start_loc, ngram_context) -> np.ndarray:
        """``compute_ngram_ids(input_ids, query_start_loc, ngram_context)`` in
        vLLM's own batch layout: request ``r`` has tokens ``[qsl[r], qsl[r+1])``
        and context row ``r`` (its ``ngram_size - 1`` previous tokens, oldest
        first); tokens past ``qsl[-1]`` (graph padding) continue the last request."""
        tokens = _tokens(input_ids, "input_ids")
        qsl = _tokens(query_start_loc, "query_start_loc")
        span = self.config.ngram_size - 1
        context = np.asarray(ngram_context)
        requests = len(qsl) - 1
        if requests < 1 or qsl[0] != 0 or (np.diff(qsl) < 0).any() or qsl[-1] > len(tokens):
            raise ValueError(
                f"query_start_loc {qsl.tolist()[:8]}: one or more requests, from 0, never "
                f"decreasing, ending within the {len(tokens)} input ids"
            )
        if context.ndim != 2 or context.shape[0] < requests or context.shape[1] != span:
            raise ValueError(
                f"ngram_context has shape {list(context.shape)}; {requests} request(s) need "
                f"[>= {requests}, {span}]"
            )
        context = _tokens(context[:requests].reshape(-1), "ngram_context").reshape(-1, span)
        positions = np.arange(len(tokens))
        request = np.minimum(np.searchsorted(qsl, positions, side="right") - 1, requests - 1)
        in_chunk = positions - qsl[request]
        previous = []
        for k in range(1, span + 1):
            here = in_chunk >= k
            from_chunk = tokens[np.maximum(positions - k, 0)]
            from_context = context[request, np.clip(span - k + in_chunk, 0, span - 1)]
            previous.append(np.where(here, from_chunk, from_context))
        return self._hash(tokens, previous, None)

    def _context(self, context) -> np.ndarray:
        """The ``ngram_size - 1`` tokens before a chunk, EOS where there are none."""
        span = self.config.ngram_size - 1
        known = _tokens(() if context is None else context, "context")[-span:]
        pad = np.full(span - len(known), self.config.eos_token_id, dtype=np.int64)
        return np.concatenate([pad, known])

    def _hash(self, current: np.ndarray, previous: list[np.ndarray], out) -> np.ndarray:
        """``previous[k-1]``: the token k places back of each token, raw."""
        n, heads, per = len(current), self.heads, self.config.heads_per_ngram
        if out is None:
            out = np.empty((n, heads), dtype=np.int64)
        elif out.dtype != np.int64 or out.shape != (n, heads) or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous int64 [{n}, {heads}]")
        eos = self.config.eos_token_id
        # hashes[k-1]: of the n-grams of k + 1 tokens; int64 products wrap, as torch's do.
        hashes = []
        mixed = current * self.multipliers[0]
        crossed = None
        for k, token in enumerate(previous, start=1):
            # Past an EOS on the way back, every older token reads as EOS.
            step = token if crossed is None else np.where(crossed, eos, token)
            crossed = token == eos if crossed is None else crossed | (token == eos)
            mixed = mixed ^ (step * self.multipliers[k])
            hashes.append(mixed)
        # Head by head, one long loop each: a broadcast [tokens, heads] modulo
        # runs numpy's inner loop 8 elements at a time, at about half the speed.
        for head, (size, offset) in enumerate(
            zip(self.vocab_sizes.tolist(), self.offsets.tolist(), strict=True)
        ):
            column = out[:, head]
            # floor_mod, as torch.remainder: a wrapped negative hash stays in range.
            np.remainder(hashes[head // per], size, out=column)
            column += offset
        return out


def _tokens(values, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a 1-D array of integers, not {array.dtype} {array.shape}")
    if array.dtype == np.uint64 and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what}: values past int64 (vLLM's ids are int64)")
    return array.astype(np.int64, copy=False)


# ------------------------------------------------------------------ hasher
class NgramHasher:
    """Every PLE layer of a checkpoint, in layer order (``layers``)."""

    def __init__(self, config: NgramConfig, layers: Sequence[NgramLayer]) -> None:
        self.config = config
        self.layers: tuple[NgramLayer, ...] = tuple(sorted(layers, key=lambda ly: ly.layer))

    @classmethod
    def from_checkpoint(cls, model_dir: str) -> NgramHasher:
        """From ``config.json`` and the hash buffers the checkpoint holds, one
        layer per PLE table found (``pleclient.checkpoint.discover_tables``).
        Raises ``NgramConfigError`` (or ``CheckpointError``) naming what is wrong."""
        model_dir = os.path.abspath(model_dir)
        config = NgramConfig.from_checkpoint(model_dir)
        tables = discover_tables(model_dir, fingerprint=False)
        wanted = {
            f"{t.name[: -len(TABLE_SUFFIX)]}.{b}": t.name
            for t in tables
            if t.name.endswith(TABLE_SUFFIX)
            for b in BUFFERS
        }
        entries = _tensor_entries(model_dir, set(wanted))
        layers = [_checkpoint_layer(config, table, entries) for table in tables]
        missing = sorted(set(config.ple_layer_ids) - {ly.layer + 1 for ly in layers})
        if missing:
            log.warning(
                "%s: config.json has PLE layers %s (ple_layer_ids, from 1) with no table "
                "in the checkpoint; hashing the %d layer(s) that have one",
                model_dir,
                missing,
                len(layers),
            )
        return cls(config, layers)

    def layer(self, key: int | str | NgramLayer) -> NgramLayer:
        """A layer by decoder layer index (as in table names and ``TableInfo.layer``)
        or by table name (or its end, ``layers.<L>.ple.ple_embedding.ngram_embedding``)."""
        if isinstance(key, NgramLayer):
            return key
        found = [
            ly
            for ly in self.layers
            if (
                ly.layer == key
                if isinstance(key, int)
                else ly.table == key or ly.table.endswith("." + str(key))
            )
        ]
        if len(found) != 1:
            known = ", ".join(f"{ly.layer}: {ly.table}" for ly in self.layers)
            raise KeyError(f"{'several' if found else 'no'} PLE layer(s) for {key!r}; {known}")
        return found[0]

    def row_ids(self, layer: int | str | NgramLayer, tokens, context=None) -> np.ndarray:
        """``self.layer(layer).row_ids(tokens, context)``."""
        return self.layer(layer).row_ids(tokens, context)


def _checkpoint_layer(
    config: NgramConfig, table: TableSpec, entries: dict[str, TensorEntry]
) -> NgramLayer:
    """A table's layer: buffers from the checkpoint where it has them (vLLM's
    ``load_weights`` copies those over the derived ones), else derived."""
    dense_id = config.dense_id(table.layer)
    derived = NgramLayer.from_config(config, dense_id)
    module = table.name[: -len(TABLE_SUFFIX)]
    values = {
        "layer_multipliers": derived.multipliers,
        "ngram_heads_vocab_sizes": derived.vocab_sizes,
        "ngram_heads_offsets": derived.offsets,
    }
    sources = dict(derived.sources)
    for buffer, want in values.items():
        entry = entries.get(f"{module}.{buffer}")
        if entry is None:
            continue
        values[buffer] = _read_buffer(entry, want.shape)
        sources[buffer] = "checkpoint"
    if table.rows != derived.rows:
        raise NgramConfigError(
            f"{table.name}: the checkpoint's table has {table.rows} rows, but config.json "
            f"makes it {derived.rows} (heads {derived.vocab_sizes.tolist()} padded to "
            f"{config.make_ngram_vocab_size_divisible_by}); vLLM would refuse to load it. "
            "The config does not belong to these tables"
        )
    return NgramLayer(
        config=config,
        dense_id=dense_id,
        multipliers=values["layer_multipliers"],
        vocab_sizes=values["ngram_heads_vocab_sizes"],
        offsets=values["ngram_heads_offsets"],
        rows=table.rows,
        table=table.name,
        layer=table.layer,
        sources=sources,
    )


def _tensor_entries(model_dir: str, names: set[str]) -> dict[str, TensorEntry]:
    """Where the tensors ``names`` are (those the checkpoint has): through the
    index when there is one, else in every safetensors file's header."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise NgramConfigError(f"{index}: unreadable index ({exc}); fix or remove it") from None
        files = sorted({os.path.join(model_dir, weight_map[n]) for n in names if n in weight_map})
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    found: dict[str, TensorEntry] = {}
    for path in files:
        tensors, problems = read_header(path)
        if problems:
            raise CheckpointError(model_dir, problems)
        found.update({n: e for n, e in tensors.items() if n in names})
    return found


def _read_buffer(entry: TensorEntry, shape: tuple[int, ...]) -> np.ndarray:
    """One hash buffer as int64, checked as vLLM's ``load_weights`` checks it."""
    if entry.shape != shape:
        raise NgramConfigError(
            f"{entry.path}: {entry.name} has shape {list(entry.shape)}, but the config "
            f"makes it {list(shape)}; vLLM refuses to load it (shape mismatch)"
        )
    if entry.dtype not in _INT_DTYPES:
        raise NgramConfigError(
            f"{entry.path}: {entry.name} is {entry.dtype}; a hash buffer holds integers "
            f"({', '.join(_INT_DTYPES)})"
        )
    dtype = np.dtype(_INT_DTYPES[entry.dtype])
    if entry.nbytes != dtype.itemsize * int(np.prod(shape)):
        raise NgramConfigError(
            f"{entry.path}: {entry.name}: {entry.nbytes} bytes for {list(shape)} {entry.dtype}"
        )
    with open(entry.path, "rb") as f:
        f.seek(entry.offset)
        raw = f.read(entry.nbytes)
    return np.frombuffer(raw, dtype=dtype).astype(np.int64)


__all__ = [
    "NgramConfig",
    "NgramConfigError",
    "NgramHasher",
    "NgramLayer",
    "derived_multipliers",
    "derived_vocab_layout",
    "padded_rows",
]

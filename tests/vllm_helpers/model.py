"""Building real vLLM 0.33 Qwen4Exp PLE modules on CPU, for the plugin tests.

Used inside scenario processes (``tests.vllm_helpers.scenarios``) and, for the
checkpoint geometry, by the pytest process. Geometry is tiny: 16 n-gram heads
of 16 columns, about 9 000 rows per table, 4 shards.
"""

from __future__ import annotations

import glob
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch

HEADS_PER_NGRAM = 8
NGRAM_SIZE = 3
HEADS = (NGRAM_SIZE - 1) * HEADS_PER_NGRAM
COLS = 16
PARTS = 4
EOS = 7
UNIGRAM_VOCAB = 1000
NGRAM_VOCAB_BASE = 500
DIVISOR = 8
FP8_SCALE = 0.0625
NVFP4_GLOBAL_SCALE = 0.0123  # weight_scale_2; not a power of two, so rounding shows


@dataclass(frozen=True)
class PleLayer:
    layer: int  # decoder layer index (in names: model.layers.<layer>.ple…)
    dense_id: int  # index among PLE layers (feeds the hash layout)
    dtype: str  # checkpoint row dtype

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer}.ple.ple_embedding"

    @property
    def rows(self) -> int:
        from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
        from vllm.utils.math_utils import round_up

        _, _, total = Qwen4ExpNGramEmbedding._make_vocab_layout(
            ngram_vocab_size_base=NGRAM_VOCAB_BASE,
            ngram_heads=HEADS,
            ple_dense_layer_id=self.dense_id,
        )
        return round_up(total, DIVISOR)


FP8_LAYER = PleLayer(layer=1, dense_id=0, dtype="F8_E4M3")
BF16_LAYER = PleLayer(layer=3, dense_id=1, dtype="BF16")
LAYERS = (FP8_LAYER, BF16_LAYER)
NVFP4_LAYER = PleLayer(layer=5, dense_id=2, dtype="NVFP4")
"""An NVFP4 table (packed values + block scales + weight_scale_2); its own
checkpoint (``write_test_checkpoint(..., layers=(NVFP4_LAYER,))``)."""

SCALES = {"F8_E4M3": FP8_SCALE, "NVFP4": NVFP4_GLOBAL_SCALE}


def synthetic_tables(layers=LAYERS, parts: int = PARTS) -> list:
    from pleserver.devkit.synthetic import SyntheticTable

    return [
        SyntheticTable(
            layer=p.layer,
            rows=p.rows,
            cols=COLS,
            dtype=p.dtype,
            parts=parts,
            scale=SCALES.get(p.dtype),
        )
        for p in layers
    ]


def write_test_checkpoint(path: str, *, seed: int = 0, files: int = 3, layers=LAYERS) -> str:
    """The layers' tables over ``files`` files: with 3 files and 4 shards the
    middle file holds shards only, the outer ones mix shards with other tensors.
    config.json also holds the hashing keys of the tiny config (``hash_config``)."""
    import json

    from pleserver.devkit.synthetic import write_checkpoint

    write_checkpoint(path, synthetic_tables(layers), files=files, seed=seed)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, **hash_config()}, f, indent=1)
    return path


def hash_config() -> dict:
    """The config keys of ``text_config`` that the n-gram hashing reads, as a
    saved config.json holds them; PLE on the decoder layers of every ``PleLayer``
    (ple_layer_ids count from 1), so each layer's dense id is its own."""
    return {
        "model_type": "qwen4_exp_text",
        "vocab_size": UNIGRAM_VOCAB,
        "eos_token_id": EOS,
        "ngram_size": NGRAM_SIZE,
        "heads_per_ngram": HEADS_PER_NGRAM,
        "ngram_vocab_size_base": NGRAM_VOCAB_BASE,
        "make_ngram_vocab_size_divisible_by": DIVISOR,
        "split_ngram_parts": PARTS,
        "ple_layer_ids": [p.layer + 1 for p in (*LAYERS, NVFP4_LAYER)],
    }


def text_config(layer: PleLayer):
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=UNIGRAM_VOCAB,
        ngram_vocab_size_base=NGRAM_VOCAB_BASE,
        ngram_size=NGRAM_SIZE,
        heads_per_ngram=HEADS_PER_NGRAM,
        split_ngram_parts=PARTS,
        make_ngram_vocab_size_divisible_by=DIVISOR,
        eos_token_id=EOS,
        ple_embedding_dtype={"F8_E4M3": "float8_e4m3fn", "NVFP4": "nvfp4"}.get(layer.dtype),
    )


@contextmanager
def distributed(world_size: int = 1, rank: int = 0, init_file: str | None = None):
    """vLLM's process group over gloo. Without ``init_file``, the rendezvous file
    is a temporary one, removed afterwards (gloo leaves it behind)."""
    from vllm.distributed import init_distributed_environment

    own_file = init_file is None
    if init_file is None:
        init_file = tempfile.mktemp(prefix="vllm-dist-")
    try:
        init_distributed_environment(world_size, rank, f"file://{init_file}", rank, backend="gloo")
        yield
    finally:
        if own_file and os.path.exists(init_file):
            os.unlink(init_file)


@contextmanager
def vllm_context(
    world_size: int = 1,
    rank: int = 0,
    init_file: str | None = None,
    *,
    load_format: str | None = None,
):
    """A VllmConfig context with gloo model-parallel groups (TP = world size)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized

    with distributed(world_size, rank, init_file):
        config = VllmConfig()
        if load_format is not None:
            config.load_config.load_format = load_format
        with set_current_vllm_config(config):
            ensure_model_parallel_initialized(world_size, 1)
            yield config


def build_ngram_embedding(
    layer: PleLayer,
    *,
    max_tokens: int = 512,
    sequence_parallel: bool = False,
    platform: str = "nvidia",
):
    """The real ``Qwen4ExpNGramEmbedding`` of one PLE layer (stock or patched,
    whatever the class is at the time of the call)."""
    config = text_config(layer)
    if platform == "nvidia":
        from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

        return Qwen4ExpNGramEmbedding(
            config,
            HEADS * COLS,
            layer.dense_id,
            max_tokens,
            data_parallel_rank=0,
            prefix=layer.prefix,
            params_dtype=torch.bfloat16,
            use_sequence_parallel=sequence_parallel,
        )
    from vllm.models.qwen4_exp.amd.ple_layer import Qwen4ExpNGramEmbedding

    return Qwen4ExpNGramEmbedding(
        config,
        HEADS * COLS,
        layer.dense_id,
        max_tokens,
        layer.prefix,
        layer.prefix,
        data_parallel_rank=0,
        params_dtype=torch.bfloat16,
        use_sequence_parallel=sequence_parallel,
    )


def checkpoint_weights(model_dir: str, layer: PleLayer) -> list[tuple[str, torch.Tensor]]:
    """This layer's tensors as vLLM's safetensors iterator yields them, with the
    names relative to the n-gram embedding (what its ``load_weights`` receives)."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    prefix = layer.prefix + "."
    return [
        (name[len(prefix) :], tensor)
        for name, tensor in safetensors_weights_iterator(files, False)
        if name.startswith(prefix)
    ]


@dataclass(frozen=True)
class Batch:
    """One scheduler step: flattened input ids, request boundaries, n-gram context."""

    input_ids: torch.Tensor
    query_start_loc: torch.Tensor
    ngram_context: torch.Tensor


def mixed_batch(seed: int, *, prefills: int = 2, decodes: int = 3, prefill_len: int = 11) -> Batch:
    """Decodes first (one token, context from earlier steps), then prefills (new
    requests: EOS context; a chunked one continuing with real context)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1] * decodes + [prefill_len + i for i in range(prefills)]
    ids = torch.randint(0, UNIGRAM_VOCAB, (sum(lengths),), generator=g)
    ids[ids == EOS] = EOS + 1
    if sum(lengths) > 4:
        ids[4] = EOS  # an end of sequence inside a prefill resets the n-grams
    qsl = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    context = torch.randint(0, UNIGRAM_VOCAB, (len(lengths), NGRAM_SIZE - 1), generator=g)
    if prefills:
        context[decodes] = EOS  # a brand-new request
    return Batch(ids, qsl, context)


def big_batch(tokens: int, seed: int = 99) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, UNIGRAM_VOCAB, (tokens,), generator=g)
    return Batch(
        ids,
        torch.tensor([0, tokens], dtype=torch.int32),
        torch.full((1, NGRAM_SIZE - 1), EOS, dtype=torch.long),
    )


def run_forward(module, batch: Batch, *, prefetch: bool) -> torch.Tensor:
    """The module's output for ``batch``, through ``start_prefetch``+``forward``
    (as ``Qwen4ExpModel`` drives it) or through ``forward`` alone."""
    if prefetch:
        module.start_prefetch(batch.input_ids, batch.query_start_loc, batch.ngram_context)
    hidden = torch.zeros(batch.input_ids.shape[0], 8, dtype=torch.bfloat16)
    return module(hidden, batch.input_ids, batch.query_start_loc, batch.ngram_context)


def dequantized(module, rows: torch.Tensor) -> torch.Tensor:
    """What ``Qwen4ExpPLELayer._dequantize_embeddings`` makes of the rows."""
    return module.ngram_embedding.dequantize(rows, torch.bfloat16)

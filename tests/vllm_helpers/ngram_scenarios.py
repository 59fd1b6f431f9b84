"""vLLM 0.33's own n-gram ids, for ``tests/test_ngram.py``; run in a scenario process.

``python -m tests.vllm_helpers.ngram_scenarios vllm_ngram_ids '<json args>'``
builds every module the arguments name, runs its ``compute_ngram_ids`` (the CPU
path) over batches read from an ``.npz`` and writes the ids to another ``.npz``,
key ``<module>|<batch>``. The modules:

* ``whole``: the tiny whole ``Qwen4ExpForCausalLM`` checkpoints, each built by
  vLLM's default loader (hash buffers loaded from the checkpoint); a module per
  PLE decoder layer, ``<name>:<layer>``;
* ``synthetic``: the plugin tests' FP8, BF16 and NVFP4 n-gram embeddings
  (``tests.vllm_helpers.model``), each loaded from its checkpoint, ``synthetic:<layer>``;
* ``flash``: modules at Qwen3.8-Flash-Next's vocabulary, EOS and heads, at a
  small n-gram vocabulary (its constructor would allocate the 320 M-row table
  otherwise), ``flash:<dense id>``.

Each module hashes the batches of its family (``<family>/<batch>/{ids,qsl,context}``
in the input): ``tiny``, ``synthetic`` and ``flash``. The result also carries
vLLM's derived constants over a grid of configs, and transformers'
``Qwen4ExpTextConfig`` defaults.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tests.vllm_helpers import model as m
from tests.vllm_helpers.scenarios import main, scenario

FLASH_EOS = 248_044  # <|endoftext|> of the Qwen3.5/3.6 vocabulary
FLASH_VOCAB = 248_320


def _batches(path: str) -> dict[str, dict[str, tuple[np.ndarray, ...]]]:
    """family -> batch -> (ids, query_start_loc, ngram_context)."""
    parts: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    with np.load(path) as z:
        for key in z.files:
            family, batch, part = key.split("/")
            parts.setdefault((family, batch), {})[part] = z[key]
    families: dict[str, dict[str, tuple[np.ndarray, ...]]] = {}
    for (family, batch), p in parts.items():
        families.setdefault(family, {})[batch] = (p["ids"], p["qsl"], p["context"])
    return families


def _hash(module, batches: dict, label: str, out: dict) -> dict:
    """Every batch through ``module.compute_ngram_ids``; the module's buffers."""
    with torch.inference_mode():
        for name, (ids, qsl, context) in batches.items():
            got = module.compute_ngram_ids(
                torch.from_numpy(ids), torch.from_numpy(qsl), torch.from_numpy(context)
            )
            out[f"{label}|{name}"] = got.numpy()
    return {
        "eos": int(module.eos_token_id),
        **{
            name: getattr(module, name).tolist()
            for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
        },
    }


def _flash_module(dense_id: int, base: int):
    from transformers import Qwen4ExpTextConfig
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    config = Qwen4ExpTextConfig(
        vocab_size=FLASH_VOCAB, ngram_vocab_size_base=base, eos_token_id=FLASH_EOS
    )
    heads = (config.ngram_size - 1) * config.heads_per_ngram
    return Qwen4ExpNGramEmbedding(
        config,
        heads * 16,
        dense_id,
        64,
        data_parallel_rank=0,
        prefix=f"flash.layers.{dense_id}.ple.ple_embedding",
        params_dtype=torch.bfloat16,
    )


def _derived(grid: list[list[int]]) -> list[dict]:
    """vLLM's own derivation of the hash buffers for each config of ``grid``:
    ``[ngram_size, heads_per_ngram, vocab_size, seed, ngram_vocab_size_base, dense_id]``."""
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding as N

    result = []
    for ngram_size, per, vocab, seed, base, dense in grid:
        sizes, offsets, total = N._make_vocab_layout(
            ngram_vocab_size_base=base,
            ngram_heads=(ngram_size - 1) * per,
            ple_dense_layer_id=dense,
        )
        multipliers = N._make_layer_multipliers(
            ngram_size=ngram_size, unigram_vocab_size=vocab, seed=seed, ple_dense_layer_id=dense
        )
        result.append(
            {"sizes": sizes, "offsets": offsets, "total": total, "multipliers": multipliers}
        )
    return result


def _transformers_defaults() -> dict:
    from transformers import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig()
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(Qwen4ExpTextConfig)
        if f.name
        in (
            "vocab_size",
            "ngram_size",
            "heads_per_ngram",
            "ngram_vocab_size_base",
            "make_ngram_vocab_size_divisible_by",
            "seed",
            "eos_token_id",
            "ple_layer_ids",
        )
    }


@scenario
def vllm_ngram_ids(args: dict) -> dict:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized

    from tests.vllm_helpers import qwen4_model as qm

    batches = _batches(args["batches"])
    ids: dict[str, np.ndarray] = {}
    modules: dict[str, dict] = {}
    with m.distributed():
        for name, model_dir in args.get("whole", {}).items():
            loaded = qm.load_vllm_model(model_dir)
            for layer in qm.PLE_DECODER_LAYERS:
                module = qm.ple_layer(loaded.model, layer).ple_embedding
                modules[f"{name}:{layer}"] = _hash(module, batches["tiny"], f"{name}:{layer}", ids)
            del loaded
        with set_current_vllm_config(VllmConfig()):
            ensure_model_parallel_initialized(1, 1)
            for model_dir, layers in args.get("synthetic", []):
                for layer in (p for p in (*m.LAYERS, m.NVFP4_LAYER) if p.layer in layers):
                    module = m.build_ngram_embedding(layer)
                    module.load_weights(m.checkpoint_weights(model_dir, layer))
                    label = f"synthetic:{layer.layer}"
                    modules[label] = _hash(module, batches["synthetic"], label, ids)
            flash = args.get("flash")
            if flash:
                for dense_id in flash["dense_ids"]:
                    module = _flash_module(dense_id, flash["base"])
                    label = f"flash:{dense_id}"
                    modules[label] = _hash(module, batches["flash"], label, ids)
    np.savez(args["out"], **ids)
    return {
        "modules": modules,
        "derived": _derived(args.get("grid", [])),
        "transformers_defaults": _transformers_defaults(),
    }


if __name__ == "__main__":
    main()

"""Synthetic DeepSeek-V4.1 checkpoints for the tests: config, tokenizer, Engram tables.

transformers has no DeepSeek-V4.1 model to write one, so it is written by hand,
in one of two sizes:

* the tiny one (``python -m pleserver.devkit.deepseek_v41 DIR``), for
  module-level CPU tests of vLLM's Engram classes: ``config.json`` holds
  ``DeepseekV41ForCausalLM`` with only the Engram keys vLLM's
  ``EngramLayout`` reads in ``text_config`` (no defaults: each is set), for
  two Engram layers;
* the whole one (``--whole-model``), for ``LLM(..., load_format="dummy")``
  on a GPU host: every key vLLM 0.33's DeepSeek-V4.1 config class and NVIDIA
  model read (``whole_model_config``), with the geometry its kernels fix kept
  real and the rest small: 16 layers, Engram on layers 1 and 14 as in the
  real model, hidden 1024, 16 attention heads, 8 routed experts. Only the
  Engram tables are in its safetensors: vLLM must draw every other weight
  (``load_format="dummy"``);

and in both:

* a tokenizer (``tokenizer.json``, through transformers'
  ``PreTrainedTokenizerFast``), one of two:

  - ``words``: a WordLevel vocabulary whose words come in three spellings
    that normalize alike (``word``, ``Word``, `` word``), so the compressed
    map has about a third as many ids as the tokenizer has tokens; large
    enough to hold the image token (``DEAD_TOKEN_ID``, which breaks n-grams);
  - ``text``: a byte-level BPE trained on real text (Python's language
    reference topics, ``pydoc_data.topics``, and a few lines in other
    scripts), whose tokens carry case, spaces, accents and partial UTF-8
    sequences, as a real model's do (the whole model's, 4000 tokens);
* each Engram layer's table (``layers.<L>.engram.embed.weight`` and
  ``.scale``), with as many rows as vLLM's layout gives that layer (the sum
  of its primes), written by ``pleserver.devkit.synthetic``.
"""

from __future__ import annotations

import argparse
import json
import os

from pleclient.engram import DEAD_TOKEN_ID, EngramConfig, bucket_primes, compressed_token_map
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint

SPECIALS = ("<pad>", "<eos>", "<unk>")
WORDS = (DEAD_TOKEN_ID + 64 - len(SPECIALS)) // 3
"""Base words of the ``words`` tokenizer: three spellings each, past the image
token's id."""
OTHER_SCRIPTS = (
    "Café, naïve façade, Ångström, Straße, ĳssel, ﬁnal œuvre.",
    "東京の天気は晴れです。北京欢迎你。서울은 맑습니다.",
    "Москва — столица России. Αθήνα είναι η πρωτεύουσα.",
)
"""Lines the ``text`` tokenizer learns besides the English reference, so that
some of its tokens are partial UTF-8 sequences and accented letters."""

WHOLE_LAYERS = 16
WHOLE_ENGRAM_LAYERS = (1, 14)
"""The real model's Engram layers (0-based): layer 1 has one layer ahead of it."""
WHOLE_ENGRAM_VOCAB = 16_000
"""``engram_vocab_size`` of the whole model by default: the real model's is
16,000,000, whose 2 × 24 primes give 384M-row tables; 16,000 gives two tables
of about 390,000 rows, 206 MB of 264-byte rows in all."""
COMPRESS_RATIOS = (0, 0, 2, 2, 0, 2, 2, 0, 2, 2, 0, 1, 1, 1, 1, 1)
"""Per layer: 0 a sliding window only, 1 a full-length compressed cache, 2 a
ratio-2 one (the only three vLLM 0.33's V4.1 attention takes,
``deepseek_v41/attention.py:320-330``), each five times or more."""
KV_SOURCE_LAYERS = (2, 8, 11, 14)
"""The layers that own a compressor, a compressed cache and the index keys; a
compressed layer reads the nearest one at or below it. As in the real model,
Engram layer 14 is one (``vllm/models/deepseek_v41/amd/mono/README.md``: its
index sources are 2, 8, 14 and 20 with their compressor, then 24, 28, 32 and
36 without)."""
INDEX_SOURCE_LAYERS = (2, 8, 11, 13, 14, 15)
"""The layers that run the sparse indexer. 13 and 15 have no compressor, as
the real model's 24-36: they score against the index keys of the KV source
below them (11 and 14), the shared-key path of ``attention.py:443-466``."""
QUANTIZATIONS: dict[str, dict | None] = {
    "fp8": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "mxfp8": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [32, 32],
    },
    "bf16": None,
}
"""The whole model's ``quantization_config``, which vLLM serves through
``DeepseekV4FP8Config`` (``deepseek_v41/quant_config.py``) with MXFP4 routed
experts (``expert_dtype`` fp4). ``fp8``: block-FP8 linear layers of 128 × 128
(DeepSeek-V4's layout, whose kernels Hopper has); ``mxfp8``: 32 × 32 blocks,
the "native MXFP8 checkpoints" of ``nvidia/model.py:1504`` (MXFP8 linear
layers); ``bf16``: none. Dummy weights then take the quantized kernels."""
VISION_CONFIG = {
    "num_hidden_layers": 2,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
    "rope_theta": 10000.0,
    "downsample_ratio": 3,
    "max_image_tokens": 1024,
    "min_pixels": 295936,
    "max_wh_ratio": None,
}
"""The keys ``DeepseekV41Config`` reads from ``vision_config`` (each has a
default there; here each is set). A tower of any depth: with
``limit_mm_per_prompt={"image": 0}`` vLLM builds it on the meta device and
stubs it. ``num_hidden_layers`` > 0 as in the real model: it gives every MoE
gate the vision bias (``bias_vl``)."""


def engram_config(
    compressed_vocab_size: int,
    layer_ids: tuple[int, ...] = (1, 2),
    *,
    max_ngram_size: int = 4,
    n_heads: int = 3,
    head_dim: int = 64,
    vocab_size: int = 100,
) -> dict:
    """The ``text_config`` Engram keys (vLLM's ``EngramLayout``), for a
    tokenizer of ``compressed_vocab_size`` compressed ids."""
    return {
        "engram_layer_ids": list(layer_ids),
        "engram_max_ngram_size": max_ngram_size,
        "engram_n_heads": n_heads,
        "engram_head_dim": head_dim,
        "engram_compressed_vocab_size": compressed_vocab_size,
        "engram_pad_token_id": 0,
        "engram_vocab_size": vocab_size,
    }


def words_tokenizer():
    """The ``words`` tokenizer: the specials, then each word's three spellings
    one after the other; the image token at the id vLLM gives it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = list(SPECIALS)
    for i in range(WORDS):
        word = f"w{i}"
        vocab += [word, word.capitalize(), " " + word]
    vocab[DEAD_TOKEN_ID] = "<image>"  # (its word's other spellings stay)
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def text_tokenizer(vocab_size: int = 4000):
    """The ``text`` tokenizer: a byte-level BPE (GPT-2's pre-tokenizer and
    decoder) trained on ``real_text()``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(real_text(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def real_text() -> list[str]:
    """Python's language reference topics, then ``OTHER_SCRIPTS``."""
    import pydoc_data.topics as topics

    return [topics.topics[name] for name in sorted(topics.topics)] + list(OTHER_SCRIPTS)


TOKENIZERS = {"words": words_tokenizer, "text": text_tokenizer}


def write_tiny_deepseek_v41(
    model_dir: str,
    *,
    layer_ids: tuple[int, ...] = (1, 2),
    tokenizer: str = "words",
    seed: int = 0,
) -> str:
    """Write the checkpoint into ``model_dir`` with the ``tokenizer`` named
    (``TOKENIZERS``) and tables of ``seed``'s rows; returns it."""
    made = TOKENIZERS[tokenizer]()
    os.makedirs(model_dir, exist_ok=True)
    made.save_pretrained(model_dir)
    text = engram_config(compressed_token_map(made)[1], layer_ids)
    _write_engram_tables(model_dir, text, seed=seed, extra_tensor=True)
    _write_config(
        model_dir,
        {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "text_config": {
                **text,
                "hidden_size": 64,
                "hc_mult": 4,
                "vocab_size": len(made),
                "eos_token_id": 1,
                "num_hidden_layers": max(layer_ids) + 1,
            },
        },
    )
    return model_dir


def whole_model_config(
    compressed_vocab_size: int,
    vocab_size: int,
    *,
    engram_vocab_size: int = WHOLE_ENGRAM_VOCAB,
    quantization: str = "fp8",
) -> dict:
    """The whole model's ``config.json``, for a tokenizer of ``vocab_size``
    tokens and ``compressed_vocab_size`` compressed ids; its
    ``engram_num_embeddings`` is left for the tables to fill.

    Every key vLLM 0.33 reads on the way from ``DeepseekV41Config`` to the
    NVIDIA model's forward is set, those it reads with a default too (paths
    below are under ``vllm/models/deepseek_v41/`` unless named whole). Kept
    as in DeepSeek-V4.1-Flash (``amd/mono/attention/plan.py`` and
    ``stages/seam.py`` hard-code its dimensions), since the kernels fix them
    or the real model's shapes are cheap: ``head_dim`` 512 and
    ``qk_rope_head_dim`` 64 (``compressor.py:286`` asserts both; FlashMLA's
    sparse kernels and its packed ``fp8_ds_mla`` KV record are built for
    them), ``hc_mult`` 4 with 20 Sinkhorn steps, the indexer's 32 heads of 128
    and its top 512, the 128-token window, ``q_lora_rank`` 1280,
    ``o_lora_rank`` 1024 and 8 heads per output group, the Engram geometry (8
    heads of 256, 2- to 4-grams: the shapes of its GGUF conversion). Small:
    16 layers, hidden 1024 (the real model's is 5120; mHC's kernels want a
    multiple of 1024), 16 heads (a TP-4 rank of the real model's 64), 8 routed
    experts of 512, top 2, one shared expert, the vocabulary, the Engram
    tables. Every weight's width is a multiple of 128, as block-FP8 weights
    need. Not the real model's, which no source here gives: each layer's
    compress ratio (the sources follow the real pattern, ``KV_SOURCE_LAYERS``),
    the RoPE thetas (DeepSeek-V4's, transformers' defaults), the YaRN scaling,
    ``max_position_embeddings``.
    """
    check_sparse_topology(COMPRESS_RATIOS, KV_SOURCE_LAYERS, INDEX_SOURCE_LAYERS, WHOLE_LAYERS)
    text = {
        **engram_config(
            compressed_vocab_size,
            WHOLE_ENGRAM_LAYERS,
            n_heads=8,  # the real model's: 3 orders × 8 heads = 24 rows a token
            head_dim=256,  # the real model's: 264-byte served rows
            vocab_size=engram_vocab_size,
        ),
        # The trunk (nvidia/model.py:739-743, 821).
        "vocab_size": vocab_size,
        "hidden_size": 1024,
        "num_hidden_layers": WHOLE_LAYERS,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": None,  # the tokenizer has none, and adds none
        "eos_token_id": 1,
        "pad_token_id": 0,
        # Manifold-constrained hyper-connections (nvidia/model.py:373-375).
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        # Attention (attention.py:301-362).
        "num_attention_heads": 16,
        "num_key_value_heads": 1,  # one shared latent KV head (MLA)
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1280,
        "o_lora_rank": 1024,
        "o_groups": 2,
        "sliding_window": 128,
        "max_position_embeddings": 65536,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        # DeepseekV41Config pops this into rope_parameters: YaRN on the
        # compressed layers (common/rope.py:31-38), factor × original = max.
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        # Sparse attention's topology; candidate filtering off (-1, 0, 0),
        # the defaults attention.py:338-340 and nvidia/model.py:769-770 use.
        "compress_ratios": list(COMPRESS_RATIOS),
        "kv_source_layer_ids": list(KV_SOURCE_LAYERS),
        "index_source_layer_ids": list(INDEX_SOURCE_LAYERS),
        "candidate_source_layer_id": -1,
        "candidate_topk_blocks": 0,
        "candidate_block_size": 0,
        "index_topk": 512,
        "index_n_heads": 32,
        "index_head_dim": 128,
        # Mixture of experts (vllm/models/deepseek_v4/nvidia/model.py:238-320;
        # the real SwiGLU limit and routed scale, amd/mono/stages/moe.py:137-138),
        # no hash-routed layers in V4.1 (nvidia/model.py:153), no MTP.
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 512,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "norm_topk_prob": True,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "topk_method": "noaux_tc",  # a score-correction bias per gate
        "n_group": 1,
        "num_nextn_predict_layers": 0,
        # Names the checkpoint's scale parameters (nvidia/model.py:1501-1512,
        # 1640) and picks MXFP4 experts under a quantization_config.
        "expert_dtype": "fp4",
    }
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "text_config": text,
        "vision_config": dict(VISION_CONFIG),
    }
    if (quantization_config := QUANTIZATIONS[quantization]) is not None:
        config["quantization_config"] = dict(quantization_config)
    return config


def check_sparse_topology(
    ratios: tuple[int, ...],
    kv_sources: tuple[int, ...],
    index_sources: tuple[int, ...],
    layers: int,
) -> None:
    """Raise ``ValueError`` unless vLLM 0.33's V4.1 attention can build the
    layers: the rules it enforces at construction or first use, checked here
    so that a changed layout fails when it is written, not on the GPU host."""
    problems = []
    if len(ratios) != layers:  # layers past the list silently become window-only
        problems.append(f"{len(ratios)} compress ratios for {layers} layers")
    if bad := [r for r in ratios if r not in (0, 1, 2)]:  # attention.py:325
        problems.append(f"compress ratios {bad} (0, 1 or 2 only)")
    if not kv_sources:  # max() at nvidia/model.py:860
        problems.append("no KV source layer")
    for layer in kv_sources:  # compressor.py:266, sparse_mla.py:200
        if not 0 <= layer < len(ratios) or ratios[layer] not in (1, 2):
            problems.append(f"KV source {layer} is not a ratio-1 or ratio-2 layer")
    for layer in index_sources:  # the indexer divides by its ratio (attention.py:1406)
        if not 0 <= layer < len(ratios) or ratios[layer] == 0:
            problems.append(f"index source {layer} is not a compressed layer")
    for layer, ratio in enumerate(ratios):
        if ratio == 0:
            continue
        # attention.py:353-358 takes the nearest source at or below; this
        # layout also keeps its ratio, since the layer reads that source's
        # compressed cache but counts compressed positions with its own.
        for kind, sources in (("KV", kv_sources), ("index", index_sources)):
            below = [s for s in sources if s <= layer]
            if not below:
                problems.append(f"layer {layer} has no {kind} source at or below it")
            elif 0 <= max(below) < len(ratios) and ratios[max(below)] != ratio:
                problems.append(
                    f"layer {layer} (ratio {ratio}) reads {kind} source {max(below)} "
                    f"of ratio {ratios[max(below)]}"
                )
    if problems:
        raise ValueError("DeepSeek-V4.1 sparse attention layout: " + "; ".join(problems))


def write_whole_deepseek_v41(
    model_dir: str,
    *,
    engram_vocab_size: int = WHOLE_ENGRAM_VOCAB,
    quantization: str = "fp8",
    seed: int = 0,
) -> str:
    """Write the whole model into ``model_dir`` (``whole_model_config``, the
    ``text`` tokenizer, the two Engram tables of ``seed``'s rows); returns it.

    The safetensors hold the Engram tables only, values and scales in
    separate files as in the real checkpoint (vLLM draws the other weights
    under ``load_format="dummy"``, which reads no file, and the stock model's
    tables are then to be copied from these)."""
    made = text_tokenizer()
    os.makedirs(model_dir, exist_ok=True)
    made.save_pretrained(model_dir)
    config = whole_model_config(
        compressed_token_map(made)[1],
        len(made),
        engram_vocab_size=engram_vocab_size,
        quantization=quantization,
    )
    _write_engram_tables(model_dir, config["text_config"], seed=seed, extra_tensor=False)
    _write_config(model_dir, config)
    return model_dir


def _write_engram_tables(model_dir: str, text: dict, *, seed: int, extra_tensor: bool) -> None:
    """Write each Engram layer's table, as many rows as the sum of its primes
    (``EngramLayout``), and set ``text``'s ``engram_num_embeddings`` to them
    (vLLM only asks that they be at least that)."""
    config = EngramConfig.from_dict(text)
    tables = [
        SyntheticTable(
            layer=layer, rows=sum(primes), cols=text["engram_head_dim"], dtype="MXFP8", parts=1
        )
        for layer, primes in zip(config.layer_ids, bucket_primes(config), strict=True)
    ]
    text["engram_num_embeddings"] = [t.rows for t in tables]
    write_checkpoint(model_dir, tables, files=2, seed=seed, extra_tensor=extra_tensor)


def _write_config(model_dir: str, config: dict) -> None:
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="where to write the checkpoint")
    parser.add_argument(
        "--tokenizer",
        choices=sorted(TOKENIZERS),
        default="words",
        help="the tiny model's tokenizer (the whole model's is text)",
    )
    parser.add_argument(
        "--whole-model",
        action="store_true",
        help="write the whole 16-layer model for a GPU host, not the tiny one",
    )
    parser.add_argument(
        "--engram-vocab-size",
        type=int,
        default=WHOLE_ENGRAM_VOCAB,
        help="the whole model's engram_vocab_size: its tables have about 24 rows per unit "
        f"each, 264 bytes a row (default {WHOLE_ENGRAM_VOCAB:,}: about 206 MB)",
    )
    parser.add_argument(
        "--quantization",
        choices=sorted(QUANTIZATIONS),
        default="fp8",
        help="the whole model's weights (default fp8: block-FP8 linears, MXFP4 experts)",
    )
    args = parser.parse_args()
    if args.whole_model:
        print(
            write_whole_deepseek_v41(
                args.model_dir,
                engram_vocab_size=args.engram_vocab_size,
                quantization=args.quantization,
            )
        )
    else:
        print(write_tiny_deepseek_v41(args.model_dir, tokenizer=args.tokenizer))


if __name__ == "__main__":
    main()

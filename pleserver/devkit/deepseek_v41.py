"""A tiny DeepSeek-V4.1 checkpoint for the tests: config, tokenizer, Engram tables.

transformers has no DeepSeek-V4.1 model to write one, so it is written by hand
(``python -m pleserver.devkit.deepseek_v41 DIR``):

* ``config.json``: ``DeepseekV41ForCausalLM`` with the Engram keys vLLM's
  ``EngramLayout`` reads in ``text_config`` (no defaults: each is set), for
  two Engram layers;
* a tokenizer (``tokenizer.json``, through transformers'
  ``PreTrainedTokenizerFast``), one of two:

  - ``words``: a WordLevel vocabulary whose words come in three spellings
    that normalize alike (``word``, ``Word``, `` word``), so the compressed
    map has about a third as many ids as the tokenizer has tokens; large
    enough to hold the image token (``DEAD_TOKEN_ID``, which breaks n-grams);
  - ``text``: a byte-level BPE trained on real text (Python's language
    reference topics, ``pydoc_data.topics``, and a few lines in other
    scripts), whose tokens carry case, spaces, accents and partial UTF-8
    sequences, as a real model's do;
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


def engram_config(
    compressed_vocab_size: int,
    layer_ids: tuple[int, ...] = (1, 2),
    *,
    max_ngram_size: int = 4,
    n_heads: int = 3,
    vocab_size: int = 100,
) -> dict:
    """The ``text_config`` Engram keys (vLLM's ``EngramLayout``), for a
    tokenizer of ``compressed_vocab_size`` compressed ids."""
    return {
        "engram_layer_ids": list(layer_ids),
        "engram_max_ngram_size": max_ngram_size,
        "engram_n_heads": n_heads,
        "engram_head_dim": 64,
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
    config = EngramConfig.from_dict(text)
    tables = [
        SyntheticTable(layer=layer, rows=sum(primes), cols=64, dtype="MXFP8", parts=1)
        for layer, primes in zip(layer_ids, bucket_primes(config), strict=True)
    ]
    text["engram_num_embeddings"] = [t.rows for t in tables]
    write_checkpoint(model_dir, tables, files=2, seed=seed)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(
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
            f,
            indent=1,
        )
    return model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="where to write the checkpoint")
    parser.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="words")
    args = parser.parse_args()
    print(write_tiny_deepseek_v41(args.model_dir, tokenizer=args.tokenizer))


if __name__ == "__main__":
    main()

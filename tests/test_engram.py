"""DeepSeek-V4.1's Engram row ids without the model (``pleclient.engram``),
bit for bit as vLLM 0.33's own ``NgramHashState`` computes them: its real
constructor and its ``_hash_ids_kernel`` run by Triton's interpreter on CPU
(``tests/vllm_helpers/engram_scenarios.py``), over two tiny checkpoints
(``pleserver.devkit.deepseek_v41``): one whose tokenizer is a byte-level BPE
trained on real text, hashing real text; one whose vocabulary holds the image
token, hashing chunks that cross it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pleclient.checkpoint import discover_tables
from pleclient.engram import DEAD_TOKEN_ID, EngramConfig, EngramConfigError, EngramHasher
from pleserver.devkit.deepseek_v41 import real_text, write_tiny_deepseek_v41
from tests.vllm_helpers import run_scenario

TRITON_ON_CPU = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}


def chunks_of(requests: list[list[int]], rng: np.random.Generator) -> list[list[dict]]:
    """Batches of chunks of ``requests``: each request whole from position 0,
    then cut in chunks (later ones continue a request, as prefill chunks and
    decode steps do), mixed into batches of up to 4 chunks."""
    pieces = []
    for tokens in requests:
        pieces.append({"tokens": tokens, "start": 0, "length": len(tokens)})
        cuts = sorted({0, len(tokens), *rng.integers(1, len(tokens), 3).tolist()})
        pieces += [
            {"tokens": tokens, "start": a, "length": b - a} for a, b in itertools.pairwise(cuts)
        ]
    order = rng.permutation(len(pieces))
    return [[pieces[i] for i in order[at : at + 4]] for at in range(0, len(order), 4)]


def hashed(model, batches) -> dict:
    return run_scenario(
        "vllm_engram_ids",
        {"model": str(model), "batches": batches},
        module="tests.vllm_helpers.engram_scenarios",
        env=TRITON_ON_CPU,
        timeout=600,
    )


def assert_as_vllm(model, batches, result) -> int:
    """Every chunk's ids from the hasher, against vLLM's; returns ids compared."""
    hasher = EngramHasher.from_checkpoint(str(model))
    compared = 0
    for chunks, want in zip(batches, result["ids"], strict=True):
        want = np.array(want, dtype=np.int64)  # [tokens, layers, hash columns]
        at = 0
        for chunk in chunks:
            tokens, start, length = chunk["tokens"], chunk["start"], chunk["length"]
            for i, layer in enumerate(hasher.layers):
                got = layer.row_ids(tokens[start : start + length], context=tokens[:start])
                expected = want[at : at + length, i]
                assert np.array_equal(got, expected), (layer.layer_id, start, length)
                assert (got >= 0).all() and (got < layer.rows).all()
                compared += got.size
            at += length
    return compared


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return write_tiny_deepseek_v41(str(tmp_path_factory.mktemp("dsv41-text")), tokenizer="text")


@pytest.fixture(scope="module")
def words_model(tmp_path_factory):
    return write_tiny_deepseek_v41(
        str(tmp_path_factory.mktemp("dsv41-words")), tokenizer="words", layer_ids=(1, 14)
    )


def test_real_text_hashes_as_vllm_and_the_constants_are_vllms(text_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_model)
    rng = np.random.default_rng(5)
    documents = real_text()
    picked = [documents[i] for i in rng.choice(len(documents) - 3, 4, replace=False)]
    requests = [tokenizer.encode(d[:600])[:120] for d in [*picked, *documents[-3:]]]
    batches = chunks_of(requests, rng)
    result = hashed(text_model, batches)
    assert assert_as_vllm(text_model, batches, result) > 10_000
    hasher = EngramHasher.from_checkpoint(text_model)
    assert hasher.layers[0].token_map.tolist() == result["token_map"]
    assert hasher.layers[0].pad_id == result["pad_id"]
    for i, layer in enumerate(hasher.layers):
        assert layer.multipliers.tolist() == result["multipliers"][i]
        assert layer.primes.tolist() == [p for order in result["primes"][i] for p in order]
        assert layer.offsets.tolist() == result["offsets"][i]
    # The map collapsed spellings: fewer compressed ids than tokens.
    assert EngramConfig.from_checkpoint(text_model).compressed_vocab_size < len(tokenizer)


def test_an_image_token_stops_the_ngrams_reaching_back_as_in_vllm(words_model):
    rng = np.random.default_rng(11)
    vocab = DEAD_TOKEN_ID + 40
    requests = []
    for _ in range(4):
        tokens = rng.integers(0, vocab, 40)
        tokens[rng.integers(0, 40, 3)] = DEAD_TOKEN_ID  # image spans in the prompt
        requests.append(tokens.tolist())
    requests.append([DEAD_TOKEN_ID] * 6 + [7, 8, 9])  # an image first
    batches = chunks_of(requests, rng)
    result = hashed(words_model, batches)
    assert assert_as_vllm(words_model, batches, result) > 1_000
    layer = EngramHasher.from_checkpoint(words_model).layer(14)
    # Past the image token, the longer n-grams read pad where the shorter do not.
    after = layer.row_ids([5, DEAD_TOKEN_ID, 6, 7])
    plain = layer.row_ids([5, 8, 6, 7])
    heads = layer.config.n_heads
    assert np.array_equal(after[3, :heads], plain[3, :heads])  # 2-gram: 6 7, both
    assert not np.array_equal(after[3, 2 * heads :], plain[3, 2 * heads :])  # 4-gram


def test_the_layers_tables_are_the_checkpoints(words_model):
    hasher = EngramHasher.from_checkpoint(words_model)
    tables = {t.name: t for t in discover_tables(words_model)}
    for layer in hasher.layers:
        assert tables[layer.table].rows == layer.rows  # vLLM's layout: the primes' sum
    assert [layer.rows for layer in hasher.layers] == [1067, 1511]


def test_a_chunk_with_its_context_hashes_as_the_whole_request(text_model):
    layer = EngramHasher.from_checkpoint(text_model).layers[1]
    tokens = np.random.default_rng(2).integers(0, layer.token_map.shape[0], 50)
    whole = layer.row_ids(tokens)
    for start in (1, 2, 3, 17, 49):
        assert np.array_equal(layer.row_ids(tokens[start:], context=tokens[:start]), whole[start:])
        # The last N - 1 previous tokens are enough, given where the chunk starts.
        last = tokens[max(0, start - 3) : start]
        assert np.array_equal(layer.row_ids(tokens[start:], last, start=start), whole[start:])


def test_bad_inputs_are_refused_with_the_reason(text_model, tmp_path):
    layer = EngramHasher.from_checkpoint(text_model).layers[0]
    vocab = layer.token_map.shape[0]
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {vocab}\)"):
        layer.row_ids([1, vocab])
    with pytest.raises(ValueError, match="1-D sequence of token ids"):
        layer.row_ids([[1, 2]])
    with pytest.raises(ValueError, match="negative"):
        layer.row_ids([1], [2], start=-1)
    (tmp_path / "config.json").write_text('{"text_config": {"engram_layer_ids": [1]}}')
    with pytest.raises(EngramConfigError, match="no engram_max_ngram_size"):
        EngramConfig.from_checkpoint(str(tmp_path))


def test_a_tokenizer_of_another_size_is_refused_as_vllm_refuses_it(text_model, words_model):
    from transformers import AutoTokenizer

    with pytest.raises(EngramConfigError, match=r"normalize to \d+ compressed ids, but"):
        EngramHasher.from_checkpoint(text_model, AutoTokenizer.from_pretrained(words_model))

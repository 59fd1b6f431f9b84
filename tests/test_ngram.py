"""``pleclient.ngram`` gives vLLM's ``compute_ngram_ids``, bit for bit, from token ids alone.

The batches are made here (random and real-text tokens, several requests in a
batch, decodes, new prompts, later chunks of a prompt, graph padding, hashes
that overflow); one scenario process runs vLLM 0.33's own modules over them
(``tests/vllm_helpers/ngram_scenarios.py``): every PLE layer of the tiny whole
model as vLLM's loader builds it from its BF16 and FP8 checkpoints and from a
copy whose hash buffers were changed; the plugin tests' FP8, BF16 and NVFP4
layers; and layers at Qwen3.8-Flash-Next's vocabulary. This process hashes the
same batches with ``NgramHasher.from_checkpoint`` of the same directories (no
torch, no vLLM) and compares.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pleclient.checkpoint import CheckpointError, read_header
from pleclient.ngram import (
    NgramConfig,
    NgramConfigError,
    NgramHasher,
    NgramLayer,
    derived_multipliers,
    derived_vocab_layout,
    padded_rows,
)

# The first test waits for the scenario process (vLLM's import, three whole-model loads).
pytestmark = pytest.mark.timeout(900)

SPAN = 2  # ngram_size 3 everywhere: two tokens of context
TINY = {"vocab": 512, "eos": 7}  # tests/vllm_helpers/qwen4_model.py
SYNTHETIC = {"vocab": 1000, "eos": 7}  # tests/vllm_helpers/model.py
FLASH = {"vocab": 248_320, "eos": 248_044}  # Qwen3.8-Flash-Next
FLASH_BASE = 1000  # a small n-gram vocabulary; the hash is the same function
FLASH_DENSE_IDS = (0, 1, 7)
CHUNK_STARTS = (0, 1, 2, 3, 50, 51, 400, 1000)
GRID = [
    # ngram_size, heads_per_ngram, vocab_size, seed, ngram_vocab_size_base, dense_id
    [3, 8, 248_320, 1234, 20_000_000, 0],
    [3, 8, 248_320, 1234, 20_000_000, 3],
    [3, 8, 151_936, 99, 5_000_000, 1],
    [3, 2, 512, 1234, 300, 1],
    [2, 1, 1, 0, 1, 0],
    [2, 3, 7, -5, 2, 4],
    [4, 4, 1000, 2**40, 1000, 2],
    [5, 1, 3, 2**70, 17, 9],
]


# ------------------------------------------------------------------ batches
def real_text_tokens(count: int) -> np.ndarray:
    """Real prose as byte-level tokens (values < 256): Python's language
    reference topics, in order."""
    import pydoc_data.topics as topics

    text = "\n".join(topics.topics[name] for name in sorted(topics.topics))
    return np.frombuffer(text.encode()[:count], dtype=np.uint8).astype(np.int32)


def prompt(family: dict) -> np.ndarray:
    """A long prompt: three documents of real text, EOS between them."""
    text = real_text_tokens(3000)
    return np.concatenate(
        [text[:700], [family["eos"]], text[700:1500], [family["eos"]], text[1500:2100]]
    ).astype(np.int32)


def context_before(tokens: np.ndarray, start: int, eos: int) -> np.ndarray:
    """vLLM's model runner: the ``SPAN`` tokens before ``start``, EOS where none."""
    before = np.full(SPAN, eos, dtype=np.int32)
    known = tokens[max(0, start - SPAN) : start]
    before[SPAN - len(known) :] = known
    return before


def make_batches(family: dict) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """name -> (input_ids, query_start_loc, ngram_context) in vLLM's layout."""
    vocab, eos = family["vocab"], family["eos"]
    rng = np.random.default_rng(vocab)
    batches = {}

    def tokens(n: int, eos_share: float = 0.1) -> np.ndarray:
        t = rng.integers(0, vocab, n).astype(np.int32)
        t[rng.random(n) < eos_share] = eos
        return t

    # Decodes (one token, context from earlier steps), a new prompt (EOS
    # context, an EOS inside), a later chunk, a zero-length request between.
    lengths = [1, 1, 1, 13, 0, 9]
    context = rng.integers(0, vocab, (len(lengths), SPAN)).astype(np.int32)
    context[1, 0] = eos  # a decode whose context holds an EOS
    context[2, 1] = eos
    context[3] = eos  # a new request
    ids = tokens(sum(lengths), 0.0)
    ids[3 + 5] = eos
    batches["mixed"] = (ids, np.cumsum([0, *lengths]).astype(np.int32), context)
    # vLLM's CUDA-graph layout: trailing zero-length requests (EOS context) and
    # padding tokens past the last request.
    lengths = [5, 1, 7]
    real = sum(lengths)
    qsl = np.array([0, *np.cumsum(lengths), *[real] * 5], dtype=np.int32)
    context = np.full((len(qsl) - 1, SPAN), eos, dtype=np.int32)
    context[1] = rng.integers(0, vocab, SPAN)
    batches["graph-padded"] = (tokens(real + 4), qsl, context)
    for k in range(12):
        requests = int(rng.integers(1, 9))
        lengths = rng.integers(0, 40, requests)
        context = tokens(requests * SPAN, [0.0, 0.3, 0.9][k % 3]).reshape(requests, SPAN)
        qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = tokens(int(qsl[-1]) + int(rng.integers(0, 3)), [0.0, 0.05, 0.5][k % 3])
        batches[f"random-{k}"] = (ids, qsl, context)
    # Real text: the prompt in one go, then each chunk as its own step.
    text = prompt(family)
    ends = (*CHUNK_STARTS[1:], len(text))
    start_of_request = context_before(text, 0, eos)[None]
    batches["prompt"] = (text, np.array([0, len(text)], np.int32), start_of_request)
    for i, (start, end) in enumerate(zip(CHUNK_STARTS, ends, strict=True)):
        chunk = text[start:end]
        batches[f"chunk-{i}"] = (
            chunk,
            np.array([0, len(chunk)], np.int32),
            context_before(text, start, eos)[None],
        )
    # Two prompts' later chunks and a new one in one step.
    other = real_text_tokens(5000)[3000:]
    parts = [(text, 900, 1300), (other, 0, 250), (other, 1700, 1701)]
    batches["chunks-together"] = (
        np.concatenate([t[a:b] for t, a, b in parts]),
        np.cumsum([0, *(b - a for _, a, b in parts)]).astype(np.int32),
        np.stack([context_before(t, a, eos) for t, a, _ in parts]),
    )
    # Token ids far past the vocabulary: the int64 hash wraps and goes
    # negative; both sides must floor it into the head's range alike.
    wide = rng.integers(0, 2**62, 64, dtype=np.int64)
    wide[::7] = eos
    batches["wrapping"] = (wide, np.array([0, 40, 64], np.int32), np.full((2, SPAN), eos, np.int64))
    return batches


def write_batches(path: str) -> dict[str, dict]:
    families = {"tiny": TINY, "synthetic": SYNTHETIC, "flash": FLASH}
    made = {name: make_batches(family) for name, family in families.items()}
    arrays = {
        f"{family}/{batch}/{part}": array
        for family, batches in made.items()
        for batch, parts in batches.items()
        for part, array in zip(("ids", "qsl", "context"), parts, strict=True)
    }
    np.savez(path, **arrays)
    return made


def change_buffer(model_dir: str, name: str, change) -> None:
    """Rewrite one int64 hash buffer of a safetensors checkpoint in place."""
    for file in sorted(os.listdir(model_dir)):
        if not file.endswith(".safetensors"):
            continue
        tensors, _ = read_header(os.path.join(model_dir, file))
        if name in tensors:
            entry = tensors[name]
            with open(entry.path, "r+b") as f:
                f.seek(entry.offset)
                values = np.frombuffer(f.read(entry.nbytes), dtype="<i8").copy()
                f.seek(entry.offset)
                f.write(change(values).astype("<i8").tobytes())
            return
    raise AssertionError(f"{name} not in {model_dir}")


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def changed_checkpoint(qwen4_checkpoints, tmp_path_factory) -> str:
    """The tiny BF16 model with hash buffers unlike the config's: a multiplier
    of layer 1 and the first head's modulus of layer 2."""
    path = str(tmp_path_factory.mktemp("ngram") / "changed")
    shutil.copytree(qwen4_checkpoints.bf16, path)
    prefix = "model.layers.{}.ple.ple_embedding."
    multiplier_1 = np.array([0, 2, 0])
    first_head = np.array([4, 0, 0, 0])
    change_buffer(path, prefix.format(1) + "layer_multipliers", lambda v: v + multiplier_1)
    change_buffer(path, prefix.format(2) + "ngram_heads_vocab_sizes", lambda v: v - first_head)
    return path


@pytest.fixture(scope="module")
def vllm_ids(
    qwen4_checkpoints, changed_checkpoint, vllm_checkpoint, vllm_nvfp4_checkpoint, tmp_path_factory
) -> dict:
    pytest.importorskip("vllm")
    from tests.vllm_helpers import run_scenario

    tmp = tmp_path_factory.mktemp("ngram-ids")
    batches = write_batches(str(tmp / "batches.npz"))
    result = run_scenario(
        "vllm_ngram_ids",
        {
            "batches": str(tmp / "batches.npz"),
            "out": str(tmp / "ids.npz"),
            "whole": {
                "bf16": qwen4_checkpoints.bf16,
                "fp8": qwen4_checkpoints.fp8,
                "changed": changed_checkpoint,
            },
            "synthetic": [[str(vllm_checkpoint), [1, 3]], [str(vllm_nvfp4_checkpoint), [5]]],
            "flash": {"base": FLASH_BASE, "dense_ids": list(FLASH_DENSE_IDS)},
            "grid": GRID,
        },
        module="tests.vllm_helpers.ngram_scenarios",
        timeout=600,
    )
    with np.load(tmp / "ids.npz") as z:
        result["ids"] = {key: z[key] for key in z.files}
    result["batches"] = batches
    return result


def flash_layer(dense_id: int) -> NgramLayer:
    config = NgramConfig(eos_token_id=FLASH["eos"], ngram_vocab_size_base=FLASH_BASE)
    return NgramLayer.from_config(config, dense_id)


FAMILY = {
    "bf16": "tiny",
    "fp8": "tiny",
    "changed": "tiny",
    "synthetic": "synthetic",
    "flash": "flash",
}


def assert_equal_to_vllm(vllm_ids, label: str, layer: NgramLayer) -> int:
    """Every batch of the module's family, through ``batch_ids`` and through
    ``row_ids`` per request; returns the ids compared."""
    compared = 0
    for batch, (ids, qsl, context) in vllm_ids["batches"][FAMILY[label.split(":")[0]]].items():
        want = vllm_ids["ids"][f"{label}|{batch}"]
        got = layer.batch_ids(ids, qsl, context)
        assert got.dtype == np.int64 and got.shape == want.shape, (label, batch)
        assert np.array_equal(got, want), (label, batch, np.argwhere(got != want)[:5])
        for r in range(len(qsl) - 1):
            start, end = qsl[r], qsl[r + 1]
            per_request = layer.row_ids(ids[start:end], context=context[r])
            assert np.array_equal(per_request, want[start:end]), (label, batch, r)
        assert (got >= 0).all() and (got < layer.rows).all()
        compared += got.size
    return compared


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("model", ["bf16", "fp8"])
def test_every_ple_layer_of_the_whole_model_hashes_as_vllm(vllm_ids, model, qwen4_checkpoints):
    hasher = NgramHasher.from_checkpoint(getattr(qwen4_checkpoints, model))
    assert [ly.layer for ly in hasher.layers] == [1, 2]  # tests/vllm_helpers/qwen4_model.py
    assert [ly.dense_id for ly in hasher.layers] == [0, 1]
    for layer in hasher.layers:
        # transformers saved the buffers, and vLLM loaded them from there.
        assert set(layer.sources.values()) == {"checkpoint"}
        module = vllm_ids["modules"][f"{model}:{layer.layer}"]
        assert layer.multipliers.tolist() == module["layer_multipliers"]
        assert layer.vocab_sizes.tolist() == module["ngram_heads_vocab_sizes"]
        assert layer.offsets.tolist() == module["ngram_heads_offsets"]
        assert layer.eos_token_id == module["eos"]
        assert layer.table == f"model.layers.{layer.layer}.ple.ple_embedding.ngram_embedding"
        assert assert_equal_to_vllm(vllm_ids, f"{model}:{layer.layer}", layer) > 20_000


def test_the_plugin_tests_fp8_bf16_and_nvfp4_layers_hash_as_vllm(
    vllm_ids, vllm_checkpoint, vllm_nvfp4_checkpoint
):
    layers = [
        *NgramHasher.from_checkpoint(str(vllm_checkpoint)).layers,
        *NgramHasher.from_checkpoint(str(vllm_nvfp4_checkpoint)).layers,
    ]
    assert [(ly.layer, ly.dense_id) for ly in layers] == [(1, 0), (3, 1), (5, 2)]
    for layer in layers:
        # These checkpoints hold no hash buffers: vLLM derives them, and so do we.
        assert set(layer.sources.values()) == {"config"}
        assert assert_equal_to_vllm(vllm_ids, f"synthetic:{layer.layer}", layer) > 80_000


@pytest.mark.parametrize("dense_id", FLASH_DENSE_IDS)
def test_qwen38_flash_next_geometry_hashes_as_vllm(vllm_ids, dense_id):
    layer = flash_layer(dense_id)
    assert (
        layer.heads == 16
        and layer.multipliers.tolist()
        == (vllm_ids["modules"][f"flash:{dense_id}"]["layer_multipliers"])
    )
    assert assert_equal_to_vllm(vllm_ids, f"flash:{dense_id}", layer) > 80_000


def test_checkpoint_hash_buffers_override_the_config_as_in_vllm(
    vllm_ids, changed_checkpoint, qwen4_checkpoints
):
    hasher = NgramHasher.from_checkpoint(changed_checkpoint)
    original = NgramHasher.from_checkpoint(qwen4_checkpoints.bf16)
    for layer in hasher.layers:
        label = f"changed:{layer.layer}"
        # vLLM's ids did change with the buffers ...
        for batch in ("prompt", "mixed"):
            assert not np.array_equal(
                vllm_ids["ids"][f"{label}|{batch}"], vllm_ids["ids"][f"bf16:{layer.layer}|{batch}"]
            )
        # ... ours follow the checkpoint, not the config.
        assert_equal_to_vllm(vllm_ids, label, layer)
        derived = NgramLayer.from_config(hasher.config, layer.dense_id)
        assert not np.array_equal(
            derived.row_ids(vllm_ids["batches"]["tiny"]["prompt"][0]),
            vllm_ids["ids"][f"{label}|prompt"],
        )
    assert hasher.layer(1).multipliers[1] == original.layer(1).multipliers[1] + 2
    assert hasher.layer(2).vocab_sizes[0] == original.layer(2).vocab_sizes[0] - 4


def test_a_wrong_constant_gives_other_ids(vllm_ids, qwen4_checkpoints):
    layer = NgramHasher.from_checkpoint(qwen4_checkpoints.bf16).layer(1)
    ids, qsl, context = vllm_ids["batches"]["tiny"]["mixed"]
    want = vllm_ids["ids"]["bf16:1|mixed"]
    assert np.array_equal(layer.batch_ids(ids, qsl, context), want)

    def bumped(array: np.ndarray, index: int, by: int) -> np.ndarray:
        changed = array.copy()
        changed[index] += by
        return changed

    wrong = {
        f"multiplier {k}": dataclasses.replace(layer, multipliers=bumped(layer.multipliers, k, 2))
        for k in range(3)
    }
    wrong["head size"] = dataclasses.replace(layer, vocab_sizes=bumped(layer.vocab_sizes, 0, -2))
    wrong["head offset"] = dataclasses.replace(layer, offsets=bumped(layer.offsets, 0, 1))
    wrong["eos"] = dataclasses.replace(
        layer, config=dataclasses.replace(layer.config, eos_token_id=8)
    )
    for what, other in wrong.items():
        assert not np.array_equal(other.batch_ids(ids, qsl, context), want), what


def test_chunks_continuing_their_context_hash_as_the_whole_prompt(vllm_ids, qwen4_checkpoints):
    layer = NgramHasher.from_checkpoint(qwen4_checkpoints.bf16).layer(2)
    text = vllm_ids["batches"]["tiny"]["prompt"][0]
    whole = vllm_ids["ids"]["bf16:2|prompt"]
    chunks = [vllm_ids["ids"][f"bf16:2|chunk-{i}"] for i in range(len(CHUNK_STARTS))]
    assert np.array_equal(np.concatenate(chunks), whole)  # vLLM's own chunking
    assert np.array_equal(layer.row_ids(text), whole)
    ends = (*CHUNK_STARTS[1:], len(text))
    for start, end, want in zip(CHUNK_STARTS, ends, chunks, strict=True):
        # The whole prefix as context, or only its last two tokens: the same.
        assert np.array_equal(layer.row_ids(text[start:end], context=text[:start]), want)
        assert np.array_equal(layer.row_ids(text[start:end], context=text[:start][-2:]), want)


def test_derived_buffers_are_vllms_over_a_grid_of_configs(vllm_ids):
    for (ngram_size, per, vocab, seed, base, dense), want in zip(
        GRID, vllm_ids["derived"], strict=True
    ):
        config = NgramConfig(
            eos_token_id=0,
            vocab_size=vocab,
            ngram_size=ngram_size,
            heads_per_ngram=per,
            ngram_vocab_size_base=base,
            seed=seed,
        )
        sizes, offsets = derived_vocab_layout(config, dense)
        assert derived_multipliers(config, dense) == want["multipliers"]
        assert (sizes, offsets, sum(sizes)) == (want["sizes"], want["offsets"], want["total"])


def test_config_defaults_are_transformers_qwen4exp_text_config_defaults(vllm_ids):
    defaults = vllm_ids["transformers_defaults"]
    ours = {f.name: f.default for f in dataclasses.fields(NgramConfig)}
    assert defaults.pop("ple_layer_ids") == list(ours.pop("ple_layer_ids"))
    assert defaults.pop("eos_token_id") is None  # required here: vLLM needs one
    ours.pop("eos_token_id")
    assert ours == defaults


# ------------------------------------------------------- without vLLM at all
def test_hashing_needs_neither_torch_nor_vllm(vllm_checkpoint):
    # The server and vLLM's engine core hash prompts in processes without a model.
    code = (
        "import sys; from pleclient.ngram import NgramHasher; "
        f"h = NgramHasher.from_checkpoint({str(vllm_checkpoint)!r}); h.row_ids(1, range(9)); "
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_context_is_the_requests_previous_tokens():
    layer = flash_layer(0)
    rng = np.random.default_rng(0)
    text = rng.integers(0, FLASH["vocab"], 300)
    eos = FLASH["eos"]
    assert np.array_equal(layer.row_ids(text), layer.row_ids(text, context=[eos, eos]))
    assert np.array_equal(layer.row_ids(text), layer.row_ids(text, context=[]))
    assert np.array_equal(layer.row_ids(text[5:], context=text[:5]), layer.row_ids(text)[5:])
    # One token of context: EOS before it, as vLLM's runner fills the rest.
    assert np.array_equal(layer.row_ids(text[1:], context=text[:1]), layer.row_ids(text)[1:])
    assert layer.row_ids([]).shape == (0, 16)
    out = np.empty((300, 16), dtype=np.int64)
    assert layer.row_ids(text, out=out) is out


def test_hasher_finds_layers_by_index_and_table_name(vllm_checkpoint):
    hasher = NgramHasher.from_checkpoint(str(vllm_checkpoint))
    by_index = hasher.layer(3)
    assert hasher.layer("model.layers.3.ple.ple_embedding.ngram_embedding") is by_index
    assert hasher.layer("layers.3.ple.ple_embedding.ngram_embedding") is by_index
    tokens = np.arange(100)
    assert np.array_equal(hasher.row_ids(3, tokens), by_index.row_ids(tokens))
    with pytest.raises(KeyError, match="no PLE layer"):
        hasher.layer(2)
    with pytest.raises(KeyError, match="no PLE layer"):
        hasher.layer("layers.5.ple.ple_embedding.ngram_embedding")


def test_bad_inputs_are_refused_with_the_reason():
    layer = flash_layer(0)
    with pytest.raises(ValueError, match="1-D array of integers"):
        layer.row_ids(np.ones(4))
    with pytest.raises(ValueError, match="1-D array of integers"):
        layer.row_ids(np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="query_start_loc"):
        layer.batch_ids(np.arange(4), [0, 5], np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="one or more requests"):
        layer.batch_ids(np.arange(4), [0], np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="ngram_context"):
        layer.batch_ids(np.arange(4), [0, 2, 4], np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="out must be"):
        layer.row_ids(np.arange(4), out=np.empty((4, 15), np.int64))


def write_config(path, **config) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"vocab_size": 5}, "no eos_token_id"),
        ({"eos_token_id": [1, 2]}, "a list"),
        ({"eos_token_id": 1, "ngram_size": 1}, "ngram_size must be >= 2"),
        ({"eos_token_id": 1, "heads_per_ngram": "8"}, "heads_per_ngram = '8'"),
        ({"eos_token_id": 1, "ple_layer_ids": 2}, "not a list"),
        ({"text_config": {"vocab_size": 5}}, "text_config: no eos_token_id"),
    ],
)
def test_a_config_vllm_would_refuse_is_refused(tmp_path, config, error):
    with pytest.raises(NgramConfigError, match=error):
        NgramConfig.from_checkpoint(write_config(tmp_path, **config))


def test_nested_text_config_is_read_as_vllm_reads_hf_text_config(tmp_path):
    path = write_config(tmp_path, eos_token_id=1, text_config={"eos_token_id": 9, "seed": 3})
    config = NgramConfig.from_checkpoint(path)
    assert (config.eos_token_id, config.seed, config.vocab_size) == (9, 3, 248_320)


def test_checkpoint_and_config_that_disagree_are_refused(vllm_checkpoint, tmp_path, caplog):
    model = str(tmp_path / "model")
    shutil.copytree(vllm_checkpoint, model)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    with pytest.raises(NgramConfigError, match="not found"):
        NgramHasher.from_checkpoint(str(tmp_path))
    write_config(model, **{**config, "ple_layer_ids": [4, 6]})
    with pytest.raises(NgramConfigError, match=r"decoder layer 1 .* is not a PLE layer"):
        NgramHasher.from_checkpoint(model)
    write_config(model, **{**config, "ngram_vocab_size_base": 600})
    with pytest.raises(NgramConfigError, match="the checkpoint's table has"):
        NgramHasher.from_checkpoint(model)
    # Its config names the NVFP4 checkpoint's layer too: the layers with a
    # table are hashed, and the log says which have none.
    write_config(model, **config)
    with caplog.at_level(logging.WARNING, logger="pleclient.ngram"):
        assert [ly.layer for ly in NgramHasher.from_checkpoint(model).layers] == [1, 3]
    assert "PLE layers [6]" in caplog.text
    os.unlink(os.path.join(model, "model-00002-of-00003.safetensors"))
    with pytest.raises(CheckpointError):
        NgramHasher.from_checkpoint(model)


def test_hash_buffers_vllm_would_refuse_are_refused(qwen4_checkpoints, tmp_path):
    model = str(tmp_path / "model")
    shutil.copytree(qwen4_checkpoints.bf16, model)
    name = "model.layers.1.ple.ple_embedding.ngram_heads_offsets"
    change_buffer(model, name, lambda v: v + 1000)
    with pytest.raises(NgramConfigError, match=r"outside the table's 1248 rows"):
        NgramHasher.from_checkpoint(model)
    change_buffer(model, name, lambda v: v - 1000)
    NgramHasher.from_checkpoint(model)
    sizes = "model.layers.2.ple.ple_embedding.ngram_heads_vocab_sizes"
    change_buffer(model, sizes, lambda v: v * 0)
    with pytest.raises(NgramConfigError, match="must all be positive"):
        NgramHasher.from_checkpoint(model)


def test_derived_layout_without_vllm():
    # The first primes after 20 M at Qwen3.8-Flash-Next's geometry (the
    # trace's documented rows), and after 300 for the tiny model.
    config = NgramConfig(eos_token_id=0)
    sizes, offsets = derived_vocab_layout(config, 0)
    assert sizes[:3] == [20_000_003, 20_000_023, 20_000_033] and offsets[1] == 20_000_003
    assert padded_rows(config, sizes) == 320_001_536
    tiny = NgramConfig(eos_token_id=7, vocab_size=512, heads_per_ngram=2, ngram_vocab_size_base=300)
    assert derived_vocab_layout(tiny, 1)[0] == [331, 337, 347, 349]

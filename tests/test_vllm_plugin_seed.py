"""The seed-interface adapter (``Qwen3_8FlashNextNGramEmbedding``) against a
faithful stand-in of that class (``tests/seed_standin.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.harness import shm_env
from tests.vllm_helpers import run_scenario


@pytest.fixture(scope="module")
def seed(vllm_server, vllm_checkpoint) -> dict:
    return run_scenario(
        "seed_interface", {"model": str(vllm_checkpoint)}, env=shm_env(vllm_server, vllm_checkpoint)
    )


def test_seed_interface_rows_are_bit_identical_to_the_stock_class(seed):
    assert seed["diffs"] == {}


def test_seed_storage_has_no_weight_and_the_scale_moves_to_offload(seed):
    assert seed["storage"] == "ShmVocabEmbedding"
    assert seed["has_weight"] is False
    assert seed["offload_scale"] == 0.0625


def test_lookup_is_the_custom_op_and_compiles_opaquely(seed):
    assert seed["op_registered"]
    assert seed["compiled_equal"]

"""Qwen4Exp with VLLM_PLE_BACKEND=shm gives stock vLLM's PLE rows, bit for bit.

Real vLLM 0.33 ``Qwen4ExpNGramEmbedding`` on CPU inside a vLLM config context:
once with stock storage loaded by vLLM's own ``load_weights``, once patched by
the plugin against a real ple-server serving the same files.
"""

from __future__ import annotations

import concurrent.futures

import pytest

pytest.importorskip("vllm")

from tests.harness import shm_env
from tests.vllm_helpers import run_scenario


@pytest.fixture(scope="module")
def identical(vllm_server, vllm_checkpoint) -> dict:
    # capacity 256 rows: the 70-token batch (1 120 ids) is split over 5 requests
    env = shm_env(vllm_server, vllm_checkpoint, VLLM_PLE_SHM_CAPACITY="256")
    return run_scenario("bit_identical", {"model": str(vllm_checkpoint)}, env=env)


@pytest.fixture(scope="module")
def identical_gpu_driven(vllm_server, vllm_checkpoint) -> dict:
    # The GPU-driven route with its CPU stand-in: 1 120 ids in 3 slots of 512,
    # 16 slots per layer for the 512-token budget.
    env = shm_env(
        vllm_server,
        vllm_checkpoint,
        VLLM_PLE_SHM_CAPACITY="512",
        VLLM_PLE_SHM_GPU_PATH="standin",
    )
    return run_scenario("bit_identical", {"model": str(vllm_checkpoint)}, env=env)


def test_fp8_and_bf16_rows_are_bit_identical_through_forward(identical):
    assert identical["forward_diffs"] == {}
    assert identical["row_path"] == "host"  # a CPU run keeps the host path


def test_the_gpu_driven_route_gives_the_same_bits(identical_gpu_driven):
    assert identical_gpu_driven["row_path"] == "gpu-driven (CPU stand-in)"
    assert identical_gpu_driven["forward_diffs"] == {}
    assert identical_gpu_driven["prefetch_diffs"] == {}
    assert identical_gpu_driven["matches_file_reference"]
    assert identical_gpu_driven["outputs_nonzero"]


def test_fp8_and_bf16_rows_are_bit_identical_through_prefetch(identical):
    assert identical["prefetch_diffs"] == {}


def test_rows_are_the_checkpoint_rows_not_zeros(identical):
    assert identical["outputs_nonzero"]
    assert identical["matches_file_reference"]
    assert identical["server_requests"] > 0


def test_shm_storage_holds_no_table_and_keeps_the_fp8_scale(identical):
    assert identical["shm_weight_numel"] == {"F8_E4M3": 0, "BF16": 0}
    assert identical["stock_weight_rows"] > 10_000
    assert identical["shm_parameters"] == ["ngram_embedding.weight_scale"]
    assert identical["shm_scale"] == 0.0625


def test_tensor_parallel_2_with_and_without_sequence_parallel(
    vllm_server, vllm_checkpoint, tmp_path
):
    env = shm_env(vllm_server, vllm_checkpoint)
    init_file = str(tmp_path / "dist-init")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ranks = list(
            pool.map(
                lambda rank: run_scenario(
                    "tensor_parallel",
                    {
                        "model": str(vllm_checkpoint),
                        "world": 2,
                        "rank": rank,
                        "init_file": init_file,
                    },
                    env=env,
                    timeout=280,
                ),
                range(2),
            )
        )
    for result in ranks:
        assert result["etp"] == 2
        assert result["stock_weight_rows"] == 10520 // 2  # stock: vocab split over ranks
        # Stock sums BF16 rows over the ranks, which makes a -0.0 +0.0; otherwise
        # every bit agrees (FP8 is summed as bytes, so it is exact).
        assert result["diffs_sp0"] == {} and result["diffs_sp1"] == {}
        assert result["reduce_scatter_sp1"] == {"stock": True, "shm": False}
        assert result["rows_sp1"][0][0] * 2 == result["rows_sp0"][0][0]  # SP shards tokens


def test_amd_ngram_embedding_is_patched_and_its_storage_calls_match(vllm_server, vllm_checkpoint):
    result = run_scenario(
        "amd_storage", {"model": str(vllm_checkpoint)}, env=shm_env(vllm_server, vllm_checkpoint)
    )
    assert result["storage"] == "Qwen4ExpPLEShmEmbedding"
    assert result["forward_equal"] and result["sync_lookup_equal"]
    assert result["dequant_equal"]
    assert result["use_reduce_scatter"] is False

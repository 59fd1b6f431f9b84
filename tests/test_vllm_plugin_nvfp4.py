"""NVFP4 PLE tables with VLLM_PLE_BACKEND=shm give stock vLLM's rows, bit for bit.

Real vLLM 0.33 ``Qwen4ExpNGramEmbedding`` with ``ple_embedding_dtype="nvfp4"``
on CPU: once with stock storage loaded by vLLM's own ``load_weights`` (packed
values, block scales, ``weight_scale_2``), once patched by the plugin against a
real ple-server that serves each row as values then block scales.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pleserver.devkit.launcher import LaunchedServer
from tests.harness import server_launcher, shm_env
from tests.vllm_helpers import run_scenario

PREFIX = "model.layers.5.ple.ple_embedding.ngram_embedding"


@pytest.fixture(scope="module")
def nvfp4_server(vllm_nvfp4_checkpoint):
    with server_launcher(vllm_nvfp4_checkpoint).start() as server:
        yield server


@pytest.fixture(scope="module")
def identical(nvfp4_server: LaunchedServer, vllm_nvfp4_checkpoint) -> dict:
    # capacity 256 rows: the 70-token batch (1 120 ids) is split over 5 requests
    env = shm_env(nvfp4_server, vllm_nvfp4_checkpoint, VLLM_PLE_SHM_CAPACITY="256")
    return run_scenario("nvfp4_bit_identical", {"model": str(vllm_nvfp4_checkpoint)}, env=env)


@pytest.fixture(scope="module")
def identical_gpu_driven(nvfp4_server: LaunchedServer, vllm_nvfp4_checkpoint) -> dict:
    # The GPU-driven route's CPU stand-in: served rows, then the decode.
    env = shm_env(
        nvfp4_server,
        vllm_nvfp4_checkpoint,
        VLLM_PLE_SHM_CAPACITY="512",
        VLLM_PLE_SHM_GPU_PATH="standin",
    )
    return run_scenario("nvfp4_bit_identical", {"model": str(vllm_nvfp4_checkpoint)}, env=env)


def test_nvfp4_through_the_gpu_driven_route_is_bit_identical(identical_gpu_driven):
    assert identical_gpu_driven["row_path"] == "gpu-driven (CPU stand-in)"
    assert identical_gpu_driven["forward_diffs"] == {}
    assert identical_gpu_driven["prefetch_diffs"] == {}
    assert identical_gpu_driven["matches_file_reference"]


def test_stock_side_is_vllms_nvfp4_method(identical):
    assert identical["stock_method"] == "Qwen4ExpPLENvFp4EmbeddingMethod"
    assert identical["stock_paths_agree"]


def test_nvfp4_rows_are_bit_identical_through_forward(identical):
    assert identical["forward_diffs"] == {}


def test_nvfp4_rows_are_bit_identical_through_prefetch(identical):
    assert identical["prefetch_diffs"] == {}


def test_nvfp4_rows_are_decoded_checkpoint_rows_not_zeros(identical):
    assert identical["outputs_nonzero"]
    assert identical["row_dtype"] == "torch.bfloat16"  # decoded, as stock's lookup
    assert identical["matches_file_reference"]
    assert identical["server_requests"] > 0


def test_shm_storage_holds_no_table_and_loads_weight_scale_2_as_stock(identical):
    assert identical["shm_table_numel"] == {"weight": 0, "weight_scale": 0}
    assert identical["stock_weight_shapes"][0][1] == 8  # 16 columns packed in 8 bytes
    assert identical["stock_weight_shapes"][1][1] == 1  # one block scale per 16
    assert identical["shm_parameters"] == ["ngram_embedding.weight_scale_2"]
    assert identical["shm_loaded"] == ["ngram_embedding.weight_scale_2"]
    assert identical["shm_global_scale"] == pytest.approx(0.0123)


def test_loader_never_reads_nvfp4_values_or_block_scales(vllm_nvfp4_checkpoint):
    result = run_scenario(
        "loader_reads", {"model": str(vllm_nvfp4_checkpoint)}, env={"VLLM_PLE_BACKEND": "shm"}
    )
    read = [name for names in result["reads"].values() for name in names]
    assert not any(".shard_" in name for name in read), read
    assert f"{PREFIX}.weight_scale_2" in result["yielded"]


def test_loader_without_plugin_reads_values_and_block_scales(vllm_nvfp4_checkpoint):
    """The counting above is meaningful: stock vLLM reads 4 + 4 shard tensors."""
    result = run_scenario("loader_reads", {"model": str(vllm_nvfp4_checkpoint)})
    read = [name for names in result["reads"].values() for name in names]
    assert sum(name.endswith(".weight") and ".shard_" in name for name in read) == 4
    assert sum(name.endswith(".weight_scale") and ".shard_" in name for name in read) == 4
